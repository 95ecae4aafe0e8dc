"""Models by name: the packaged ones (`packaged`: the registry, the GGUF file, the converted cache)
and loading any model (`loading`)."""

from .packaged import get_packaged_model, is_packaged_model, packaged_model_names

__all__ = ["get_packaged_model", "is_packaged_model", "packaged_model_names"]
