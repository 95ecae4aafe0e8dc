"""benchmarks/replayed_acceptance.py: the drafter that makes a random-weight target accept, step by
step, the number of tokens the replay draws, and the distribution it draws from."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from conftest import hf_greedy, tiny_model
from replayed_acceptance import Plan, ReplayedAcceptanceDrafter, continue_probability, measured_acceptance

from rag_speculate import SpeculativeEngine
from rag_speculate.decoding.budget import CostModel

PROMPTS = [[5, 17, 3, 40, 41, 42, 9], [60, 2, 33]]


def test_the_replayed_distribution_has_the_measured_mean():
    measured = measured_acceptance(16)
    assert set(measured) == {"rag", "summarization", "qa"} and measured["summarization"] > measured["qa"] >= 1
    for accepted in (0.0, 0.03, 0.57, 2.63, 15.0):
        r = continue_probability(accepted, 16)
        assert sum(r**j for j in range(1, 17)) == pytest.approx(accepted, abs=1e-9)
    with pytest.raises(ValueError, match="outside"):
        continue_probability(16, 16)
    with pytest.raises(ValueError, match="budget 7"):
        measured_acceptance(7)


@pytest.mark.parametrize("r", [0.0, 0.6])
def test_the_target_accepts_exactly_the_replayed_tokens(r, tokenizer):
    model = tiny_model("llama")
    references = [hf_greedy(model, prompt, 24) for prompt in PROMPTS]
    plans = {tuple(p): Plan(c, r, seed, "rag") for seed, (p, c) in enumerate(zip(PROMPTS, references))}
    tally: Counter = Counter()
    engine = SpeculativeEngine(model, tokenizer, ReplayedAcceptanceDrafter(plans, tally), draft_budget=8)
    engine.cost_model = CostModel({1: 1.0, 9: 1.0}, learn=False)  # flat: every draft verified whole
    results = [engine.generate(prompt, max_new_tokens=24) for prompt in PROMPTS]
    assert [result.token_ids for result in results] == references
    steps = sum(result.stats.target_forwards - 1 for result in results)
    assert tally["rag", "steps"] == steps and tally["rag", "accepted"] == tally["rag", "planned"]
    if r:
        assert 0 < tally["rag", "accepted"] < 8 * steps
    else:  # nothing accepted: one token a forward, as plain decoding
        assert tally["rag", "accepted"] == 0 and all(result.stats.target_forwards == 24 for result in results)
    # A fixed seed: the same steps again.
    again = [engine.generate(prompt, max_new_tokens=24).stats.target_forwards for prompt in PROMPTS]
    assert again == [result.stats.target_forwards for result in results]
