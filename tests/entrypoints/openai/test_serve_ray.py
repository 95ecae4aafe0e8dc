"""Two replicas of the server on a local Ray Serve instance, through Ray's HTTP proxy on 127.0.0.1:
both run and report metrics, answers match the in-process engine's, a prompt another process
prefilled is a hit in each replica through the shared disk tier, errors keep OpenAI's shape, and
clients that disconnect free the engines."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from packaged_fixtures import DOCUMENT, MODEL

from rag_speculate.entrypoints.openai.background import free_port

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

# Generations each replica's engine batches; it holds one more (`ray_serve.replica_ongoing`).
MAX_BATCH = 2
# Requests Ray's router holds beyond what the replicas hold (MAX_BATCH + 1 each). Its count is
# the router's view, which can run ahead of the replicas': room for the concurrent clients below.
QUEUED = 8
# Where this node's Ray exports the replicas' metrics.
METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The prompt cache's disk tier, one folder for both replicas and this process."""
    return tmp_path_factory.mktemp("prompt-cache")


@pytest.fixture(scope="module")
def ray_url(cache_dir):
    from ray import serve

    from rag_speculate.entrypoints.openai import ServerConfig
    from rag_speculate.entrypoints.openai.ray_serve import application

    ray.init(num_cpus=2, include_dashboard=False, _metrics_export_port=METRICS_PORT,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServerConfig(model=MODEL, dtype="float32", device="cpu", max_queued=QUEUED, prompt_cache_dir=cache_dir,
                              max_batch=MAX_BATCH)
        serve.run(application(config, replicas=2, cpus_per_replica=1), name="rag-speculate", route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_as_the_engine_does(ray_url):
    from ray import serve

    from rag_speculate.entrypoints.engines import shared_engine

    status = serve.status().applications["rag-speculate"].deployments["rag-speculate"]
    assert status.replica_states == {"RUNNING": 2}

    engine = shared_engine(MODEL, dtype="float32", device="cpu", draft_budget=None)
    questions = [f"{DOCUMENT}\n\n{q}" for q in ("Who designed it?", "Where is it?", "When was it built?", "What is it?")]
    expected = [engine.generate([{"role": "user", "content": q}], chat=True, documents=[DOCUMENT], max_new_tokens=16).text
                for q in questions]
    client = openai.OpenAI(base_url=ray_url, api_key="unused", max_retries=0, timeout=120)

    def ask(i: int) -> str:
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": questions[i % 4]}], max_tokens=16,
                      temperature=0, extra_body={"documents": [DOCUMENT]})
        if i % 2:
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs) if c.choices)
        response = client.chat.completions.create(**kwargs)
        assert response.model_extra["acceleration"]["new_tokens"] > 0
        return response.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(8)))
    assert answers == [expected[i % 4] for i in range(8)]


def test_a_prefix_another_process_prefilled_is_a_hit_in_every_replica(ray_url, cache_dir):
    """This process prefills a prompt into the shared folder; then every request for it, whichever
    replica takes it, reuses its full blocks: the first a replica sees can only come from disk."""
    from rag_speculate import SpeculativeEngine

    prompt = f"{DOCUMENT}\n\nQuestion: what is the tower made of?\nAnswer:"
    writer = SpeculativeEngine.from_pretrained(MODEL, dtype=torch.float32, device="cpu", prompt_cache_dir=cache_dir)
    expected = writer.generate(prompt, max_new_tokens=8)
    writer.prompt_cache.store.flush()
    blocks = (expected.stats.prompt_tokens - 1) // 64 * 64
    assert blocks > 0
    client = openai.OpenAI(base_url=ray_url, api_key="unused", max_retries=0, timeout=120)

    def ask(_: int):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(ask, range(8)))
    assert {r.choices[0].text for r in responses} == {expected.text}
    assert all(r.usage.prompt_tokens_details.cached_tokens >= blocks for r in responses)


def test_metrics_carry_each_replicas_tag(ray_url):
    """Both replicas answered the requests above, and each reported them through ray.serve.metrics."""
    import re

    deadline, replicas = time.monotonic() + 60, set()
    while len(replicas) < 2:
        assert time.monotonic() < deadline, f"replicas seen in Ray's metrics: {replicas}"
        time.sleep(1)
        text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics").text
        replicas = {m.group(1) for line in text.splitlines() if line.startswith("ray_rag_speculate_generated_tokens_total")
                    for m in [re.search(r'replica="([^"]+)"', line)] if m}


def test_models_and_errors_through_the_proxy(ray_url):
    client = openai.OpenAI(base_url=ray_url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    response = httpx.post(f"{ray_url}/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_disconnects_free_the_replicas(ray_url):
    """Fill both replicas with long streams (MAX_BATCH generating, one waiting on each, which gets its
    first byte only once it runs), then disconnect every client: a short request is answered long before any
    of those generations could have run to its end, so Ray's cancellation reached each engine's step
    loop. (Past the replicas, Ray's router
    queues up to max_queued_requests and answers 503; how it counts its queue while routing varies
    from run to run, so the standalone server's queue test is where a 503 is asserted.)"""
    import threading

    from rag_speculate.entrypoints.engines import shared_engine

    long_body = {"model": MODEL, "prompt": "Numbers: 1, 2, 3, 4, 5, 6, 7,", "max_tokens": 4000, "temperature": 0, "stream": True}
    statuses: list = []
    leave = threading.Event()

    def hold() -> None:
        try:
            with httpx.stream("POST", f"{ray_url}/completions", json=long_body, timeout=120) as response:
                statuses.append(response.status_code)
                leave.wait(120)
        except httpx.HTTPError as error:  # reported in the assertion below
            statuses.append(repr(error))

    clients = [threading.Thread(target=hold) for _ in range(2 * (MAX_BATCH + 1))]
    for client in clients:
        client.start()
    deadline = time.monotonic() + 60
    while len(statuses) < 2 * MAX_BATCH:  # each replica's generating streams
        assert time.monotonic() < deadline, f"statuses so far: {statuses}"
        time.sleep(0.1)
    leave.set()  # the waiting streams leave as soon as they start
    for client in clients:
        client.join(timeout=120)
    assert statuses == [200] * len(clients)

    engine = shared_engine(MODEL, dtype="float32", device="cpu", draft_budget=None)
    short = openai.OpenAI(base_url=ray_url, api_key="unused", max_retries=0, timeout=30)
    answer = short.completions.create(model=MODEL, prompt="The Eiffel Tower is in", max_tokens=6, temperature=0)
    assert answer.choices[0].text == engine.generate("The Eiffel Tower is in", max_new_tokens=6).text
