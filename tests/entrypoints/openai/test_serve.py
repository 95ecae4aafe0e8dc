"""The OpenAI-compatible server with the `openai` client against 127.0.0.1: answers identical to the
in-process engine's, streaming, usage, retrieval, metrics, and a clear 400 for every bad request."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from packaged_fixtures import DOCUMENT, MODEL

from rag_speculate.entrypoints.openai.background import running as serving

pytest.importorskip("fastapi")

QUESTION = [{"role": "user", "content": f"{DOCUMENT}\n\nWho designed the Eiffel Tower?"}]


@pytest.fixture(scope="module")
def engine():
    from rag_speculate.entrypoints.engines import shared_engine

    return shared_engine(MODEL, dtype="float32", device="cpu", draft_budget=None)


@pytest.fixture(scope="module")
def server(engine):
    from rag_speculate.entrypoints.openai import Server

    return Server(engine, MODEL)


@pytest.fixture(scope="module")
def base_url(server):
    from rag_speculate.entrypoints.openai.app import create_app

    with serving(create_app(server, max_body_bytes=1 << 20)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_chat_completion_is_the_engines_answer(client, engine):
    expected = engine.generate(QUESTION, chat=True, documents=[DOCUMENT], max_new_tokens=40)
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, extra_body={"documents": [DOCUMENT]}
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert response.object == "chat.completion" and response.model == MODEL and response.id.startswith("chatcmpl-")
    assert response.usage.prompt_tokens == expected.stats.prompt_tokens
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    acceleration = response.model_extra["acceleration"]
    assert acceleration["new_tokens"] == len(expected.token_ids)
    assert acceleration["target_forwards"] <= acceleration["new_tokens"]
    # The documents reached the drafters: the answer copies from them.
    assert sum(acceleration["accepted_tokens"].values()) > 0


def test_streamed_chat_adds_up_to_the_answer_with_usage_last(client, engine):
    expected = engine.generate(QUESTION, chat=True, max_new_tokens=30)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=30, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["acceleration"]["new_tokens"] == len(expected.token_ids)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert len({c.id for c in chunks}) == 1


def test_stop_strings_end_the_answer(client, engine):
    expected = engine.generate(QUESTION, chat=True, max_new_tokens=40, stop=["Eiffel"])
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, stop=["Eiffel"])
    assert response.choices[0].message.content == expected.text
    assert expected.finish_reason == "stop" and response.choices[0].finish_reason == "stop"
    assert "Eiffel" not in response.choices[0].message.content


def test_text_completion_and_its_stream(client, engine):
    prompt = "The Eiffel Tower is located in"
    expected = engine.generate(prompt, max_new_tokens=12)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert response.object == "text_completion" and response.choices[0].text == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_repeats(client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first
    # vLLM's top_k, where -1 (as 0) turns it off.
    assert client.chat.completions.create(**kwargs, extra_body={"top_k": -1}).choices[0].message.content == first


def test_json_answers_are_asked_for_in_the_prompt(client, engine):
    """Nothing constrains decoding (the answer stays the model's own): response_format becomes a system
    instruction, as in the LangChain adapter, and the answer is the engine's for those messages."""
    from rag_speculate.entrypoints.prompt import json_instruction, with_instructions

    schema = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": {
        "type": "object", "properties": {"designer": {"type": "string"}}, "required": ["designer"]}}}
    for response_format in ({"type": "json_object"}, schema):
        instructed = with_instructions(QUESTION, system=json_instruction(response_format))
        expected = engine.generate(instructed, chat=True, max_new_tokens=24)
        response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                                  response_format=response_format)
        assert response.choices[0].message.content == expected.text
        assert response.usage.prompt_tokens == expected.stats.prompt_tokens


def test_prompt_cache_shows_in_usage(client):
    messages = [{"role": "user", "content": f"{DOCUMENT}\n\nWhen was the tower built?"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_models_health_and_metrics(client, base_url, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    root = base_url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").json()["status"] == "ok"
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, extra_body={"documents": [DOCUMENT]})
    metrics = httpx.get(f"{root}/metrics").text
    for name in ("rag_speculate_requests_total", "rag_speculate_queue_length", "rag_speculate_generated_tokens_total",
                 "rag_speculate_target_forwards_total", "rag_speculate_tokens_per_forward_bucket",
                 "rag_speculate_decode_tokens_per_second_bucket", 'rag_speculate_drafted_tokens_total{drafter="ngram_trie"}'):
        assert name in metrics, name
    assert 'rag_speculate_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    # The prompt cache by tier: memory only here (no --prompt-cache-dir), its bytes as the engine counts them.
    held = re.search(r'rag_speculate_prompt_cache_bytes\{tier="memory"\} (\S+)', metrics)
    assert held and float(held.group(1)) == server.engine.prompt_cache.stats().bytes > 0
    assert 'rag_speculate_prompt_cache_bytes{tier="disk"} 0.0' in metrics
    assert 'rag_speculate_prompt_cache_tokens_total{tier="memory"}' in metrics


def test_head_health_is_a_200(base_url):
    """What load balancers' and uptime monitors' probes send."""
    response = httpx.head(base_url.removesuffix("/v1") + "/health")
    assert response.status_code == 200 and response.content == b""


def test_tool_calls_in_the_answer_come_back_as_tool_calls(server):
    """The packaged small model's template renders no tools (a 400 below), so the answer is given:
    what is tested is how a call in it reaches the client, whole and streamed."""
    import asyncio

    from rag_speculate.decoding.result import GenerationResult, GenerationStats
    from rag_speculate.entrypoints.openai.app import _Reply
    from rag_speculate.entrypoints.openai.protocol import ChatCompletionRequest
    from rag_speculate.entrypoints.openai.server import Job
    from rag_speculate.entrypoints.prompt import Prepared

    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
    body = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "height?"}], tools=tools, stream=True)
    messages = [m.template_message(f"messages.{i}") for i, m in enumerate(body.messages)]
    job = Job(Prepared(request=None, messages=messages, tools=tools), chat=True)
    text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "Eiffel height"}}\n</tool_call>'
    result = GenerationResult(text, [1, 2], "eos", GenerationStats(prompt_tokens=5, new_tokens=2, target_forwards=2))

    # A call sent back in the history reaches the template with its arguments as an object.
    history = ChatCompletionRequest(model=MODEL, messages=[
        {"role": "user", "content": "height?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "Eiffel height"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "330 m"}])
    assert history.messages[1].template_message("messages.1")["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": {"query": "Eiffel height"}}}]

    whole = _Reply(server, body, job).whole(result)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"]) == {"query": "Eiffel height"}

    async def deltas():
        for piece in (text[:8], text[8:20], text[20:]):
            yield piece
        yield result

    async def chunks():
        return [c async for c in _Reply(server, body, job).chunks(deltas())]

    streamed = asyncio.run(chunks())
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed)
    assert content == "Let me look."  # the call's text is held back, never streamed as content
    [calls] = [c["choices"][0]["delta"]["tool_calls"] for c in streamed if c["choices"][0]["delta"].get("tool_calls")]
    assert calls == [{"index": 0, **call}]
    assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"


BAD_REQUESTS = [
    ({"model": "../../etc/passwd"}, "model"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"stop": [1]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"documents": "not a list"}, "documents"),
    ({"documents": [1, 2]}, "documents.0"),
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": [{"type": "function", "function": {"name": "search"}}], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"retrieve": 3}, "retrieve"),
    ({"not_an_openai_field": 1}, "not_an_openai_field"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "found"}]}, "messages.1.tool_calls.0.function.arguments"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    # This model's chat template renders no tools.
    ({"tools": [{"type": "function", "function": {"name": "search"}}]}, "tools"),
]


@pytest.mark.parametrize("change, param", BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_bad_chat_requests_get_a_400_naming_the_field(base_url, change, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | change
    response = httpx.post(f"{base_url}/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_documents_at_the_engines_limit_are_served_and_one_byte_more_is_a_400_naming_them(base_url):
    from rag_speculate.engine.inputs import MAX_DOCUMENT_BYTES

    at_limit = (DOCUMENT * (MAX_DOCUMENT_BYTES // len(DOCUMENT) + 1))[:MAX_DOCUMENT_BYTES]
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1}
    assert httpx.post(f"{base_url}/chat/completions", json=body | {"documents": [at_limit]}, timeout=60).status_code == 200
    # As many characters, one byte more: the limit is in UTF-8 bytes.
    over = body | {"documents": [at_limit[:-1], "é"]}
    response = httpx.post(f"{base_url}/chat/completions", json=over, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "documents", response.text


def test_a_request_without_max_tokens_gets_the_room_the_models_limit_leaves(server, engine):
    """Prepared once, with the answer's bound from the prompt's counted tokens: the same request as
    the engine's own for that bound."""
    from rag_speculate.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    limit = engine.traits.max_positions
    job = server.chat_job(ChatCompletionRequest(model=MODEL, messages=QUESTION))
    prompt_tokens = len(engine.encode_prompt(QUESTION, chat=True))
    assert job.prepared.request == engine.prepare(QUESTION, chat=True, max_new_tokens=limit - prompt_tokens, temperature=1.0)
    job = server.completion_job(CompletionRequest(model=MODEL, prompt=[7] * (limit - 3)))
    assert job.prepared.request.max_new_tokens == 3


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_an_answer_bound_past_the_models_limit_is_a_400_in_the_fields_own_words(base_url, engine, field):
    prompt_tokens = len(engine.encode_prompt(QUESTION, chat=True))
    body = {"model": MODEL, "messages": QUESTION, field: engine.traits.max_positions}
    response = httpx.post(f"{base_url}/chat/completions", json=body, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field, response.text
    assert error["message"] == (f"{field}={engine.traits.max_positions} and the prompt's {prompt_tokens} tokens add up to "
                                f"{engine.traits.max_positions + prompt_tokens}, over the model's limit of {engine.traits.max_positions}")


def test_a_prompt_that_fills_the_models_limit_is_a_400_naming_the_prompt(base_url, engine):
    limit = engine.traits.max_positions
    response = httpx.post(f"{base_url}/completions", json={"model": MODEL, "prompt": [7] * limit}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert "no room is left for an answer" in response.json()["error"]["message"]
    # A chat's prompt is its messages.
    long_question = [{"role": "user", "content": "Paris " * limit}]
    response = httpx.post(f"{base_url}/chat/completions", json={"model": MODEL, "messages": long_question}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text


def test_bad_completion_requests_get_a_400(base_url):
    for change, param in [({"prompt": ["a", "b"]}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [10**9]}, "prompt"),
                          ({"echo": True}, "echo"), ({"retrieve": 2}, "retrieve")]:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4} | change
        response = httpx.post(f"{base_url}/completions", json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (change, response.text)


def test_malformed_and_oversized_bodies(base_url):
    response = httpx.post(f"{base_url}/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    huge = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (2 << 20)}]})
    response = httpx.post(f"{base_url}/chat/completions", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        for _ in range(3):
            yield b"x" * (512 << 10)

    response = httpx.post(f"{base_url}/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert httpx.get(f"{base_url}/nothing-here").status_code == 404


def test_streaming_errors_come_before_the_stream(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=0, stream=True)


def test_retrieval_from_the_servers_index(engine, tmp_path):
    from rag_speculate.entrypoints.engines import shared_engine
    from rag_speculate.entrypoints.openai import Server
    from rag_speculate.entrypoints.openai.app import create_app
    from rag_speculate.entrypoints.prompt import drafting_documents, rag_messages
    from rag_speculate.retrieval.corpus import CorpusIndex
    from rag_speculate.retrieval.documents import Document

    documents = [
        Document(id="eiffel", text=DOCUMENT, title="Eiffel Tower"),
        Document(id="louvre", text="The Louvre is the world's most-visited art museum, in Paris.", title="Louvre"),
        Document(id="nile", text="The Nile is a major north-flowing river in northeastern Africa.", title="Nile"),
    ]
    index = CorpusIndex.build(documents, tmp_path / "index", tokenizer=engine.tokenizer)
    rag = shared_engine(MODEL, dtype="float32", device="cpu", index=index)
    question = "Who designed the Eiffel Tower?"
    chunks = index.search(question, 2)
    expected = rag.generate(rag_messages(question, chunks), chat=True, documents=drafting_documents(chunks), max_new_tokens=24)
    with serving(create_app(Server(rag, MODEL, index))) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0, extra_body={"retrieve": 2}
        )
        with pytest.raises(openai.BadRequestError, match="user message"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": question}], max_tokens=4,
                                           extra_body={"retrieve": 2})
    assert response.choices[0].message.content == expected.text
    assert [s["id"] for s in response.model_extra["sources"]] == [c.id for c in chunks]
    assert response.model_extra["acceleration"]["accepted_tokens"]
