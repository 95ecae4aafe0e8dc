"""The server under load, against 127.0.0.1: concurrent clients lose nothing, get the engine's answers
and share its steps (batched); a client that disconnects frees the engine at once; a full queue
answers 503."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from packaged_fixtures import DOCUMENT, MODEL, wait_until

from rag_speculate.entrypoints.openai.background import running as serving

pytest.importorskip("fastapi")

# A raw continuation this model keeps writing without an end of text: a long generation to cut short.
COUNTING = "Numbers: 1, 2, 3, 4, 5, 6, 7,"
LONG = 1000


@pytest.fixture(scope="module")
def engine():
    from rag_speculate.entrypoints.engines import shared_engine

    return shared_engine(MODEL, dtype="float32", device="cpu", draft_budget=None)


def served(engine, max_queued: int = 16, max_batch: int | None = None):
    """A server of `engine`, or with `max_batch`, of another engine on its weights batching that many."""
    from rag_speculate import SpeculativeEngine
    from rag_speculate.entrypoints.openai import Server
    from rag_speculate.entrypoints.openai.app import create_app

    if max_batch is not None:
        engine = SpeculativeEngine(engine.model, engine.tokenizer, max_batch=max_batch)
    server = Server(engine, MODEL, max_queued=max_queued)
    return server, serving(create_app(server))


def engine_free(engine) -> bool:
    # The engine's own lock: held from a generation's first step to its last.
    return engine.in_flight == 0


def test_32_requests_4_at_a_time_lose_nothing_and_match_the_engine(engine):
    questions = [f"{DOCUMENT}\n\nQuestion {i}: {q}" for i, q in enumerate(
        ["Who designed it?", "Where is it?", "When was it built?", "What is it made of?",
         "Who named it?", "What city?", "What country?", "Describe it."])]
    expected = {q: engine.generate([{"role": "user", "content": q}], chat=True, documents=[DOCUMENT], max_new_tokens=16).text
                for q in questions}
    server, running = served(engine)
    with running as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)

        def ask(i: int) -> tuple[str, str]:
            q = questions[i % len(questions)]
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=16, temperature=0,
                          extra_body={"documents": [DOCUMENT]})
            if i % 2:
                chunks = client.chat.completions.create(stream=True, **kwargs)
                return q, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return q, client.chat.completions.create(**kwargs).choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(32)))
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
    assert len(answers) == 32
    assert all(text == expected[q] for q, text in answers)
    assert server.admission.running == 0 and server.admission.waiting == 0
    # The four clients' generations ran together: steps were shared.
    steps = {k: float(v) for k, v in re.findall(r"^rag_speculate_batch_size_(sum|count) (\S+)$", metrics, re.M)}
    assert steps["sum"] / steps["count"] > 1.5, steps


def test_a_disconnected_stream_frees_the_engine_for_the_next_request(engine):
    server, running = served(engine)
    with running as url:
        body = {"model": MODEL, "prompt": COUNTING, "max_tokens": LONG, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # generating
            assert not engine_free(engine)
            lines.close()
        # The client has gone: the generation stops at its next step, not after LONG tokens.
        wait_until(lambda: engine_free(engine) and server.admission.running == 0, timeout=10, what="the engine to be freed")
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        answer = client.completions.create(model=MODEL, prompt="The Eiffel Tower is in", max_tokens=6, temperature=0)
        assert answer.choices[0].text == engine.generate("The Eiffel Tower is in", max_new_tokens=6).text


def test_a_client_that_stops_waiting_cancels_its_generation(engine):
    server, running = served(engine)
    with running as url:
        body = {"model": MODEL, "prompt": COUNTING, "max_tokens": LONG, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
        wait_until(lambda: engine_free(engine) and server.admission.running == 0, timeout=10, what="the engine to be freed")
        counted = 'rag_speculate_requests_total{endpoint="/v1/completions",status="499"} 1.0'
        wait_until(lambda: counted in httpx.get(url.removesuffix("/v1") + "/metrics").text, timeout=10, what="the 499 counted")


def test_a_full_queue_answers_503_with_retry_after(engine):
    server, running = served(engine, max_queued=1, max_batch=1)
    with running as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        long_body = {"model": MODEL, "prompt": COUNTING, "max_tokens": LONG, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/completions", json=long_body, timeout=60) as running_stream:
            # Held: closing the line iterator would close the connection.
            lines = running_stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            waiting: dict = {}
            waiter = threading.Thread(target=lambda: waiting.update(answer=client.completions.create(
                model=MODEL, prompt="The Eiffel Tower is in", max_tokens=6, temperature=0)))
            waiter.start()
            wait_until(lambda: server.admission.waiting == 1, what="the second request to queue")

            refused = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
            assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["type"] == "server_overloaded"
            with pytest.raises(openai.APIStatusError) as streamed:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True)
            assert streamed.value.status_code == 503
        # The first client has gone: the queued request runs and gets the engine's answer.
        waiter.join(timeout=60)
        assert waiting["answer"].choices[0].text == engine.generate("The Eiffel Tower is in", max_new_tokens=6).text
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
        assert 'rag_speculate_requests_total{endpoint="/v1/completions",status="503"} 1.0' in metrics
