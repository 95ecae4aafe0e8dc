"""CPU kernels for the forwards of models on the CPU: an optional layer below the engine.

Nothing under `decoding/`, `drafters/` or `retrieval/` imports it. The engine asks `forward_context`
for the context a model's forwards run in (its own model's, and a draft model's, which it hands to
the drafter), and only there, for a model on the CPU, are the kernel modules imported.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch


def forward_context(model: torch.nn.Module) -> tuple[Callable[[], AbstractContextManager] | None, str]:
    """The mode `model`'s forwards run in to use the CPU kernels, or None and why they cannot. On any
    device but the CPU they never do."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        return None, f"the CPU kernels are for models on the CPU, this one is on {device}"
    from .linear import linear_unsupported

    reason = linear_unsupported(model)
    if reason:
        return None, reason
    from .kernels import FastKernels

    return FastKernels, ""


def kernel_functions() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Callable, Callable]:
    """`F.linear` and `F.scaled_dot_product_attention` through the kernels (torch's where they do
    not serve the arguments), and `norm_for` and `rotary_for` (a norm module's forward, a model's
    rotary function, through a kernel where it gives their bits), for a forward that calls them
    itself rather than through the mode."""
    from .kernels import linear, scaled_dot_product_attention
    from .norm import norm_for
    from .rotary import rotary_for

    return linear, scaled_dot_product_attention, norm_for, rotary_for
