"""Sampling through the draft tree must draw from exactly the target's (warped) distribution."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import tiny_model
from drafters_for_tests import TopKTreeDrafter
from scipy.stats import chisquare

from rag_speculate import SpeculativeEngine
from rag_speculate.decoding.sampling import SamplingParams, warp_logits

# The losslessness tests run through the CPU kernels and through the portable path alike.
pytestmark = pytest.mark.usefixtures("forward_path")

PROMPT = "the quick brown fox"


@torch.inference_mode()
def exact_distribution(model, ids, params: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """Probability of every possible `length`-token continuation under the warped target."""
    if length == 0:
        return {(): 1.0}
    probs = warp_logits(model(torch.tensor([ids], device=model.device)).logits[0, -1], params).softmax(-1)
    out = {}
    for token in torch.nonzero(probs).flatten().tolist():
        for rest, p in exact_distribution(model, [*ids, token], params, length - 1).items():
            out[(token, *rest)] = probs[token].item() * p
    return out


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.8, top_k=5, top_p=0.8)])
def test_first_tokens_follow_the_target_distribution(params, tokenizer):
    model = tiny_model("qwen2", seed=4)
    ids = tokenizer.encode(PROMPT)
    # Token 1 comes from the prefill; tokens 2 and 3 from one verification of the draft tree.
    exact = exact_distribution(model, ids, params, 3)
    # The drafter proposes the target's own likeliest tokens, so samples often descend the tree.
    engine = SpeculativeEngine(model, tokenizer, TopKTreeDrafter(model, k=3, depth=2), draft_budget=6)
    draws = 2000
    counts = dict.fromkeys(exact, 0)
    accepted = 0
    for seed in range(draws):
        result = engine.generate(ids, max_new_tokens=3, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed)
        counts[tuple(result.token_ids)] += 1
        accepted += sum(result.stats.accepted_tokens.values())
    assert accepted > draws * 0.3  # the tree path was exercised, not just the bonus token
    observed, expected = _pool_small_cells(counts, exact, draws)
    assert chisquare(observed, expected).pvalue > 1e-3


def _pool_small_cells(counts, exact, draws, min_expected=5.0):
    """Chi-square needs expected counts >= 5: cells below that are pooled into one."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for cell, p in exact.items():
        if p * draws >= min_expected:
            observed.append(counts[cell])
            expected.append(p * draws)
        else:
            pooled_obs += counts[cell]
            pooled_exp += p * draws
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)  # float rounding of the probabilities
    return np.array(observed), np.array(expected) * scale


def test_seed_reproduces_the_same_text(tokenizer):
    model = tiny_model("llama", seed=5)
    engine = SpeculativeEngine(model, tokenizer)
    kwargs = {"documents": ["the quick brown fox jumps over the lazy dog"], "max_new_tokens": 30, "temperature": 0.9, "top_p": 0.95}
    runs = [engine.generate(PROMPT, seed=seed, **kwargs).token_ids for seed in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_warps_match_transformers_processors():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    for temperature, top_k, top_p in itertools.product([0.5, 1.0, 2.0], [0, 1, 7], [1.0, 0.9, 0.3]):
        ours = warp_logits(logits, SamplingParams(temperature, top_p, top_k))
        theirs = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            theirs = TopKLogitsWarper(top_k)(None, theirs)
        if top_p < 1:
            theirs = TopPLogitsWarper(top_p)(None, theirs)
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        assert torch.allclose(ours.softmax(-1), theirs.softmax(-1))
