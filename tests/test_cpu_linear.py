"""oneDNN for the linear layers of multi-token forwards: same products within rounding, used only there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy, tiny_model
from torch.profiler import ProfilerActivity, profile

from rag_speculate import InvalidArgumentError, NGramTrieDrafter, SpeculativeEngine
from rag_speculate.budget import CostModel
from rag_speculate.cpu_linear import OneDNNLinear, onednn_linear_works

ONEDNN_OP = "mkldnn::_linear_pointwise"


def test_multi_token_products_agree_and_other_shapes_keep_torchs_kernel():
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    for rows in (1, 2, 9, 64, 65, 300):
        x = torch.randn(1, rows, 24)
        want = F.linear(x, weight, bias)
        with OneDNNLinear():
            got = F.linear(x, weight, bias)
            no_bias = F.linear(x, weight)
        assert got.shape == want.shape
        torch.testing.assert_close(no_bias, F.linear(x, weight), rtol=1e-5, atol=1e-5)
        if rows in (1, 65, 300):
            assert torch.equal(got, want), rows  # single steps and prefills: torch's own kernel, bit for bit
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 24, dtype=torch.bfloat16)
    want = F.linear(x, weight.bfloat16())
    with OneDNNLinear():
        assert torch.equal(F.linear(x, weight.bfloat16()), want)  # not fp32: torch's kernel


def _ops_run(engine: SpeculativeEngine, ids: list[int], reference: list[int]) -> set[str]:
    engine.cost_model = CostModel({1: 1.0, 65: 1.0}, learn=False)  # drafting always pays: multi-token forwards
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = engine.generate(ids, documents=[reference], max_new_tokens=len(reference))
    assert result.token_ids == reference
    assert result.stats.tokens_per_forward > 2  # verification forwards fed several tokens
    return {event.name for event in prof.events()}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_verification_runs_onednn_only_when_enabled_and_stays_lossless(arch, tokenizer):
    model = tiny_model(arch)
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog. the quick")
    reference = hf_greedy(model, ids, 40)
    default = SpeculativeEngine(model, tokenizer, NGramTrieDrafter())
    assert default.onednn_linear  # fp32 on CPU: on by default
    assert ONEDNN_OP in _ops_run(default, ids, reference)
    stock = SpeculativeEngine(model, tokenizer, NGramTrieDrafter(), onednn_linear=False)
    assert ONEDNN_OP not in _ops_run(stock, ids, reference)


def test_models_oneDNN_cannot_serve_are_named(tokenizer):
    model = tiny_model("qwen2").to(torch.bfloat16)
    works, reason = onednn_linear_works(model)
    assert not works and "bfloat16" in reason
    assert not SpeculativeEngine(model, tokenizer).onednn_linear
    with pytest.raises(InvalidArgumentError, match="onednn_linear=True.*bfloat16"):
        SpeculativeEngine(model, tokenizer, onednn_linear=True)
