"""Loading a target model and its tokenizer from any of the names users have for it."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from . import models
from .errors import InvalidArgumentError


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A packaged model name, a `.gguf` file, a local folder or a Hugging Face model id."""
    if models.is_packaged_model(name_or_path):
        return models.load_packaged_model(name_or_path, dtype=dtype, device=device, progress=progress)
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        source, extra = str(path.parent), {"gguf_file": path.name}
    elif path.exists() or "/" in name_or_path:
        source, extra = name_or_path, {}
    else:
        raise InvalidArgumentError(
            f"unknown model {name_or_path!r}: not a packaged model ({', '.join(models.packaged_model_names())}), "
            "a .gguf file, a local folder, nor a Hugging Face id like 'org/name'"
        )
    if progress:
        progress(f"loading {name_or_path}")
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra).to(device).eval()
    return model, tokenizer
