"""The engine's fixed-shape step (`static_step=True`, what CUDA graphs replay, run eagerly on the CPU):
greedy answers are `model.generate`'s, alone and batched with rows joining and leaving, under the
meta-device guard too; a request too long for a preallocated row is refused at once; CUDA graphs
are refused by name where they cannot run."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, hf_greedy, tiny_model
from drafters_for_tests import RandomTreeDrafter

from test_batching import PINNED, PROMPTS, joining_and_leaving

from rag_speculate import InvalidArgumentError, SpeculativeEngine
from rag_speculate.decoding.prompt_cache import kv_bytes_per_token


def _engine(model, tokenizer, drafter=None, **options) -> SpeculativeEngine:
    engine = SpeculativeEngine(model, tokenizer, drafter, static_step=True, **options)
    engine.cost_model = PINNED
    return engine


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # the lean forward, and a model's own
def test_rows_joining_and_leaving_give_each_its_greedy_answer(arch, tokenizer, forward_path):
    model = tiny_model(arch)
    engine = _engine(model, tokenizer, max_batch=4)
    assert engine.stats().static_step and engine.stats().cuda_graphs == 0
    results = joining_and_leaving(engine, model, tokenizer)
    assert max(r.stats.tokens_per_forward for r in results) > 1.5  # and drafts were accepted
    reference = results[0].token_ids  # generate's, as joining_and_leaving checked
    one = _engine(model, tokenizer, max_batch=1).generate(PROMPTS[0], documents=[reference[:20]], max_new_tokens=40)
    assert one.token_ids == reference


def test_adversarial_trees_under_the_meta_device_guard_match_generate(tokenizer, monkeypatch):
    """Random trees (most drafts rejected: every shape of keep), and any tensor the step made without
    naming its device would land on the meta device and fail."""
    model = tiny_model("qwen2", seed=1)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    references = [hf_greedy(model, i, 24) for i in ids]
    engine = _engine(model, tokenizer, RandomTreeDrafter(VOCAB, seed=3), draft_budget=7)
    step = engine._thread._step

    def guarded() -> bool:
        with torch.device("meta"):
            return step()

    monkeypatch.setattr(engine._thread, "_step", guarded)
    assert [r.token_ids for r in engine.generate_batch(ids, max_new_tokens=24)] == references


def test_a_request_too_long_for_a_row_is_refused_naming_what_to_change(tokenizer):
    model = tiny_model("llama")
    # Four rows of 64 entries: a request needing 16 + 50 + 16 + 1 fits the budget, not a row.
    engine = _engine(model, tokenizer, max_batch=4, kv_cache_bytes=256 * kv_bytes_per_token(model))
    with pytest.raises(InvalidArgumentError, match="preallocated cache holds \\(64 tokens: kv_cache_bytes") as refused:
        engine.generate(list(range(2, 18)), max_new_tokens=50)
    assert refused.value.argument == "max_new_tokens"
    fits = engine.generate(list(range(2, 18)), max_new_tokens=30)
    assert fits.token_ids == hf_greedy(model, list(range(2, 18)), 30)


def test_cuda_graphs_are_refused_by_name_where_they_cannot_run(tokenizer):
    model = tiny_model("llama").to("cpu")  # on the CPU wherever the tests run
    with pytest.raises(InvalidArgumentError, match="cuda_graphs=True, but the model is on cpu") as refused:
        SpeculativeEngine(model, tokenizer, cuda_graphs=True)
    assert refused.value.argument == "cuda_graphs"
    for option, value in (("cuda_graphs", "yes"), ("static_step", 1)):
        with pytest.raises(InvalidArgumentError, match=f"{option} must be True, False or None") as refused:
            SpeculativeEngine(model, tokenizer, **{option: value})
        assert refused.value.argument == option
    with pytest.raises(InvalidArgumentError, match="static_step=True, but the model's forward cannot take a batch's rows"):
        SpeculativeEngine(tiny_model("gemma3"), tokenizer, static_step=True)  # sliding windows
    # By default on the CPU: the growing cache, no graphs.
    assert SpeculativeEngine(model, tokenizer).stats() == SpeculativeEngine(model, tokenizer, cuda_graphs=False).stats()
    assert not SpeculativeEngine(model, tokenizer).stats().static_step
