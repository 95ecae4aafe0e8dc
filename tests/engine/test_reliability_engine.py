"""No caller can block the engine, and every bad input is refused by name when the call is made."""

from __future__ import annotations

import gc
import threading

import pytest
from conftest import hf_greedy, tiny_model

from rag_speculate import DraftTree, InvalidArgumentError, SpeculativeEngine
from rag_speculate.decoding.request import check_messages
from rag_speculate.drafters import Drafter

PROMPT = "the quick brown fox jumps over the lazy dog. the quick"


@pytest.fixture(scope="module")
def engine(tokenizer):
    return SpeculativeEngine(tiny_model("llama"), tokenizer)


def _in_thread(fn, timeout: float = 120.0):
    """fn's result from another thread, failing the test rather than hanging it."""
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(value=fn()), daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), "the call waited on a stream nobody reads"
    return box["value"]


def test_an_abandoned_stream_does_not_block_a_second_caller_on_the_same_thread(engine, tokenizer):
    def same_thread():
        stream = engine.stream(PROMPT, max_new_tokens=40)
        next(stream)  # read once, then neither closed nor dropped: the reference lives on
        # Before, the stream's suspended generator held the engine's lock here: a plain deadlock.
        return stream, engine.generate(PROMPT, max_new_tokens=20)

    _, result = _in_thread(same_thread)
    assert result.token_ids == hf_greedy(engine.model, tokenizer.encode(PROMPT), 20)


def test_an_abandoned_stream_does_not_block_another_thread(engine, tokenizer):
    stream = engine.stream(PROMPT, max_new_tokens=40)
    next(stream)
    result = _in_thread(lambda: engine.generate(PROMPT, max_new_tokens=12))
    assert result.token_ids == hf_greedy(engine.model, tokenizer.encode(PROMPT), 12)
    # The abandoned stream still holds its whole answer for a reader that comes back.
    assert "".join(stream) and stream.result.finish_reason in ("length", "eos")


def test_closing_a_stream_mid_way_stops_it_at_the_next_step(engine):
    stream = engine.stream(PROMPT, max_new_tokens=400)
    next(stream)
    stream.close()
    for _ in stream:
        pass
    assert stream.result.finish_reason == "cancelled"
    assert len(stream.result.token_ids) < 400
    assert _in_thread(lambda: engine.generate(PROMPT, max_new_tokens=5)).token_ids


def test_a_dropped_stream_is_cancelled(engine):
    stream = engine.stream(PROMPT, max_new_tokens=400)
    next(stream)
    cancelled = stream._channel.cancelled
    del stream
    gc.collect()
    assert cancelled.is_set()
    assert _in_thread(lambda: engine.generate(PROMPT, max_new_tokens=5)).token_ids


def test_an_error_in_the_generation_reaches_the_reader(tokenizer):
    class Broken(Drafter):
        name = "broken"

        def propose(self, tokens, budget):
            return DraftTree([10_000], [-1])

    stream = SpeculativeEngine(tiny_model("llama"), tokenizer, Broken()).stream(PROMPT, max_new_tokens=5)
    with pytest.raises(Exception, match="proposed a token outside"):
        list(stream)


@pytest.mark.parametrize(
    "prompt,kwargs,match",
    [
        (b"hello", {}, "prompt must be text"),
        ("hi", {"documents": [b"some bytes"]}, r"documents\[0\] must be text"),
        ("hi", {"documents": b"bytes"}, "documents must be a list"),
        ("lone \ud800 surrogate", {}, "prompt is not valid Unicode"),
        ("hi", {"documents": ["bad \udfff"]}, r"documents\[0\] is not valid Unicode"),
        ("hi", {"stop": ["\ud800"]}, "stop is not valid Unicode"),
        ([{"role": "user", "content": "\ud800"}], {"chat": True}, r"messages\[0\].content is not valid Unicode"),
        ([{"role": "wizard", "content": "hi"}], {"chat": True}, r"messages\[0\] has role 'wizard'"),
        ([{"role": "system", "content": "be brief"}], {"chat": True}, "no user turn"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], {"chat": True}, "end with a 'assistant' turn"),
        ("hi", {"max_new_tokens": True}, "max_new_tokens must be an integer"),
        ("hi", {"max_new_tokens": 5.0}, "max_new_tokens must be an integer"),
        ("hi", {"temperature": "0.7"}, "temperature must be a finite number"),
        ("hi", {"temperature": float("nan")}, "temperature must be a finite number"),
        ("hi", {"top_p": "1"}, "top_p must be a finite number"),
        ("hi", {"top_k": True}, "top_k must be an integer"),
        ("hi", {"stop": 5}, "stop must be a non-empty string"),
        ("hi", {"seed": "abc"}, "seed must be None or an integer"),
        ("hi", {"seed": 2**70}, "seed must be None or an integer"),
        ("hi", {"seed": -1}, "seed must be None or an integer"),
        ("hi", {"seed": True}, "seed must be None or an integer"),
    ],
)
def test_bad_input_is_refused_by_name_when_the_call_is_made(engine, prompt, kwargs, match):
    # stream(), not generate(): the error comes from the call itself, before the first next().
    with pytest.raises(InvalidArgumentError, match=match):
        engine.stream(prompt, **kwargs)


def test_a_tool_result_may_close_the_history(engine):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "42"}]
    assert check_messages(messages) is messages
