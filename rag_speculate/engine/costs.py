"""The target's forward cost by tokens fed, timed once per model and machine and kept on disk.

Timing a curve costs a few seconds, so it is saved under the cache folder keyed by everything the
cost depends on: the model's shapes, dtype and device, what computes its linear layers (and the CPU
kernels' code), the traits that pick its forward, the step that verifies (the fixed-shape step, CUDA
graphs replaying it), the chip, torch and the threads.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from ..decoding.budget import CostModel
from ..devices import processor
from ..files.cache import cache_dir
from .traits import ModelTraits

logger = logging.getLogger(__name__)

# Bumped when how the cost curve is measured changes, so curves saved before are timed again.
_VERSION = 3


def cost_curve(
    model: torch.nn.Module, traits: ModelTraits, timed: Callable[[], Callable[[int], None]], longest: int, step: str
) -> CostModel:
    """The curve saved for this model, machine and `step` (what verifies: "growing", "static",
    "cuda graphs"), else timed now through `timed()` (a forward over q tokens, as the engine runs its
    verifications) up to `longest` tokens and saved."""
    path = _path(model, traits, longest, step)
    curve = CostModel.load(path)
    if curve is None:
        curve = CostModel.measure(timed(), longest)
        try:
            curve.save(path)
        except OSError as error:  # a read-only cache costs a timing per engine, nothing more
            logger.info("cannot save the cost curve at %s: %s", path, error)
    return curve


def _linear_kinds(model: torch.nn.Module) -> list[str]:
    """What computes the model's linear layers: plain weights by dtype, a tensor subclass by name,
    layers of their own (quantized ones) by their description; a layer's cost depends on it."""
    kinds = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            kinds.add(f"{type(module.weight).__name__} {module.weight.dtype}")
        elif getattr(module, "rows_alone", False):
            kinds.add(f"{type(module).__name__} {module.extra_repr()}")
    return sorted(kinds)


def _kernels(traits: ModelTraits) -> str:
    """The CPU kernels' code where the forwards run them (a change to them changes every cost), else ""."""
    if not traits.kernels:
        return ""
    from ..cpu.build import sources_digest  # only a model on the CPU loads the kernels

    return sources_digest()


def _path(model: torch.nn.Module, traits: ModelTraits, longest: int, step: str) -> Path:
    config = model.config.to_dict()
    shape = {key: config.get(key) for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads", "vocab_size")}  # fmt: skip
    identity = {
        "version": _VERSION, "shape": shape, "dtype": str(traits.dtype), "device": traits.device.type,
        "linear": _linear_kinds(model), "kernels": _kernels(traits), "lean": bool(traits.lean_forward),
        "tree": bool(traits.tree_attention), "rows": bool(traits.rows), "step": step, "longest": longest,
        "processor": processor(traits.device), "torch": torch.__version__, "threads": torch.get_num_threads(),
    }  # fmt: skip
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "costs" / f"{digest}.json"
