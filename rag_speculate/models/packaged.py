"""Real models shipped as PyPI distributions, loaded fully offline: the public names, in one place.

Loading a packaged model takes three steps, each cached under `files.cache.cache_dir`:

1. find its GGUF file in the distributions named by the registry (``registry.py``), assembling a
   split model's parts, and verify its sha256 (``gguf_file.py``);
2. on first use per dtype, load that file through transformers, which dequantizes every tensor,
   and save the result as safetensors with a manifest (``converted_cache.py``);
3. load that safetensors cache, a plain ``from_pretrained``.
"""

from __future__ import annotations

from .converted_cache import (
    CACHE_FORMAT_VERSION,
    MANIFEST_NAME,
    SUPPORTED_DTYPES,
    WEIGHTS_NAME,
    converted_dir,
    load_packaged_model,
    load_packaged_tokenizer,
)
from .gguf_file import Progress, gguf_path
from .registry import (
    PACKAGED_MODELS,
    PackagedModel,
    get_packaged_model,
    is_packaged_model,
    packaged_model_names,
)

__all__ = [
    "CACHE_FORMAT_VERSION",
    "MANIFEST_NAME",
    "PACKAGED_MODELS",
    "SUPPORTED_DTYPES",
    "WEIGHTS_NAME",
    "PackagedModel",
    "Progress",
    "converted_dir",
    "get_packaged_model",
    "gguf_path",
    "is_packaged_model",
    "load_packaged_model",
    "load_packaged_tokenizer",
    "packaged_model_names",
]
