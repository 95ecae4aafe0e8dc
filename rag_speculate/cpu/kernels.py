"""The CPU kernels a model's forwards run with: `FastKernels`, a torch function mode.

A mode reaches the linear layers and the attention of an unmodified transformers model, and only
inside the forwards it wraps (the engine's, or a benchmark's baseline given the same kernels); the
model and its weights are untouched. It costs every torch call of those forwards a Python
dispatch, so only the forwards of models it serves run inside it.

The invariant these kernels keep, in fp32 and bf16: a row's result never depends on the other rows
of its forward. A linear layer computes each row of its output by the same operations whether it
is alone (one decoding step), among a draft tree's rows, or among a prefill's hundreds; attention
computes each query row over the entries it sees, and adds exactly nothing for those it does not.
So a token gets the same logits wherever the prompt cache cut its prompt and whatever was
verified beside it, and a request's answer does not depend on what came before it
(`tests/cpu/test_invariance.py` checks it row by row; torch's own kernels do not keep it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .attention import attention
from .linear import linear_kernel_for


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` through the kernel where it serves the arguments, else torch's."""
    kernel = linear_kernel_for(x, weight, bias)
    return kernel(x, weight, bias) if kernel is not None else F.linear(x, weight, bias)


def scaled_dot_product_attention(*args, **kwargs) -> torch.Tensor:
    """`F.scaled_dot_product_attention` through the kernel where it serves the arguments, else torch's."""
    out = attention(*args, **kwargs)
    return out if out is not None else F.scaled_dot_product_attention(*args, **kwargs)


class FastKernels(TorchFunctionMode):
    """Within this context, on CPU: `F.linear` and `F.scaled_dot_product_attention` over fp32 or
    bf16 run this layer's kernels wherever they serve the arguments. A forward that calls them
    itself (`decoding/lean_forward.py`) takes `linear` and `scaled_dot_product_attention` instead,
    and saves every other operator the mode's dispatch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return scaled_dot_product_attention(*args, **kwargs)
        return func(*args, **kwargs)
