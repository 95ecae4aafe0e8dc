"""Loading a target model and its tokenizer from any of the names users have for it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from . import packaged
from ..cpu import cpu_flags
from ..errors import InvalidArgumentError
from .device import Device, resolve_device


def default_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bf16 where the hardware computes in it (GPUs, CPUs with AVX512-BF16 or AMX), else fp32.

    On an AVX2-only CPU bf16 matrix products are emulated, so a prefill or a forward over several
    tokens (every verification step) is several times slower than in fp32, which outweighs the
    little bf16 saves on a single-token step.
    """
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    flags = cpu_flags()
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32


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
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        source, extra = str(path.parent), {"gguf_file": path.name}
    elif path.exists() or "/" in name_or_path:
        source, extra = name_or_path, {}
    else:
        raise InvalidArgumentError(
            f"unknown model {name_or_path!r}: not a packaged model ({', '.join(packaged.packaged_model_names())}), "
            "a .gguf file, a local folder, nor a Hugging Face id like 'org/name'"
        )
    if progress:
        progress(f"loading {name_or_path}")
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra).to(device).eval()
    return model, tokenizer
