"""CPU kernels for the forwards of models on the CPU: an optional layer below the engine.

Nothing under `decoding/`, `drafters/` or `retrieval/` imports it. The engine asks `forward_context`
for the context a model's forwards run in (its own model's, and a draft model's, which it hands to
the drafter), and only there, for a model on the CPU, are the kernel modules imported.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from ..errors import InvalidArgumentError


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
        raise InvalidArgumentError(f"fast_kernels=True, but {reason}")
    return None


def kernel_functions() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Callable, Callable]:
    """`F.linear` and `F.scaled_dot_product_attention` through the kernels (torch's where they do
    not serve the arguments), and `norm_for` and `rotary_for` (a norm module's forward, a model's
    rotary function, through a kernel where it gives their bits), for a forward that calls them
    itself rather than through the mode."""
    from .kernels import linear, scaled_dot_product_attention
    from .norm import norm_for
    from .rotary import rotary_for

    return linear, scaled_dot_product_attention, norm_for, rotary_for
