"""Loading a target model and its tokenizer from any of the names users have for it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..devices import Device, default_dtype, resolve_device
from ..errors import InvalidArgumentError
from . import packaged


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | None = None,
    device: Device = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A packaged model name, a `.gguf` file, a local folder or a Hugging Face model id, on `device`
    (None: CUDA when available, else the CPU; `resolve_device`) in `dtype` (None: `default_dtype`)."""
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    if packaged.is_packaged_model(name_or_path):
        return packaged.load_packaged_model(name_or_path, dtype=dtype, device=device, progress=progress)
    source, extra = _source(name_or_path)
    if progress:
        progress(f"loading {name_or_path}")
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra).to(device).eval()
    return model, tokenizer


def load_tokenizer(name_or_path: str, *, progress: Callable[[str], None] | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer alone, without its weights: all that indexing a corpus or checking an
    index against a model needs."""
    if packaged.is_packaged_model(name_or_path):
        return packaged.load_packaged_tokenizer(name_or_path, progress=progress)
    source, extra = _source(name_or_path)
    return AutoTokenizer.from_pretrained(source, **extra)


def _source(name_or_path: str) -> tuple[str, dict]:
    """Where transformers loads a model that is not packaged from, and how."""
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        return str(path.parent), {"gguf_file": path.name}
    if path.exists() or "/" in name_or_path:
        return name_or_path, {}
    raise InvalidArgumentError(
        f"unknown model {name_or_path!r}: not a packaged model ({', '.join(packaged.packaged_model_names())}), "
        "a .gguf file, a local folder, nor a Hugging Face id like 'org/name'",
        "model",
    )
