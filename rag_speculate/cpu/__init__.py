"""CPU kernels for decoding and verification forwards: an optimisation layer the core never imports.

The engine and the draft model ask `forward_context` (through `decoding.forward.kernel_context`) for
the context their forwards run in; only there, and only for a model on the CPU, are the kernel
modules imported.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (none elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def forward_context(model: torch.nn.Module, *, required: bool = False) -> Callable[[], AbstractContextManager] | None:
    """The mode `model`'s forwards run in to use the CPU kernels, or None where they cannot
    (`required`: an error saying why). On any device but the CPU they never do."""
    device = next(model.parameters()).device
    reason = f"the CPU kernels are for models on the CPU, this one is on {device}"
    if device.type == "cpu":
        from .linear import fast_linear_works

        works, reason = fast_linear_works(model)
        if works:
            from .kernels import FastKernels

            return FastKernels
    if required:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"fast_kernels=True, but {reason}")
    return None
