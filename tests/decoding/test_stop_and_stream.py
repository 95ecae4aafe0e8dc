"""Stop strings end generation where plain decoding would, and never leak into the text or the stream."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, tiny_model

from rag_speculate import SpeculativeEngine

# The losslessness tests run through the CPU kernels and through the portable path alike.
pytestmark = pytest.mark.usefixtures("forward_path")

PROMPT = "the quick brown fox jumps over the lazy dog. the quick"


@pytest.fixture(scope="module")
def setup(tokenizer):
    model = tiny_model("llama", seed=6)
    ids = tokenizer.encode(PROMPT)
    reference = hf_greedy(model, ids, 60)
    return SpeculativeEngine(model, tokenizer), ids, reference


def first_stop_token(tokenizer, reference, stop):
    for end in range(1, len(reference) + 1):
        if stop in tokenizer.decode(reference[:end]):
            return end
    raise AssertionError("stop string not in the reference")


@pytest.mark.parametrize("start,length", [(5, 1), (20, 3), (33, 6)])
def test_stop_string_ends_at_the_completing_token(setup, tokenizer, start, length):
    engine, ids, reference = setup
    text = tokenizer.decode(reference, skip_special_tokens=True)
    stop = text[start : start + length]
    end = first_stop_token(tokenizer, reference, stop)
    result = engine.generate(ids, documents=[reference], max_new_tokens=60, stop=[stop, "never appears"])
    assert result.finish_reason == "stop"
    assert result.token_ids == reference[:end]
    assert result.text == text[: text.index(stop)]


def test_stream_deltas_add_up_and_hold_back_stop_strings(setup, tokenizer):
    engine, ids, reference = setup
    text = tokenizer.decode(reference, skip_special_tokens=True)
    stop = text[30:36]
    stream = engine.stream(ids, documents=[reference], max_new_tokens=60, stop=stop)
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text == text[: text.index(stop)]
    assert len([d for d in deltas if d]) > 1
    # Several tokens per step: the stop string straddles at least one delta boundary in these runs,
    # and no prefix of it was ever shown beyond the final text.
    shown = ""
    for delta in deltas:
        shown += delta
        assert stop not in shown


def test_stream_without_stop_matches_generate(setup, tokenizer):
    engine, ids, reference = setup
    stream = engine.stream(ids, documents=[reference], max_new_tokens=60)
    assert "".join(stream) == tokenizer.decode(reference, skip_special_tokens=True)
    assert stream.result.token_ids == reference
    assert stream.result.finish_reason == ("eos" if reference[-1] == 0 else "length")


def test_result_before_the_end_is_an_error(setup):
    engine, ids, _ = setup
    stream = engine.stream(ids, max_new_tokens=5)
    with pytest.raises(RuntimeError, match="not finished"):
        _ = stream.result
    stream.close()
    # Closing a stream early frees the engine for the next caller.
    assert engine.generate(ids, max_new_tokens=3).finish_reason in ("length", "eos")
