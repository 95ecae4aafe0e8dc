"""The CPU linear kernel: torch's products within rounding, each row as if alone, for any number of rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy, tiny_model

from rag_speculate import InvalidArgumentError, NGramTrieDrafter, SpeculativeEngine
from rag_speculate.cpu import attention as cpu_attention
from rag_speculate.cpu import kernels as fast_kernels
from rag_speculate.cpu import linear as cpu_linear
from rag_speculate.cpu.kernels import FastKernels
from rag_speculate.cpu.linear import linear_library, linear_unsupported
from rag_speculate.decoding.budget import CostModel

needs_kernel = pytest.mark.skipif(linear_library()[0] is None, reason=f"linear kernel unavailable: {linear_library()[1]}")
needs_bf16_kernel = pytest.mark.skipif(
    linear_library(torch.bfloat16)[0] is None, reason=f"bf16 kernel unavailable: {linear_library(torch.bfloat16)[1]}"
)


def _count_rows(monkeypatch) -> dict[str, int]:
    """Count the rows the kernel serves (the real kernel still runs)."""
    served = {"kernel": 0}
    kernel = cpu_linear._linear

    def counted(x, weight, bias):
        served["kernel"] += x.numel() // x.shape[-1]
        return kernel(x, weight, bias)

    monkeypatch.setattr(cpu_linear, "_linear", counted)
    return served


@needs_kernel
@pytest.mark.parametrize("features", [32, 19])  # a multiple of the kernel's 8 or 16 lanes, and a remainder
def test_products_agree_for_any_number_of_rows(monkeypatch, features):
    served = _count_rows(monkeypatch)
    torch.manual_seed(0)
    weight, bias = torch.randn(41, features), torch.randn(41)  # an odd number of outputs too
    for rows in (1, 2, 7, 48, 49, 64, 65, 300):
        x = torch.randn(1, rows, features)
        want, want_no_bias = F.linear(x, weight, bias), F.linear(x, weight)
        before = served["kernel"]
        with FastKernels():
            got = F.linear(x, weight, bias)
            no_bias = F.linear(x, weight)
            strided = F.linear(x.transpose(1, 2).contiguous().transpose(1, 2), weight, bias)  # not contiguous
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(no_bias, want_no_bias, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(strided, want, rtol=1e-5, atol=1e-5)
        assert served["kernel"] - before == 3 * rows  # prefills too: every row through the kernel
    x = torch.randn(4, features, dtype=torch.float16)
    want = F.linear(x, weight.half())
    with FastKernels():
        assert torch.equal(F.linear(x, weight.half()), want)  # neither fp32 nor bf16: torch's kernel, bit for bit


@needs_bf16_kernel
@pytest.mark.parametrize("features", [64, 19])  # a multiple of the kernel's 32 bf16 lanes, and a remainder
def test_bf16_products_are_rounded_once(monkeypatch, features):
    served = _count_rows(monkeypatch)
    torch.manual_seed(0)
    weight, bias = torch.randn(41, features, dtype=torch.bfloat16), torch.randn(41, dtype=torch.bfloat16)
    for rows in (1, 5, 48, 49, 200):
        x = torch.randn(rows, features, dtype=torch.bfloat16)
        exact = F.linear(x.float(), weight.float(), bias.float())
        with FastKernels():
            got, no_bias = F.linear(x, weight, bias), F.linear(x, weight)
        assert got.dtype == torch.bfloat16
        # Summed in fp32 and rounded once: within half a bf16 step (at most 2^-8 of it) of the exact product.
        assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
        exact = F.linear(x.float(), weight.float())
        assert ((no_bias.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    assert served["kernel"] == 2 * (1 + 5 + 48 + 49 + 200)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=needs_kernel), pytest.param(torch.bfloat16, marks=needs_bf16_kernel)])
@pytest.mark.parametrize("shape", [(41, 19), (48, 32), (9, 53)])  # outputs and inputs off and on the tiles and lanes
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(shape, dtype):
    # Verification feeds a token among up to 48 others; its logits must be the ones it gets alone,
    # bit for bit, or a draft's length could change a greedy token.
    torch.manual_seed(0)
    weight, bias = torch.randn(*shape, dtype=dtype), torch.randn(shape[0], dtype=dtype)
    x = torch.randn(24, shape[1], dtype=dtype)
    with FastKernels():
        together = F.linear(x, weight, bias)
        for start, rows in ((0, 1), (0, 2), (0, 5), (3, 4), (7, 17), (23, 1)):
            assert torch.equal(F.linear(x[start : start + rows], weight, bias), together[start : start + rows]), (start, rows)

def test_a_kernel_that_cannot_build_says_why(failing_compiler):
    library, reason = linear_library()
    assert library is None
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert "building the linear kernel with /bin/false failed" in reason
        assert linear_library(torch.float16) == (None, "the linear kernel is for fp32 and bf16, not torch.float16")
    assert not list(failing_compiler.glob("kernels/*"))  # nothing half-built left behind


def _served_by_engine(engine: SpeculativeEngine, ids: list[int], reference: list[int], monkeypatch) -> dict[str, int]:
    served = _count_rows(monkeypatch)
    engine.cost_model = CostModel({1: 1.0, 65: 1.0}, learn=False)  # drafting always pays: multi-token forwards
    result = engine.generate(ids, documents=[reference], max_new_tokens=len(reference))
    assert result.token_ids == reference
    assert result.stats.tokens_per_forward > 2  # verification forwards fed several tokens
    monkeypatch.undo()
    return served


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_engine_runs_fast_kernels_only_when_enabled_and_stays_lossless(arch, tokenizer, monkeypatch):
    model = tiny_model(arch)
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog. the quick")
    reference = hf_greedy(model, ids, 40)
    default = SpeculativeEngine(model, tokenizer, NGramTrieDrafter())
    assert default.traits.kernels  # fp32 on CPU: on by default
    served = _served_by_engine(default, ids, reference, monkeypatch)
    assert served["kernel"] > 0
    stock = SpeculativeEngine(model, tokenizer, NGramTrieDrafter(), fast_kernels=False)
    assert _served_by_engine(stock, ids, reference, monkeypatch) == {"kernel": 0}


@needs_bf16_kernel
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_bf16_engine_runs_the_kernels_by_default_and_matches_generate_through_them(arch, tokenizer, monkeypatch):
    model = tiny_model(arch, dtype=torch.bfloat16)
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog. the quick")
    with FastKernels():  # no identity with torch's bf16 kernels; with the same kernels, every row as alone
        reference = hf_greedy(model, ids, 40)
    engine = SpeculativeEngine(model, tokenizer, NGramTrieDrafter())
    assert engine.traits.kernels and engine.traits.tree_attention
    attention_rows: list[int] = []
    if cpu_attention.attention_library(torch.bfloat16)[0] is not None:
        def counted(query, *args, **kwargs):
            out = cpu_attention.attention(query, *args, **kwargs)
            if out is not None:
                attention_rows.append(query.shape[2])
            return out

        monkeypatch.setattr(fast_kernels, "attention", counted)
    assert _served_by_engine(engine, ids, reference, monkeypatch)["kernel"] > 0
    if cpu_attention.attention_library(torch.bfloat16)[0] is not None:
        assert max(attention_rows) > 1  # trees verified through the attention kernel too


def test_models_the_fast_kernels_cannot_serve_are_named(tokenizer):
    model = tiny_model("qwen2").to(torch.float16)
    assert "float16" in linear_unsupported(model)
    assert not SpeculativeEngine(model, tokenizer).traits.kernels
    with pytest.raises(InvalidArgumentError, match="fast_kernels=True.*float16"):
        SpeculativeEngine(model, tokenizer, fast_kernels=True)
