"""The server against hostile clients and careless operators, on 127.0.0.1: a queue bound that holds
for streams, clients that read nothing or send slowly, a graceful shutdown (a real process and
SIGTERM), nesting, size and type limits checked before the work they guard, and the API key."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from packaged_fixtures import MODEL, wait_until

from rag_speculate.entrypoints.openai.background import free_port
from rag_speculate.entrypoints.openai.background import running as serving

pytest.importorskip("fastapi")

# A raw continuation this model keeps writing without an end of text: a long generation.
COUNTING = "Numbers: 1, 2, 3, 4, 5, 6, 7,"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine():
    from rag_speculate.entrypoints.engines import shared_engine

    return shared_engine(MODEL, dtype="float32", device="cpu", draft_budget=None)


def served(engine, name: str = MODEL, max_queued: int = 16, sock: socket.socket | None = None, **options):
    from rag_speculate.entrypoints.openai import Server
    from rag_speculate.entrypoints.openai.app import create_app

    server = Server(engine, name, max_queued=max_queued)
    return server, serving(create_app(server, **options), sock=sock)


def events(lines) -> list[str]:
    return [line.removeprefix("data:").strip() for line in lines if line.startswith("data:")]


def test_streams_past_the_queue_bound_get_503_before_any_byte(engine):
    """30 streamed requests at once, 4 may wait: each gets either a whole stream (its finish chunk and
    [DONE], no error event) or a 503 with Retry-After, and /metrics counts the 503s."""
    server, running = served(engine, max_queued=4)

    async def one(client: httpx.AsyncClient, url: str) -> tuple[int, list[str], httpx.Headers]:
        body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 4, "temperature": 0, "stream": True}
        async with client.stream("POST", f"{url}/completions", json=body) as response:
            return response.status_code, [line async for line in response.aiter_lines()], response.headers

    async def all_at_once(url: str) -> list:
        limits = httpx.Limits(max_connections=40, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, url) for _ in range(30)))

    with running as url:
        answers = asyncio.run(all_at_once(url))
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
    refused = [(json.loads("".join(lines)), headers) for status, lines, headers in answers if status == 503]
    streamed = [events(lines) for status, lines, _ in answers if status == 200]
    assert len(refused) + len(streamed) == 30 and len(streamed) >= 5 and refused
    for error, headers in refused:
        assert int(headers["Retry-After"]) >= 1 and error["error"]["type"] == "server_overloaded"
    for data in streamed:
        chunks = [json.loads(d) for d in data[:-1]]
        assert data[-1] == "[DONE]" and not any("error" in c for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
    assert f'rag_speculate_requests_total{{endpoint="/v1/completions",status="503"}} {len(refused)}.0' in metrics
    assert server.admission.running == 0 and server.admission.waiting == 0


def test_a_client_that_stops_reading_is_cut_off_and_the_next_request_served(engine):
    """A client that reads nothing of a long stream fills the buffers between it and the server; its
    next send waits past the send timeout and the stream is cut off, its row freed, while the next
    request is served. A long served name makes every chunk large, and small socket buffers (the
    listening socket's, which connections inherit, and the client's) fill in a few chunks."""
    name = "m" * 8192
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    server, running = served(engine, name=name, sock=listener, send_timeout_s=2)
    with running as url:
        silent = socket.socket()
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        silent.connect(listener.getsockname())
        body = json.dumps({"model": name, "prompt": COUNTING, "max_tokens": 4000, "temperature": 0, "stream": True}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        silent.sendall(head.encode() + body)
        wait_until(lambda: server.admission.running == 1, what="the silent client's stream to start")
        answer = httpx.post(f"{url}/completions", json={"model": name, "prompt": "The Eiffel Tower is in", "max_tokens": 6,
                                                          "temperature": 0}, timeout=120)
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["text"] == engine.generate("The Eiffel Tower is in", max_new_tokens=6).text
        # Read nothing until the silent client is cut off: reading would let its stream go on.
        wait_until(lambda: server.admission.running == 0, timeout=60, what="the silent client to be cut off")
        received = b""
        silent.settimeout(30)
        while chunk := silent.recv(1 << 16):
            received += chunk
        silent.close()
    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received  # cut off mid-stream


def test_a_body_sent_slowly_gets_a_408(engine):
    """A client that sends its body a byte a second is answered once the body timeout has passed."""
    server, running = served(engine, body_timeout_s=2)
    body = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 2}).encode()
    with running as url:
        slow = socket.create_connection(("127.0.0.1", int(url.split(":")[-1].split("/")[0])))
        slow.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        started = time.monotonic()
        for byte in body:
            if select.select([slow], [], [], 1.0)[0]:  # answered: stop sending
                break
            slow.sendall(bytes([byte]))
        answer = slow.recv(1 << 16)
        slow.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
        assert time.monotonic() - started < 30
        assert httpx.post(f"{url}/chat/completions", json=json.loads(body), timeout=60).status_code == 200


@pytest.mark.parametrize(("sig", "running_streams"), [(signal.SIGTERM, True), (signal.SIGINT, False)],
                         ids=["SIGTERM, a stream running", "SIGINT, a whole answer running"])
def test_a_signal_ends_the_running_answer_refuses_the_queued_one_and_exits_0(sig, running_streams):
    """`rag-speculate serve` in a process of its own: on the signal, a running stream gets a last chunk
    whose finish_reason says why and [DONE] (a running whole answer, a 503), the queued request a 503,
    and the process exits 0 within its grace period."""
    port = free_port()
    command = [sys.executable, "-m", "rag_speculate", "serve", "--model", MODEL, "--dtype", "float32", "--device", "cpu",
               "--threads", "1", "--port", str(port), "--shutdown-timeout", "2", "--max-batch", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    answers: dict[str, tuple] = {}

    def ask(role: str, stream: bool) -> None:
        body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 4000, "temperature": 0, "stream": stream}
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as response:
            answers[role] = (response.status_code, response.headers, list(response.iter_lines()))

    try:
        wait_until(lambda: _up(url) or process.poll() is not None, timeout=300, what="the server to start")
        assert process.poll() is None, process.stdout.read()
        threads = [threading.Thread(target=ask, args=("running", running_streams)),
                   threading.Thread(target=ask, args=("queued", not running_streams))]
        threads[0].start()
        wait_until(lambda: _gauge(url, "running_requests") == 1, timeout=60, what="the first request to start")
        threads[1].start()
        wait_until(lambda: _gauge(url, "queue_length") == 1, timeout=60, what="the second request to queue")
        time.sleep(0.5)  # a few tokens out
        signalled = time.monotonic()
        process.send_signal(sig)
        assert process.wait(timeout=60) == 0
        assert time.monotonic() - signalled < 30  # the grace period, a step of the engine and the last chunks' flush
        for thread in threads:
            thread.join(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    status, headers, lines = answers["running"]
    if running_streams:
        data = events(lines)
        assert status == 200 and data[-1] == "[DONE]", output
        finals = [json.loads(d)["choices"][0]["finish_reason"] for d in data[:-1]]
        assert finals[-1] == "shutdown" and all(f is None for f in finals[:-1])
    else:
        assert status == 503 and int(headers["Retry-After"]) >= 1 and "shutting down" in "".join(lines), output
    status, headers, _ = answers["queued"]
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert "Traceback" not in output


def _up(url: str) -> bool:
    try:
        return httpx.get(url.removesuffix("/v1") + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _gauge(url: str, name: str) -> float:
    for line in httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"rag_speculate_{name} "):
            return float(line.split()[1])
    return -1.0


@pytest.fixture(scope="module")
def base_url(engine):
    from rag_speculate.entrypoints.openai import Server
    from rag_speculate.entrypoints.openai.app import create_app

    with serving(create_app(Server(engine, MODEL))) as url:
        yield url


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_nesting_deeper_than_the_limit_is_a_400_naming_the_field(base_url):
    arguments = '{"query": ' + _deep(500) + "}"
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": arguments}}
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    response = httpx.post(f"{base_url}/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.1.tool_calls.0.function.arguments" and "nested" in error["message"]
    # Too deep for the JSON parser itself.
    body = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "metadata": {"a": %s}}' % (MODEL, _deep(10_000))
    response = httpx.post(f"{base_url}/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "metadata", response.text
    body = '{"model": "%s", "messages": [{"role": "user", "content": "hi", "tool_calls": [%s]}]}' % (MODEL, _deep(10_000))
    response = httpx.post(f"{base_url}/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.0.tool_calls", response.text


def test_a_7_mb_document_is_refused_before_it_is_tokenized(base_url, engine):
    cache = engine._inputs.documents
    entries = len(cache)
    document = "The Eiffel Tower stands in Paris. " * (7_000_000 // 34)
    for _ in range(3):
        started = time.monotonic()
        body = {"model": MODEL, "messages": HI, "max_tokens": 2, "documents": [document]}
        response = httpx.post(f"{base_url}/chat/completions", json=body, timeout=120)
        # Tokenizing it takes several seconds here; refusing it, a fraction of one.
        assert time.monotonic() - started < 5
        assert response.status_code == 400 and response.json()["error"]["param"] == "documents", response.text
    assert len(cache) == entries and cache.bytes <= cache.max_bytes


STRICT = [
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"seed": "7"}, "seed"),
]


@pytest.mark.parametrize("change, param", STRICT, ids=[f"{p}={next(iter(c.values()))!r}" for c, p in STRICT])
def test_values_of_another_json_type_are_a_400(base_url, change, param):
    body = {"model": MODEL, "messages": HI, "max_tokens": 2} | change
    response = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_prompt_of_booleans_is_not_token_ids(base_url):
    response = httpx.post(f"{base_url}/completions", json={"model": MODEL, "prompt": [True, False], "max_tokens": 2}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    # An integer is a JSON number: temperature 1 is as good as 1.0.
    response = httpx.post(f"{base_url}/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 1}, timeout=60)
    assert response.status_code == 200


def test_the_api_key_is_required_everywhere_but_health(engine):
    key = "sk-" + os.urandom(16).hex()
    _, running = served(engine, api_key=key)
    body = {"model": MODEL, "messages": HI, "max_tokens": 2}
    with running as url:
        root = url.removesuffix("/v1")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            for response in (httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=60),
                             httpx.get(f"{url}/models", headers=headers), httpx.get(f"{root}/metrics", headers=headers)):
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", response.text
        assert httpx.get(f"{root}/health").status_code == 200
        authorized = {"Authorization": f"Bearer {key}"}
        assert httpx.post(f"{url}/chat/completions", json=body, headers=authorized, timeout=60).status_code == 200
        assert httpx.get(f"{root}/metrics", headers=authorized).status_code == 200
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert httpx.get(f"{root}{path}", headers=authorized).status_code == 404
