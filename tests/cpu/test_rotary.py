"""The rotary kernel gives a model's own `apply_rotary_pos_emb` bits, and is used for no other formula."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb as qwen2_rotary

from rag_speculate.cpu.rotary import rotary_for, rotary_library

pytestmark = pytest.mark.skipif(rotary_library()[0] is None, reason="no C compiler to build the rotary kernel")


def _heads(batch: int, rows: int, heads: int, kv_heads: int, dims: int, generator: torch.Generator, dtype=torch.float32):
    """Queries, keys and values as a forward holds them: views of one product's output."""
    out = torch.randn(batch, rows, (heads + 2 * kv_heads) * dims, generator=generator).to(dtype)
    sizes = [heads * dims, kv_heads * dims, kv_heads * dims]
    q, k, v = (t.view(batch, rows, -1, dims).transpose(1, 2) for t in out.split(sizes, -1))
    cos, sin = (torch.randn(batch, rows, dims, generator=generator).to(dtype) for _ in range(2))
    return q, k, cos, sin


@pytest.mark.parametrize("function", [llama_rotary, qwen2_rotary])
@pytest.mark.parametrize("shape", [(1, 1, 12, 2, 128), (2, 5, 6, 3, 64), (1, 17, 4, 4, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_gives_the_functions_bits(function, shape, dtype):
    rotate = rotary_for(function, shape[-1])
    assert rotate is not None
    q, k, cos, sin = _heads(*shape, torch.Generator().manual_seed(0), dtype)
    got, want = rotate(q, k, cos, sin), function(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_what_the_kernel_does_not_take_runs_through_the_function():
    rotate = rotary_for(qwen2_rotary, 64)
    q, k, cos, sin = _heads(1, 3, 4, 2, 64, torch.Generator().manual_seed(1))
    for args in ((q.half(), k.half(), cos.half(), sin.half()), (q, k, cos.bfloat16(), sin.bfloat16()), (q, k, cos[:, None], sin[:, None])):
        assert all(torch.equal(g, w) for g, w in zip(rotate(*args), qwen2_rotary(*args)))


def _interleaved(q, k, cos, sin):
    """Another formula under the same arguments: pairs of neighbours rotated (GPT-J's layout)."""

    def every_two(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + every_two(q) * sin, k * cos + every_two(k) * sin


def test_a_rotary_of_another_formula_keeps_its_own():
    assert rotary_for(_interleaved, 64) is None
    assert rotary_for(qwen2_rotary, 63) is None  # odd dims: no halves
