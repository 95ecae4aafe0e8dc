"""Verifying only the draft nodes that pay for their measured cost."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, tiny_model

from rag_speculate import SpeculativeEngine
from rag_speculate.decoding.budget import CostModel, batch_width, best_prefix
from rag_speculate.decoding.tree import DraftTree
from rag_speculate.decoding.verify import Verification
from rag_speculate.drafters.agreement import DecayingRate, MatchAgreement

# Measured on the project's CPU for the 1.5B target (docs/benchmarks.md), seconds.
BF16 = CostModel({1: 0.243, 2: 0.375, 5: 0.9, 9: 1.291, 17: 2.508})
FP32 = CostModel({1: 0.393, 2: 0.775, 5: 0.977, 9: 1.008, 17: 1.084})


def test_cost_model_interpolates_extrapolates_and_follows_observations():
    assert FP32(9) == pytest.approx(1.008)
    assert FP32(13) == pytest.approx((1.008 + 1.084) / 2)
    assert FP32(25) > FP32(17)
    FP32_copy = CostModel({1: 0.393, 17: 1.084})
    FP32_copy.observe(17, 2.084)
    assert FP32_copy(17) == pytest.approx(0.8 * 1.084 + 0.2 * 2.084)
    # Between timed sizes, both neighbours move by their share and no new size appears.
    before = {q: FP32_copy(q) for q in (1, 9, 17)}
    FP32_copy.observe(9, 2 * before[9])
    assert FP32_copy._sizes == [1, 17]
    assert FP32_copy(1) == pytest.approx(before[1] * 1.1)
    assert FP32_copy(17) == pytest.approx(before[17] * 1.1)
    assert before[9] < FP32_copy(9) < 2 * before[9]
    # Past the last timed size, the last one moves.
    FP32_copy.observe(33, FP32_copy(33) / 2)
    assert FP32_copy(17) == pytest.approx(before[17] * 1.1 * 0.9)


def test_cost_curve_never_falls_so_padding_never_looks_free():
    # One noisy timing said two tokens cost less than one: taken as it is, an undrafted row
    # would be fed a padding token for nothing.
    noisy = CostModel({1: 0.136, 2: 0.132, 3: 0.158})
    assert noisy(2) == noisy(1) == pytest.approx(0.136)
    assert batch_width([[]], noisy, 16) == 1
    assert batch_width([[], []], noisy, 16) == 1
    # Verifying two tokens observed faster than one was timed: one token is no dearer than that,
    # so a stale timing of one token cannot make two look cheaper while one is never fed alone.
    learning = CostModel({1: 0.147, 2: 0.150, 3: 0.160})
    learning.observe(2, 0.120)
    assert learning(1) <= learning(2) <= learning(3)
    assert learning(1) == pytest.approx(learning(2))
    # And an observation above the next size raises it too.
    learning.observe(2, 0.400)
    assert learning(2) <= learning(3)


def chain(rate: float) -> list[float]:
    return [rate**depth for depth in range(1, 17)]


def test_prefix_follows_costs_and_agreement():
    # A reliable chain pays in full when 17 tokens cost 2.8 single steps (fp32) ...
    assert best_prefix(chain(0.95), FP32) == 16
    # ... but in bf16, where each token costs ~150 ms more, only a short prefix does.
    assert 0 < best_prefix(chain(0.95), BF16) < 16
    # A target that rarely follows the drafts: plain decoding is fastest.
    assert best_prefix(chain(0.3), FP32) == 0
    assert best_prefix([0.1] * 16, BF16) == 0


def test_match_agreement_learns_per_match_length():
    agreement = MatchAgreement()
    # Longer context matches start from a more confident prior.
    assert agreement.rate(1) < agreement.rate(2) < agreement.rate(3) <= agreement.rate(16)
    tree = DraftTree([5, 6], [-1, 0])
    before = agreement.rate(3)
    agreement.observe(Verification(tree, [], [7], [7, 6, 0]))  # rejected at the first token
    assert agreement.rate(3) < before
    assert agreement.rate(2) == pytest.approx(0.7)
    # Nothing verified (the engine dropped the draft): no trial recorded.
    agreement.rate(3)
    trials = agreement._rates[3].trials
    agreement.observe(Verification(DraftTree.empty(), [], [7], [7]))
    assert agreement._rates[3].trials == trials


def test_agreement_rate_learns_and_forgets():
    rate = DecayingRate(0.75, 4)
    assert rate.rate == pytest.approx(0.75)
    for _ in range(5):
        rate.observe(hits=0, trials=1)
    low = rate.rate
    assert low < 0.5
    for _ in range(200):
        rate.observe(hits=0, trials=0)
    assert rate.rate == pytest.approx(0.75, abs=0.01)


def test_engine_stops_drafting_when_drafts_do_not_pay_and_stays_lossless(tokenizer):
    model = tiny_model("llama")
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog. the quick")
    reference = hf_greedy(model, ids, 40)
    engine = SpeculativeEngine(model, tokenizer)
    # Every extra token costs a whole forward: no draft can pay.
    engine.cost_model = CostModel({1: 1.0, 2: 2.0, 17: 17.0})
    result = engine.generate(ids, documents=[reference], max_new_tokens=40)
    assert result.token_ids == reference
    assert sum(result.stats.drafted_tokens.values()) == 0


@pytest.mark.parametrize("cost", [BF16, FP32])
def test_batch_width_drafts_less_as_rows_are_added_and_never_loses_to_no_drafting(cost):
    scores = [0.95, 0.9, 0.8, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05]
    # One row: the best prefix, as the engine verified before batching.
    assert batch_width([scores], cost, 16) == best_prefix(scores, cost) + 1
    widths = [batch_width([scores] * rows, cost, 16) for rows in (1, 2, 4, 8, 16)]
    assert widths[-1] <= widths[0]  # a full batch drafts no more than one row
    for rows, q in zip((1, 2, 4, 8, 16), widths):
        speed = sum(1 + sum(scores[: q - 1]) for _ in range(rows)) / cost(rows * q)
        assert speed >= rows / cost(rows)  # at least the batch's speed without drafting


def test_batch_width_verifies_unscored_drafts_whole_and_nothing_when_no_draft_pays():
    flat = CostModel({1: 1.0, 300: 1.0}, learn=False)
    assert batch_width([[0.5] * 4, []], flat, 16) == 5
    assert batch_width([[], []], flat, 16, least=7) == 7
    dear = CostModel({1: 1.0, 2: 2.0, 300: 300.0}, learn=False)
    assert batch_width([[0.9, 0.9], [0.9]], dear, 16) == 1
