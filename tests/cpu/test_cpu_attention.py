"""Attention through the compiled kernel, fp32 and bf16, any number of rows: exact but for fp32's
rounding (and bf16's once at the end), and each row computed as it would be alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rag_speculate.cpu import kernels as fast_kernels
from rag_speculate.cpu.attention import attention, attention_library
from rag_speculate.cpu.kernels import FastKernels

pytestmark = pytest.mark.skipif(
    attention_library(torch.bfloat16)[0] is None or attention_library(torch.float32)[0] is None,
    reason=f"attention kernel unavailable: {attention_library(torch.bfloat16)[1] or attention_library(torch.float32)[1]}",
)


def _inputs(rows: int, heads: int = 6, kv_heads: int = 2, length: int = 40, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(1, h, n, 16, generator=generator).mul(2).to(dtype) for h, n in ((heads, rows), (kv_heads, length), (kv_heads, length)))
    return q, k, v


def _exact(q, k, v, keep=None, scale=None):
    """Attention in fp64 of the same inputs; `keep`: which entries each row sees."""
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep, scale=scale, enable_gqa=True)


def _tree_mask(rows: int, length: int) -> torch.Tensor:
    """Each new row sees the cached entries, itself and every other earlier row: as a draft tree's mask."""
    keep = torch.ones(rows, length, dtype=torch.bool)
    past = length - rows
    for i in range(rows):
        keep[i, past + i + 1 :] = False
        keep[i, past : past + i : 2] = False
    return keep[None, None]


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 48, 120])
@pytest.mark.parametrize("mask_kind", ["none", "additive", "bool"])
def test_bf16_attention_rounds_the_exact_result_once(rows, mask_kind):
    q, k, v = _inputs(rows, length=rows + 40)
    keep = _tree_mask(rows, rows + 40)
    additive = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(~keep, torch.finfo(torch.bfloat16).min)
    mask = {"none": None, "additive": additive, "bool": keep}[mask_kind]
    got = attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    want = _exact(q, k, v, keep if mask is not None else None, scale=0.3)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    # One rounding of a nearly exact fp32 result: within half a bf16 step (at most 2^-8 relative).
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()
    # torch's own bf16 kernel is no closer.
    torchs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert (got.double() - want).abs().max() <= (torchs.double() - want).abs().max()


@pytest.mark.parametrize("rows", [1, 7, 90])
def test_fp32_attention_is_torchs_within_rounding(rows):
    q, k, v = (t.float() for t in _inputs(rows, length=rows + 20))
    keep = _tree_mask(rows, rows + 20)
    got = attention(q, k, v, attn_mask=keep, enable_gqa=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _exact(q, k, v, keep), rtol=1e-5, atol=1e-5)


def test_a_short_causal_prefill_is_served_as_its_mask_says():
    q, k, v = _inputs(6, length=6)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    assert torch.equal(attention(q, k, v, is_causal=True, enable_gqa=True), attention(q, k, v, attn_mask=causal, enable_gqa=True))


def test_heads_already_repeated_need_no_gqa_flag():
    q, k, v = _inputs(3, heads=4, kv_heads=4)
    torch.testing.assert_close(attention(q, k, v), attention(q, k, v, enable_gqa=True), rtol=0, atol=0)
    want = _exact(q, k, v)
    assert ((attention(q, k, v).double() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()


def test_what_it_does_not_serve_is_left_to_torch():
    q, k, v = _inputs(3)
    assert attention(*(t.half() for t in (q, k, v)), enable_gqa=True) is None
    assert attention(q, k, v, is_causal=True, enable_gqa=True) is None  # causal after cached entries: torch's own meaning differs
    assert attention(q, k, v, dropout_p=0.1, enable_gqa=True) is None
    assert attention(q, k, v) is None  # grouped heads without enable_gqa: torch raises, so let it
    assert attention(q[0], k[0], v[0], enable_gqa=True) is None  # not [batch, heads, rows, dims]
    assert attention(q[..., :8], k[..., :8], v[..., :8], enable_gqa=True) is None  # dims not a multiple of 16
    per_head = torch.zeros(1, 6, 3, 40, dtype=torch.bfloat16)
    assert attention(q, k, v, attn_mask=per_head, enable_gqa=True) is None


def test_each_row_is_computed_as_it_would_be_alone():
    """Verifying a tree gives each row the bits plain decoding gives it after the cache keeps only
    its path: the same result with the masked entries removed and no other rows."""
    rows, length = 7, 60
    q, k, v = _inputs(rows, length=length)
    keep = _tree_mask(rows, length)
    additive = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(~keep, torch.finfo(torch.bfloat16).min)
    together = attention(q, k, v, attn_mask=additive, enable_gqa=True)
    for i in range(rows):
        seen = keep[0, 0, i].nonzero()[:, 0]
        alone = attention(q[:, :, i : i + 1], k[:, :, seen], v[:, :, seen], enable_gqa=True)
        assert torch.equal(together[:, :, i : i + 1], alone), i
    # A cropped cache is a view whose heads sit further apart: read in place, same result.
    longer_k, longer_v = (torch.cat([t, t[:, :, :5]], dim=2) for t in (k, v))
    cropped = attention(q, longer_k[:, :, :length], longer_v[:, :, :length], attn_mask=additive, enable_gqa=True)
    assert torch.equal(cropped, together)


def test_a_batch_gives_each_sequence_what_it_gets_alone():
    """A batched forward's rows (the BatchCache's: padded, the padding masked per sequence) get the
    bits each sequence gets in a forward of its own, over its own entries only."""
    rows, length, seen = 3, 40, (40, 25)
    q, k, v = (torch.cat([t, t.flip(2)]) for t in _inputs(rows, length=length, dtype=torch.float32))
    keep = torch.zeros(2, 1, rows, length, dtype=torch.bool)
    for b, n in enumerate(seen):
        keep[b, 0, :, :n] = True
    together = attention(q, k, v, attn_mask=keep, enable_gqa=True)
    for b, n in enumerate(seen):
        alone = attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], enable_gqa=True)
        assert torch.equal(together[b : b + 1], alone), b
    assert attention(q, k, v, attn_mask=torch.ones(3, 1, rows, length, dtype=torch.bool), enable_gqa=True) is None


def test_a_kernel_that_cannot_build_leaves_attention_to_torch(failing_compiler):
    library, reason = attention_library(torch.bfloat16)
    assert library is None and "building the attention kernel with /bin/false failed" in reason
    assert attention(*_inputs(2), enable_gqa=True) is None
    assert not list(failing_compiler.glob("kernels/*"))  # nothing half-built left behind


def test_the_mode_runs_it_for_fp32_and_bf16(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        out = attention(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fast_kernels, "attention", counted)
    q, k, v = _inputs(2)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with FastKernels():
        got = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        fp32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        fp16 = F.scaled_dot_product_attention(q.half(), k.half(), v.half(), enable_gqa=True)
    assert calls == [True, True, False]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fp32, F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True), rtol=1e-5, atol=1e-5)
    assert torch.equal(fp16, F.scaled_dot_product_attention(q.half(), k.half(), v.half(), enable_gqa=True))
