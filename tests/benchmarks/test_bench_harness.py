"""The benchmarks' decode time, counted and modeled: what A/Bs of drafting policies and the comparisons with transformers are decided on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from conftest import tiny_model
from harness import engine_method, hf_method, modeled_decode_s, renamed, summarize, with_modeled

from rag_speculate import NGramTrieDrafter, OuroborosDrafter, SpeculativeEngine
from rag_speculate.cpu.kernels import FastKernels
from rag_speculate.decoding.baseline import timed_generate
from rag_speculate.decoding.budget import CostModel
from rag_speculate.drafters.ouroboros.int8 import int8_draft_model

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
    assert row["decode_speedup_vs_plain_lowest"] == pytest.approx(1.0)  # item b
    assert row["modeled_share_of_decode"] == pytest.approx(1.6 / 3.0)
    assert "modeled_speedup_vs_plain_mean" not in summarize(runs, ["plain", "drafted"], bases=["plain"])["qa"]["methods"]["drafted"]
    # Forwards by kind, as the docs cite them: target forwards, those that verified no draft, draft-model forwards.
    assert row["forwards"] == {"target": 4, "without_draft": 1, "draft": 0}


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


def test_decode_speed_counts_only_the_tokens_emitted_within_decode_time():
    def run(item, method, decode_s, decode_tokens):
        return {"item": item, "category": "qa", "method": method, "tokens": [0] * 21, "total_s": decode_s + 1,
                "decode_s": decode_s, "decode_tokens": decode_tokens, "forwards": None, "identical": True}

    # Assisted generation emitted 11 of its 21 tokens with the prefill: its decode time covers 10.
    runs = [run("a", "hf-greedy", 4.0, 20), run("a", "hf-assisted", 1.0, 10)]
    row = summarize(runs, ["hf-greedy", "hf-assisted"], bases=["hf-greedy"])["qa"]["methods"]["hf-assisted"]
    assert row["decode_tok_s"] == pytest.approx(10.0)
    assert row["decode_speedup_vs_hf-greedy_mean"] == pytest.approx(2.0)
    # An answer that came whole with the prefill decoded nothing: no ratio for that item.
    runs += [run("b", "hf-greedy", 4.0, 20), run("b", "hf-assisted", 0.01, 0)]
    row = summarize(runs, ["hf-greedy", "hf-assisted"], bases=["hf-greedy"])["qa"]["methods"]["hf-assisted"]
    assert row["items"] == 2 and row["decode_speedup_vs_hf-greedy_mean"] == pytest.approx(2.0)
    # Runs saved before decode_tokens was recorded count all tokens but the first.
    for r in runs:
        del r["decode_tokens"]
    assert summarize(runs, ["hf-greedy"])["qa"]["methods"]["hf-greedy"]["decode_tok_s"] == pytest.approx(5.0)


def test_timed_assisted_generation_leaves_the_tokens_of_its_first_step_out_of_decode(tokenizer):
    model = tiny_model("llama", seed=0)
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog. the quick")
    plain = timed_generate(model, ids, 24)
    assert plain.decode_tokens == len(plain.token_ids) - 1
    # An assistant identical to the target: its first draft, verified inside the prefill, is taken whole.
    assisted = timed_generate(model, ids, 24, assistant_model=tiny_model("llama", seed=0))
    assert assisted.token_ids == plain.token_ids
    assert 0 < assisted.decode_tokens < len(assisted.token_ids) - 1


def test_assisted_generation_counts_its_forwards_as_ours_are(tokenizer):
    model, assistant = tiny_model("llama", seed=0), tiny_model("llama", seed=1)  # another model: drafts get rejected
    assisted = hf_method(SpeculativeEngine(model, tokenizer), assistant_model=assistant)  # the engine probes its model
    calls = {"target": [], "draft": []}
    for name, m in (("target", model), ("draft", assistant)):
        m.register_forward_hook(lambda mod, args, kwargs, out, name=name: calls[name].append(kwargs["input_ids"].shape[-1]), with_kwargs=True)
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog. the quick")
    run = assisted(ids, None, 24)
    assert run["forwards"] == len(calls["target"]) > 2
    # The first target forward is the prefill; the rest verify drafts of 1 or more tokens.
    assert run["forward_sizes"] == {str(q): calls["target"][1:].count(q) for q in set(calls["target"][1:])}
    assert sum(run["draft_forward_sizes"].values()) == len(calls["draft"])
    assert run["drafting_s"] > 0
    run["method"], run["item"], run["category"], run["identical"] = "hf-assisted", "a", "qa", True
    assert modeled_decode_s(run, {"target": {"1": 1.0}, "draft": {"1": 1.0}}) is None
    summary = summarize([run], ["hf-assisted"], bases=[])["qa"]["methods"]["hf-assisted"]
    assert summary["forwards"]["target"] == len(calls["target"]) - 1
    # Its hooks are gone: a later generate is not counted.
    assert len(model._forward_hooks) == len(assistant._forward_hooks) == 1


def test_fast_assisted_generation_runs_only_the_served_models_forwards_in_the_fast_mode(tokenizer, monkeypatch):
    # Our engine runs an int8 draft model outside `FastKernels` (no kernel serves it, and the mode
    # slows every torch call); transformers' assistant must be run alike.
    model, assistant = tiny_model("llama", seed=0), int8_draft_model(tiny_model("llama", seed=1))
    modes = {"target": [], "draft": []}
    for name, m in (("target", model), ("draft", assistant)):
        m.lm_head.register_forward_pre_hook(lambda mod, args, name=name: modes[name].append(_in_fast_mode()))  # inside forward
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog. the quick")
    engine = SpeculativeEngine(model, tokenizer)
    fast, plain = hf_method(engine, fast=True, assistant_model=assistant), hf_method(engine, assistant_model=assistant)
    runs = {}
    for name, method in (("fast", fast), ("plain", plain)):
        modes["target"].clear(), modes["draft"].clear()
        runs[name] = method(ids, None, 16)["tokens"], list(modes["target"]), list(modes["draft"])
    assert runs["fast"][0] == runs["plain"][0]
    assert all(runs["fast"][1]) and runs["fast"][2] and not any(runs["fast"][2])
    assert runs["plain"][1] and not any(runs["plain"][1])
    assert "forward" not in model.__dict__ and "forward" not in assistant.__dict__


def _in_fast_mode() -> bool:
    return any(isinstance(mode, FastKernels) for mode in torch.overrides._get_current_function_mode_stack())


def test_a_renamed_variant_replaces_the_method_it_is_pooled_as():
    def run(item, method, decode_s):
        return {"item": item, "category": "qa", "method": method, "tokens": [0] * 9, "total_s": decode_s, "decode_s": decode_s,
                "forwards": None, "identical": True}

    # One run named the code under test "ours" and the code in use "ours-kept"; another named the code in use "ours".
    ab = [run("a", "base", 2.0), run("a", "ours", 4.0), run("a", "ours-kept", 1.0)]
    other = [run("b", "base", 2.0), run("b", "ours", 0.5)]
    runs = renamed(ab, {"ours-kept": "ours"}) + renamed(other, {"ours-kept": "ours"})
    assert sorted((r["item"], r["method"], r["decode_s"]) for r in runs) == [
        ("a", "base", 2.0), ("a", "ours", 1.0), ("b", "base", 2.0), ("b", "ours", 0.5)]
    block = summarize(runs, ["base", "ours"], bases=["base"])["qa"]["methods"]["ours"]
    assert block["decode_speedup_vs_base_mean"] == pytest.approx((2.0 + 4.0) / 2)


def test_a_fresh_run_summarizes_as_its_saved_copy(tokenizer):
    """Forward sizes keyed as JSON gives them back: the in-process summary counts forwards without a draft too."""
    model = tiny_model("llama")
    engine = SpeculativeEngine(model, tokenizer)
    text = "the quick brown fox. the quick brown fox. the quick"
    run = engine_method(engine, NGramTrieDrafter())(tokenizer.encode(text), [text], 24)
    run.update(item="a", category="qa", method="trie", identical=True)
    fresh = summarize([run], ["trie"], bases=[])["qa"]["methods"]["trie"]["forwards"]
    saved = summarize(json.loads(json.dumps([run])), ["trie"], bases=[])["qa"]["methods"]["trie"]["forwards"]
    assert fresh == saved
    assert fresh["without_draft"] == run["forward_sizes"]["1"] > 0


def test_a_run_counts_the_draft_models_forwards_alone_and_inside_the_combined_drafter(tokenizer):
    """Ouroboros keeps its draft model's forward counts on its `draft`: a run must find them there."""
    model = tiny_model("llama", seed=0)
    engine = SpeculativeEngine(model, tokenizer)
    engine.cost_model = CostModel({1: 1.0, 65: 1.0}, learn=False)  # every forward costs alike: drafting pays
    text = "the quick brown fox jumps over the lazy dog. the quick"
    for drafter in (OuroborosDrafter(tiny_model("llama", seed=0), tokenizer),
                    [NGramTrieDrafter(), OuroborosDrafter(tiny_model("llama", seed=0), tokenizer)]):
        ouroboros = drafter if isinstance(drafter, OuroborosDrafter) else drafter[1]
        ouroboros.draft.cost_model = CostModel({1: 0.1, 65: 0.1}, learn=False)
        before = ouroboros.draft_forwards
        run = engine_method(engine, drafter)(tokenizer.encode(text), None, 24)
        assert sum(run["draft_forward_sizes"].values()) == ouroboros.draft_forwards - before > 0


def test_repeated_runs_of_an_item_count_as_their_median():
    def run(method, decode_s, identical=True):
        return {"item": "a", "category": "qa", "method": method, "tokens": [0] * 9, "total_s": decode_s, "decode_s": decode_s,
                "forwards": None, "identical": identical}

    runs = [run("base", 2.0), run("base", 9.0), run("base", 1.0), run("ours", 1.0), run("ours", 0.5, identical=False)]
    block = summarize(runs, ["base", "ours"], bases=["base"])["qa"]["methods"]
    assert block["base"]["items"] == 1 and block["base"]["decode_tok_s"] == pytest.approx(8 / 2.0)
    # Of two, the faster; one differing output makes the item not identical.
    assert block["ours"]["decode_speedup_vs_base_mean"] == pytest.approx(2.0 / 0.5)
    assert block["ours"]["identical_to_greedy"] == 0
