"""The engine's cost curve is timed through the step that verifies: the fixed-shape step's buckets
where it runs (what CUDA graphs replay), the growing cache's forward where that runs, each kept
under a key of its own, so that a curve of eager forwards never steers a step that costs otherwise."""

from __future__ import annotations

from conftest import hf_greedy, tiny_model

from rag_speculate import SpeculativeEngine

PROMPT = "the quick brown fox jumps over the lazy dog. the quick"


def test_the_static_step_times_its_own_buckets_under_a_key_of_its_own(tokenizer, monkeypatch, tmp_path):
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(tmp_path))
    model = tiny_model("llama")
    engine = SpeculativeEngine(model, tokenizer, static_step=True, max_batch=4, draft_budget=7)
    shapes: list[tuple[int, ...]] = []  # of every forward's input ids
    embeddings = model.get_input_embeddings()
    hook = embeddings.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    try:
        engine._costs()
    finally:
        hook.remove()
    step = engine._runner.step
    # Every bucket of one row, then rows of the step's widest: up to the 32 tokens of 4 rows of 8.
    assert set(shapes) == {(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8)} <= set(step.shapes())
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    # Timing ran on padding: answers after it, and after timing again between generations, are generate's.
    reference = hf_greedy(model, tokenizer.encode(PROMPT), 24)
    assert engine.generate(PROMPT, documents=[reference[:12]], max_new_tokens=24).token_ids == reference
    engine._runner.timed()(32)
    assert engine.generate(PROMPT, documents=[reference[:12]], max_new_tokens=24).token_ids == reference
    # The growing cache's curve, for the same model and budget, is timed and kept apart.
    SpeculativeEngine(model, tokenizer, max_batch=4, draft_budget=7)._costs()
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2
