"""Loading a target model and its tokenizer from any of the names users have for it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..devices import Device, default_dtype, resolve_device
from ..errors import InvalidArgumentError, ModelPackageError
from . import packaged
from .gguf_check import check_gguf
from .gguf_file import dense_gguf

# What transformers raises for a model that does not load, by where it fails: a missing or unreadable
# file, a bad config or tokenizer, a GGUF architecture or tensor type it lacks, weights that do not fit.
_LOAD_ERRORS = (OSError, ValueError, KeyError, IndexError, RuntimeError, SafetensorError)


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | None = None,
    device: Device = None,
    progress: Callable[[str], None] | None = None,
    quantization: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A packaged model name, a `.gguf` file, a local folder or a Hugging Face model id, on `device`
    (None: CUDA when available, else the CPU; `resolve_device`) in `dtype` (None: `default_dtype`),
    its linear layers quantized if asked (`quantization`: "int8", "int4", or "gguf" for a GGUF
    file's own quantized tensors; see `rag_speculate.quantization`)."""
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    gguf = _check_quantization(name_or_path, quantization, dtype, device)
    if packaged.is_packaged_model(name_or_path):
        model, tokenizer = packaged.load_packaged_model(name_or_path, dtype=dtype, device=device, progress=progress)
    else:
        source, extra = _source(name_or_path)
        if progress:
            progress(f"loading {name_or_path}")
        with _loading(name_or_path):
            tokenizer = AutoTokenizer.from_pretrained(source, **extra)
            if "gguf_file" in extra:
                extra = dense_gguf(extra["gguf_file"])
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra)
        model = model.to(device).eval()
    if quantization:
        from ..quantization.gguf import gguf_layers
        from ..quantization.layer import quantize_model

        if progress:
            progress(f"quantizing the linear layers ({quantization})")
        quantize_model(model, quantization, gguf_layers(model, gguf) if gguf else None)
    return model, tokenizer


def _check_quantization(name_or_path: str, quantization: str | None, dtype: torch.dtype, device: torch.device) -> str | None:
    """Refuse a quantization the kernels cannot serve, before anything loads; the GGUF file "gguf" reads."""
    if quantization is None:
        return None
    from ..quantization.layer import METHODS

    if quantization not in METHODS:
        raise InvalidArgumentError(f"unknown quantization {quantization!r}: one of {', '.join(METHODS)}", "quantization")
    if device.type != "cpu":
        raise InvalidArgumentError(
            f"quantization={quantization!r} runs on the CPU kernels, not on {device}: on a GPU, load a model "
            "quantized through transformers' quantization_config (bitsandbytes, GPTQ, AWQ, torchao) and pass it to the engine",
            "quantization",
        )
    from ..cpu.linear import linear_library

    for fmt in ("q8", "q4") if quantization == "gguf" else ("q8" if quantization == "int8" else "q4",):
        library, reason = linear_library(dtype, fmt)
        if library is None:
            raise InvalidArgumentError(f"quantization={quantization!r} cannot run here: {reason}", "quantization")
    if quantization != "gguf":
        return None
    if packaged.is_packaged_model(name_or_path):
        return str(packaged.gguf_path(name_or_path))
    if Path(name_or_path).suffix == ".gguf":
        return name_or_path
    raise InvalidArgumentError(
        f"quantization='gguf' keeps a GGUF file's own tensors: {name_or_path!r} is not a .gguf file or a packaged model", "quantization"
    )


def load_tokenizer(name_or_path: str, *, progress: Callable[[str], None] | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer alone, without its weights: all that indexing a corpus or checking an
    index against a model needs."""
    if packaged.is_packaged_model(name_or_path):
        return packaged.load_packaged_tokenizer(name_or_path, progress=progress)
    source, extra = _source(name_or_path)
    with _loading(name_or_path):
        return AutoTokenizer.from_pretrained(source, **extra)


def _source(name_or_path: str) -> tuple[str, dict]:
    """Where transformers loads a model that is not packaged from, and how: a .gguf file once
    `check_gguf` has read it within its bounds, a folder holding a config, or a hub id."""
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        check_gguf(path)
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPackageError(f"{path} is a folder but not a model folder: it has no config.json")
        return name_or_path, {}
    if path.exists():
        raise ModelPackageError(f"{path} is neither a .gguf file nor a model folder")
    # A hub id is exactly "owner/name"; anything else with a slash is a path that is not there.
    if path.is_absolute() or name_or_path.startswith(".") or name_or_path.count("/") > 1:
        raise ModelPackageError(f"no model at {path}: no such file or folder")
    if "/" in name_or_path:
        return name_or_path, {}
    raise InvalidArgumentError(
        f"unknown model {name_or_path!r}: not a packaged model ({', '.join(packaged.packaged_model_names())}), "
        "a .gguf file, a local folder, nor a Hugging Face id like 'org/name'",
        "model",
    )


@contextmanager
def _loading(name_or_path: str) -> Iterator[None]:
    """transformers failing to load `name_or_path`, as one ModelPackageError naming it on one line:
    its own errors are of many types for one fault, and span lines."""
    try:
        yield
    except _LOAD_ERRORS as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ModelPackageError(f"{name_or_path} does not load as a model: {reason}") from error
