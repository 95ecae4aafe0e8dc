"""Models: the packaged ones (`packaged`), loading any model by name (`loading`), int8 draft models
(`int8`) and a draft model's lean forward (`lean_forward`)."""

from .packaged import cache_dir, get_packaged_model, is_packaged_model, packaged_model_names

__all__ = ["cache_dir", "get_packaged_model", "is_packaged_model", "packaged_model_names"]
