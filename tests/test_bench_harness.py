"""The benchmarks' modeled decode time: what A/Bs of drafting policies are decided on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import modeled_decode_s, summarize, with_modeled

from rag_speculate.budget import CostModel

# As JSON gives them back: sizes as strings.
COSTS = {"target": {"1": 0.3, "5": 0.4, "9": 0.5}, "draft": {"1": 0.05, "9": 0.09}}


def test_modeled_time_counts_every_forward_by_its_size():
    ours = {"method": "combined", "tokens": [0] * 9, "forward_sizes": {"1": 2, "3": 1, "9": 1}, "draft_forward_sizes": {"5": 2}}
    assert modeled_decode_s(ours, COSTS) == pytest.approx(2 * 0.3 + 0.35 + 0.5 + 2 * 0.07)
    assert modeled_decode_s({"method": "trie", "tokens": [0] * 3, "forward_sizes": {"2": 2}}, COSTS) == pytest.approx(2 * 0.325)
    # transformers' greedy loop: one single-token forward per token after the first.
    assert modeled_decode_s({"method": "hf-greedy:fast", "tokens": [0] * 9}, COSTS) == pytest.approx(8 * 0.3)
    # Forwards transformers does not report are not guessed.
    assert modeled_decode_s({"method": "hf-assisted:fast", "tokens": [0] * 9, "forwards": None}, COSTS) is None


def test_summary_divides_modeled_times_per_item():
    def run(item, method, sizes, decode_s):
        return {"item": item, "category": "qa", "method": method, "tokens": [0] * 9, "total_s": decode_s, "decode_s": decode_s,
                "forwards": 1 + sum(sizes.values()), "drafting_s": 0.0, "forward_sizes": sizes, "identical": True}

    runs = [run("a", "plain", {"1": 8}, 2.0), run("a", "drafted", {"5": 2}, 1.0),
            run("b", "plain", {"1": 8}, 2.0), run("b", "drafted", {"9": 1, "1": 1}, 2.0)]
    row = summarize(with_modeled(runs, COSTS), ["plain", "drafted"], bases=["plain"])["qa"]["methods"]["drafted"]
    assert row["modeled_speedup_vs_plain_mean"] == pytest.approx((2.4 / 0.8 + 2.4 / 0.8) / 2)
    assert row["decode_speedup_vs_plain_mean"] == pytest.approx((2.0 + 1.0) / 2)
    assert row["modeled_share_of_decode"] == pytest.approx(1.6 / 3.0)
    assert "modeled_speedup_vs_plain_mean" not in summarize(runs, ["plain", "drafted"], bases=["plain"])["qa"]["methods"]["drafted"]


def test_a_pinned_copy_of_a_cost_curve_stops_learning():
    costs = CostModel({1: 0.3, 5: 0.4})
    pinned = CostModel(costs.table(), learn=False)
    costs.observe(1, 0.6)
    pinned.observe(1, 0.6)
    assert pinned(1) == 0.3 < costs(1)


def test_pooled_runs_compare_only_the_items_both_methods_ran():
    def run(item, method, decode_s):
        return {"item": item, "category": "qa", "method": method, "tokens": [0] * 9, "total_s": decode_s, "decode_s": decode_s,
                "forwards": None, "identical": True}

    # Two runs pooled (spec_bench --from-json A --from-json B): the second had no "new" method.
    runs = [run("a", "old", 2.0), run("a", "new", 1.0), run("b", "old", 2.0), run("b", "extra", 4.0)]
    block = summarize(runs, ["old", "new", "extra"], bases=["old"])["qa"]["methods"]
    assert block["new"]["items"] == 1 and block["new"]["decode_speedup_vs_old_mean"] == pytest.approx(2.0)
    assert block["extra"]["items"] == 1 and block["extra"]["decode_speedup_vs_old_mean"] == pytest.approx(0.5)
