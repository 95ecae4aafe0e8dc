"""The CPU kernels carried by a model's own modules: `carry_kernels`.

The engine runs its forwards through the kernels (each row computed as if alone), so a model it
quantized must compute the same way through its own forward, for its own `generate` to give the
engine's answer outside any mode. Its quantized layers already run their kernel; this gives the
rest what the kernels' mode (`kernels.FastKernels`) would: its attention, registered through
transformers' attention interface, and its layers left dense. Only models the library builds are
changed so: a model a user passes to the engine is never modified.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kernels import FastKernels, linear

# The attention implementation's name, as `model.config._attn_implementation` reads it.
ATTENTION = "rag_speculate_cpu"


def attention_forward(*args, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with its `F.scaled_dot_product_attention` call through the
    kernel: the very arguments, so the very bits, the model's forward gets inside the kernels' mode."""
    with FastKernels():
        return sdpa_attention_forward(*args, **kwargs)


class KernelLinear(torch.nn.Linear):
    """A dense layer whose product runs through the linear kernel where it serves, as in the mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def carry_kernels(model: PreTrainedModel) -> None:
    """Make `model`'s own forward compute as the engine's forwards do, in place: each dense
    `torch.nn.Linear` through the linear kernel, and its attention through the kernel where it is
    transformers' SDPA (the mode reroutes nothing else: eager attention is the same either way)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = KernelLinear
    if model.config._attn_implementation == "sdpa":
        AttentionInterface.register(ATTENTION, attention_forward)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
        model.set_attn_implementation(ATTENTION)
