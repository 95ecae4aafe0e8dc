"""Continuous batching: generations run together, joining and leaving at any step, each answer the
one its request gets alone (greedy: `model.generate`'s, exactly in fp32; seeded sampling: the same
draws), whatever else is in the batch."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import VOCAB, hf_greedy, tiny_model
from drafters_for_tests import RandomTreeDrafter

from rag_speculate import InvalidArgumentError, NGramTrieDrafter, RagSpeculateError, SpeculativeEngine
from rag_speculate.decoding.budget import CostModel
from rag_speculate.decoding.prompt_cache import kv_bytes_per_token
from rag_speculate.quantization import quantize_model

pytestmark = pytest.mark.usefixtures("forward_path")

PROMPTS = [
    "the quick brown fox jumps over the lazy dog. the quick",
    "In 1905, Einstein published",
    "a",
    "She sells sea shells by the sea shore; the shells she sells are",
    "One, two, three, four, five, six, seven, eight, nine, ten, eleven,",
]
# Drafting always pays and costs grow with tokens fed: rows draft, and batches of rows are verified.
PINNED = CostModel({1: 1.0, 300: 1.5}, learn=False)


def joining_and_leaving(engine: SpeculativeEngine, model, tokenizer) -> list:
    """Five requests of different prompt and answer lengths, each joining a batch under way (rows
    join at different steps and leave at others): each gets `generate`'s answer, and they ran together."""
    lengths = [40, 8, 25, 3, 33]
    references = [hf_greedy(model, tokenizer.encode(p), n) for p, n in zip(PROMPTS, lengths)]
    streams = []
    for prompt, n, reference in zip(PROMPTS, lengths, references):
        streams.append(engine.stream(prompt, documents=[reference[: n // 2]], max_new_tokens=n))
        time.sleep(0.01)  # the next joins a batch already under way
    results = [s.collect() for s in streams]
    assert [r.token_ids for r in results] == references
    assert max(size for r in results for size in r.stats.batch_sizes) > 1  # they did run together
    return results


def _engine(model, tokenizer, drafter=None, **options) -> SpeculativeEngine:
    engine = SpeculativeEngine(model, tokenizer, drafter, **options)
    engine.cost_model = PINNED
    return engine


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_rows_joining_and_leaving_give_each_its_own_greedy_answer(arch, tokenizer):
    model = tiny_model(arch)
    engine = _engine(model, tokenizer)
    assert engine.max_batch > 1 and not engine.traits.rows.why_not
    joining_and_leaving(engine, model, tokenizer)
    assert engine.in_flight == 0


def test_every_row_gets_what_it_gets_alone_with_adversarial_drafts(tokenizer):
    model = tiny_model("qwen2", seed=1)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    references = [hf_greedy(model, i, 30) for i in ids]
    drafter = RandomTreeDrafter(VOCAB, seed=3)  # random trees, the truth unknown to it: most drafts rejected
    engine = _engine(model, tokenizer, drafter, draft_budget=8)
    together = engine.generate_batch(ids, max_new_tokens=30)
    assert [r.token_ids for r in together] == references
    alone = [_engine(model, tokenizer, RandomTreeDrafter(VOCAB, seed=3), max_batch=1, draft_budget=8).generate(i, max_new_tokens=30) for i in ids]
    assert [r.token_ids for r in alone] == references


def test_seeded_sampling_draws_the_same_tokens_whatever_the_batch(tokenizer):
    model = tiny_model("llama", seed=2)
    options = {"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95}
    alone = _engine(model, tokenizer, max_batch=1)
    expected = [alone.generate(p, seed=i, **options).token_ids for i, p in enumerate(PROMPTS)]
    batched = _engine(model, tokenizer)
    streams = [batched.stream(p, seed=i, **options) for i, p in enumerate(PROMPTS)]
    assert [s.collect().token_ids for s in streams] == expected


def test_cancelling_a_row_changes_no_other(tokenizer):
    model = tiny_model("qwen2")
    engine = _engine(model, tokenizer)
    reference = hf_greedy(model, tokenizer.encode(PROMPTS[0]), 40)
    keep = engine.stream(PROMPTS[0], max_new_tokens=40)
    dropped = engine.stream(PROMPTS[1], max_new_tokens=200)
    next(dropped)
    dropped.close()
    assert dropped.collect().finish_reason == "cancelled"
    assert keep.collect().token_ids == reference
    stop = tokenizer.decode(reference, skip_special_tokens=True)[5:8]
    beside = engine.stream(PROMPTS[1], max_new_tokens=40)
    stopped = engine.generate(PROMPTS[0], max_new_tokens=40, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.token_ids == reference[: len(stopped.token_ids)]
    assert beside.collect().token_ids == hf_greedy(model, tokenizer.encode(PROMPTS[1]), 40)


def test_rows_join_with_their_prompts_cached_prefix(tokenizer):
    model = tiny_model("llama")
    engine = _engine(model, tokenizer)
    first = engine.generate(PROMPTS[0], max_new_tokens=16)
    follow_up = tokenizer.encode(PROMPTS[0]) + first.token_ids + tokenizer.encode(" and then")
    reference = hf_greedy(model, follow_up, 20)
    results = engine.generate_batch([follow_up, PROMPTS[3]], max_new_tokens=20)
    assert results[0].stats.cached_prompt_tokens >= len(tokenizer.encode(PROMPTS[0]))
    assert results[0].token_ids == reference
    assert results[1].token_ids == hf_greedy(model, tokenizer.encode(PROMPTS[3]), 20)


def test_thirty_two_requests_from_eight_threads_are_all_answered(tokenizer):
    model = tiny_model("qwen2")
    engine = _engine(model, tokenizer, max_batch=4)
    references = {i: hf_greedy(model, tokenizer.encode(PROMPTS[i % 5]), 6 + i % 7) for i in range(32)}
    answers: dict[int, list[int]] = {}

    def client(first: int) -> None:
        for i in range(first, 32, 8):
            answers[i] = engine.generate(PROMPTS[i % 5], max_new_tokens=6 + i % 7).token_ids

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert answers == references


def test_a_request_that_does_not_fit_the_kv_budget_waits_for_room(tokenizer):
    model = tiny_model("llama")
    # Room for one long sequence at a time: prompt, 40 new tokens and a draft.
    tokens = len(tokenizer.encode(PROMPTS[0])) + 40 + 16 + 1
    engine = _engine(model, tokenizer, kv_cache_bytes=tokens * kv_bytes_per_token(model))
    references = [hf_greedy(model, tokenizer.encode(PROMPTS[0]), 40) for _ in range(3)]
    results = engine.generate_batch([PROMPTS[0]] * 3, max_new_tokens=40)
    assert [r.token_ids for r in results] == references
    assert all(set(r.stats.batch_sizes) == {1} for r in results)  # one at a time: they waited, none failed
    assert max(r.stats.queue_s for r in results) > 0
    with pytest.raises(RagSpeculateError, match="kv_cache_bytes"):
        engine.generate(PROMPTS[0], max_new_tokens=100)  # could never fit: refused at once


def test_models_that_cannot_batch_run_one_at_a_time_and_say_why(tokenizer):
    model = tiny_model("gemma3")  # sliding-window layers
    engine = _engine(model, tokenizer)
    assert engine.max_batch == 1 and "sliding-window" in engine.traits.rows.why_not
    references = [hf_greedy(model, tokenizer.encode(p), 12) for p in PROMPTS[:3]]
    assert [r.token_ids for r in engine.generate_batch(PROMPTS[:3], max_new_tokens=12)] == references


def test_the_meta_device_guard_holds_for_a_batch(tokenizer, monkeypatch):
    model = tiny_model("qwen2")
    engine = _engine(model, tokenizer, NGramTrieDrafter())
    references = [hf_greedy(model, tokenizer.encode(p), 16) for p in PROMPTS[:3]]
    engine.generate("warm", max_new_tokens=2)
    step = engine._thread._step

    def guarded() -> bool:
        with torch.device("meta"):  # a tensor made without naming a device fails beside the model's
            return step()

    monkeypatch.setattr(engine._thread, "_step", guarded)
    results = engine.generate_batch(PROMPTS[:3], documents=[references[0]], max_new_tokens=16)
    assert [r.token_ids for r in results] == references


@pytest.mark.parametrize(("option", "value"), [("max_batch", 0), ("max_batch", 1.5), ("kv_cache_bytes", 0), ("kv_cache_bytes", 8), ("prefill_chunk", 0)])
def test_bad_batching_options_are_named_when_the_engine_is_built(option, value, tokenizer):
    with pytest.raises(InvalidArgumentError, match=option):
        SpeculativeEngine(tiny_model("llama"), tokenizer, **{option: value})


def test_the_cost_curve_is_timed_once_per_machine_and_kept_on_disk(tokenizer, monkeypatch, tmp_path):
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(tmp_path))
    model = tiny_model("llama")
    first = SpeculativeEngine(model, tokenizer)
    first.generate(PROMPTS[0], max_new_tokens=4)
    saved = list((tmp_path / "costs").glob("*.json"))
    assert len(saved) == 1
    timed = []
    monkeypatch.setattr(CostModel, "measure", classmethod(lambda cls, *args: timed.append(args) or PINNED))
    kept = CostModel.load(saved[0]).table()
    second = SpeculativeEngine(model, tokenizer)
    second.generate(PROMPTS[0], max_new_tokens=4)
    assert not timed and set(second.cost_model.table()) == set(kept)  # loaded, not timed
    saved[0].write_text("{not json")  # damaged: timed again, never trusted
    third = SpeculativeEngine(model, tokenizer)
    third.generate(PROMPTS[0], max_new_tokens=4)
    assert len(timed) == 1


def test_a_quantized_model_keeps_a_cost_curve_of_its_own(tokenizer, monkeypatch, tmp_path):
    """Quantizing changes what a forward of each size costs, not the model's shapes or dtype: int8
    and 4-bit copies of one model each time their own curve rather than load the other's."""
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(tmp_path))
    for quantization in (None, "int8", "int4"):
        model = tiny_model("llama")
        if quantization:
            quantize_model(model, quantization)
        SpeculativeEngine(model, tokenizer).generate(PROMPTS[0], max_new_tokens=2)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 3
