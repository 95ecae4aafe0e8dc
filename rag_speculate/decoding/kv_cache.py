"""The target's KV cache across verification steps: made once per generation, cut back to the accepted path."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """Layers, key and value heads, and head dim of `model`'s cache, as its config states them."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, head_dim


def make_cache(model: PreTrainedModel) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            # Sliding layers otherwise forget the oldest entries as soon as draft tokens arrive,
            # before we know which drafts survive.
            layer.activate_past_recording()
    return cache


def keep_cache_entries(cache: DynamicCache, new_entries: int, keep: list[int]) -> None:
    """Of the last `new_entries` cache slots, keep those at offsets `keep` (ascending), in that order."""
    contiguous = keep == list(range(len(keep)))
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            continue
        start = layer.keys.shape[-2] - new_entries
        if not contiguous:
            index = torch.tensor(keep, device=layer.keys.device) + start
            end = start + len(keep)
            layer.keys[:, :, start:end] = layer.keys.index_select(2, index)
            layer.values[:, :, start:end] = layer.values.index_select(2, index)
        # crop(0) still matters for sliding-window layers: it trims them back to their window.
        layer.crop(-(new_entries - len(keep)))


def sliding_window(cache: DynamicCache) -> int | None:
    windows = [layer.sliding_window for layer in cache.layers if getattr(layer, "is_sliding", False)]
    return min(windows) if windows else None


def window_holds(cache: DynamicCache, length: int) -> bool:
    """Whether `length` tokens fit in every sliding window of `cache` (always, without one). Only then
    can a forward verify a draft tree: its mask cannot say what a window forgot."""
    window = sliding_window(cache)
    return window is None or length < window


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which `model`'s forward takes its KV cache: `cache` in recent transformers
    releases, which deprecate `past_key_values`; `past_key_values` in earlier ones and in models
    written for them. Read off the first forward in the model's class hierarchy that names either,
    so a subclass whose forward takes only `**kwargs` gets its base's."""
    for cls in type(model).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is None:
            continue
        parameters = inspect.signature(forward).parameters
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
    return "past_key_values"
