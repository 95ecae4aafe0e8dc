"""The norm kernel gives a Llama-family RMS norm module's own bits, and is used for no other."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from rag_speculate.cpu.norm import norm_for, on_x86, rms_norm

pytestmark = pytest.mark.skipif(not on_x86(), reason="the norm kernel follows torch's sums on x86 CPUs only")


def _norm(kind, size: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    norm = kind(size, eps=1e-6)
    norm.weight.data = torch.randn(size, generator=torch.Generator().manual_seed(size))
    return norm.to(dtype)


# Sizes around torch's vectors (8 floats) and its four streams of them, the hidden sizes of
# the packaged models, and one long enough that the sum's cascade folds several levels.
@pytest.mark.parametrize("size", [8, 9, 16, 31, 33, 64, 100, 129, 257, 513, 576, 896, 1536, 2049, 8960, 300_007])
@pytest.mark.parametrize("kind", [LlamaRMSNorm, Qwen2RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_gives_the_modules_bits(kind, size, dtype):
    norm = _norm(kind, size, dtype)
    generator = torch.Generator().manual_seed(1)
    for rows, scale in ((1, 1.0), (3, 1e-4), (5, 40.0)):
        x = (torch.randn(1, rows, size, generator=generator) * scale).to(dtype)
        with torch.inference_mode():
            assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x)), (rows, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_for_serves_a_module_it_checked_and_falls_back_for_what_it_does_not_take(dtype):
    norm = _norm(Qwen2RMSNorm, 64, dtype)
    forward = norm_for(norm)
    assert forward is not None
    x = torch.randn(2, 7, 64).to(dtype)
    with torch.inference_mode():
        assert torch.equal(forward(x), norm(x))
        assert torch.equal(forward(x[:, ::2]), norm(x[:, ::2]))  # not contiguous
        assert torch.equal(forward(x.double()), norm(x.double()))  # not the weight's dtype: the module's own
    assert rms_norm(x.half(), norm.weight.half(), 1e-6) is None
    assert rms_norm(x.float(), norm.weight.bfloat16(), 1e-6) is None  # dtypes mixed
    assert rms_norm(x[..., :4], norm.weight[:4], 1e-6) is None  # shorter than torch's vectors


class _OnePlusWeight(LlamaRMSNorm):
    """A norm of another formula (Gemma's scales by 1 + weight) under the same attributes."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return (1 + self.weight) * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def test_a_norm_of_another_formula_keeps_its_own_forward():
    assert norm_for(_norm(_OnePlusWeight, 64)) is None
    assert norm_for(torch.nn.LayerNorm(64)) is None  # no variance_epsilon


class _ReversedSum(LlamaRMSNorm):
    """The same formula with its mean summed from the row's other end: other bits on some rows only."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.flip(-1).pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.mark.parametrize("size", [64, 896, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_summing_in_another_order_keeps_its_own_forward(size, dtype):
    # Three probe rows of these sizes give the kernel's bits by chance: the probe must hold more
    # (and a bf16 module's rows in fp32 too, its rounding to bf16 hiding most of the difference).
    assert norm_for(_norm(_ReversedSum, size, dtype)) is None
