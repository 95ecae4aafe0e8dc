"""`timed_generate`, the baseline every speed-up is measured against."""

from __future__ import annotations

import contextlib
import threading

from conftest import hf_greedy, tiny_model

from rag_speculate.decoding.baseline import timed_generate


def test_generate_runs_on_a_thread_of_its_own_inside_the_context_given(tokenizer):
    model = tiny_model("llama")
    ids = tokenizer.encode("the quick brown fox")
    threads = []

    @contextlib.contextmanager
    def context():
        threads.append(threading.current_thread())
        yield

    out = timed_generate(model, ids, 12, context=context)
    # Not the caller's: the engine's forwards run on a thread of their own, and so does the baseline.
    assert threads and threads[0] is not threading.current_thread()
    assert out.token_ids == hf_greedy(model, ids, 12)
    assert 0 <= out.decode_s <= out.total_s and out.decode_tokens == 11
