"""The CPU kernels the engine runs its forwards with: `FastKernels`, a torch function mode.

A mode reaches the linear layers and the attention of an unmodified transformers model, and only
inside the forwards it wraps (the engine's, or a benchmark's baseline given the same kernels); the
model and its weights are untouched. It costs every torch call of those forwards a Python
dispatch, so only the forwards of models it serves run inside it.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .attention import small_attention
from .linear import linear_kernel_for


class FastKernels(TorchFunctionMode):
    """Within this context, on CPU: `F.linear` over 1-64 rows of fp32 (1-48 of bf16) runs
    linear.py's kernels, and bf16 attention over 1-48 query rows runs attention.py's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            kernel = linear_kernel_for(x, weight, bias)
            if kernel is not None:
                return kernel(x, weight, bias)
        elif func is F.scaled_dot_product_attention:
            out = small_attention(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
