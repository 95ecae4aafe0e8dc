"""Bodies no well-behaved client sends, on 127.0.0.1: text that is not valid Unicode (a lone surrogate,
which JSON's \\ud800 escape writes) in any field, NUL, NaN, deep nesting, values of any JSON type, and
bytes that are not UTF-8.
Each gets a 400 in OpenAI's error shape naming the field, never a 500, and the connection it came on
serves the client's next request."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaged_fixtures import MODEL

from rag_speculate.entrypoints.openai.background import running as serving

pytest.importorskip("fastapi")

CALL = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "Eiffel"}'}}
# A chat that reaches the engine with every kind of field set (a 200, answered in one token): each test
# breaks one of them.
CHAT = {
    "model": MODEL, "max_tokens": 1, "temperature": 0,
    "messages": [{"role": "system", "content": "Be brief.", "name": "rules"},
                 {"role": "user", "content": "Who built it?"},
                 {"role": "assistant", "content": None, "tool_calls": [CALL]},
                 {"role": "tool", "tool_call_id": "c1", "content": "Gustave Eiffel's company."}],
    "stop": ["\n\n"], "documents": ["The Eiffel Tower was built by Gustave Eiffel's company."],
    "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}},
    "metadata": {"team": "docs"}, "user": "u1",
}  # fmt: skip
COMPLETION = {"model": MODEL, "prompt": "The Eiffel Tower is in", "max_tokens": 1, "stop": ["\n"],
              "documents": ["Paris."]}
ARGUMENTS = ("messages", 2, "tool_calls", 0, "function", "arguments")


@pytest.fixture(scope="module")
def base_url():
    from rag_speculate.entrypoints.engines import shared_engine
    from rag_speculate.entrypoints.openai import Server
    from rag_speculate.entrypoints.openai.app import create_app

    engine = shared_engine(MODEL, dtype="float32", device="cpu", draft_budget=None)
    with serving(create_app(Server(engine, MODEL))) as url:
        yield url


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=120) as client:
        yield client


def changed(body: dict, path: tuple, value: Any) -> dict:
    """A deep copy of `body` with the value at `path` replaced."""
    copy = json.loads(json.dumps(body))
    *parents, last = path
    place = copy
    for key in parents:
        place = place[key]
    place[last] = value
    return copy


def post(client: httpx.Client, url: str, body: Any) -> httpx.Response:
    # json.dumps writes a lone surrogate as its \ud800 escape, and NaN as NaN, which Python's parser reads.
    return client.post(url, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def refusal(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def test_the_bodies_broken_below_are_answered_whole(base_url, client):
    assert post(client, f"{base_url}/chat/completions", CHAT).status_code == 200
    assert post(client, f"{base_url}/completions", COMPLETION).status_code == 200


def test_lone_surrogate_in_tool_call_arguments_is_a_400_naming_it(base_url, client):
    field = "messages.2.tool_calls.0.function.arguments"
    # In the arguments' text itself, and written by an escape in the JSON they hold: named by where it
    # is in what was parsed.
    for arguments, where in [('{"query": "\ud800"}', "(surrogates not allowed at position 11)"),
                             ('{"query": ["\\ud800"]}', "at query.0 (surrogates not allowed at position 0)")]:
        error = refusal(post(client, f"{base_url}/chat/completions", changed(CHAT, ARGUMENTS, arguments)))
        assert error["param"] == field and error["message"] == f"{field} is not valid Unicode text {where}"
    # The connection that carried them serves the next request.
    assert post(client, f"{base_url}/chat/completions", CHAT).status_code == 200


def test_lone_surrogate_in_a_response_format_schema_is_a_400_naming_response_format(base_url, client):
    body = changed(CHAT, ("response_format", "json_schema", "schema"), {"type": "object", "description": "x\udc00"})
    error = refusal(post(client, f"{base_url}/chat/completions", body))
    assert error["param"] == "response_format.json_schema.schema.description"


TEXT_FIELDS = [
    ("model",), ("messages", 1, "content"), ("messages", 0, "name"), ("messages", 3, "tool_call_id"),
    ("messages", 2, "tool_calls", 0, "id"), ("messages", 2, "tool_calls", 0, "function", "name"), ("stop", 0),
    ("documents", 0), ("user",), ("metadata", "team"), ("tool_choice",),
]


@pytest.mark.parametrize("path", TEXT_FIELDS, ids=[".".join(map(str, p)) for p in TEXT_FIELDS])
def test_lone_surrogate_in_any_text_field_is_a_400_naming_it(base_url, client, path):
    error = refusal(post(client, f"{base_url}/chat/completions", changed(CHAT, path, "ok \ud83d then")))
    param = ".".join(map(str, path))
    assert error["param"] == param
    assert error["message"] == f"{param} is not valid Unicode text (surrogates not allowed at position 3)"


def test_lone_surrogate_in_a_key_or_a_tool_is_a_400_naming_where(base_url, client):
    parameters = {"type": "object", "properties": {"q\udfff": {}}}
    tools = [{"type": "function", "function": {"name": "search", "parameters": parameters}}]
    error = refusal(post(client, f"{base_url}/chat/completions", changed(CHAT, ("tools",), tools)))
    assert error["param"] == "tools.0.function.parameters.properties.q\\udfff"
    assert error["message"].endswith("(surrogates not allowed at position 1 of the key)")
    error = refusal(post(client, f"{base_url}/completions", changed(COMPLETION, ("prompt",), ["\udfff"])))
    assert error["param"] == "prompt.0"


@pytest.mark.parametrize(("body", "reason"), [
    (b'{"model": "\xff"}', "invalid start byte at byte 11"),
    # A surrogate's own bytes (CESU-8), which strict UTF-8 refuses, and a body in UTF-16.
    (b'{"model": "\xed\xa0\x80"}', "invalid continuation byte at byte 11"),
    (json.dumps(CHAT).encode("utf-16"), "invalid start byte at byte 0"),
], ids=["a stray byte", "a surrogate's bytes", "UTF-16"])  # fmt: skip
def test_a_body_that_is_not_utf8_is_a_400_saying_so(base_url, client, body, reason):
    response = client.post(f"{base_url}/chat/completions", content=body, headers={"content-type": "application/json"})
    error = refusal(response)
    assert error["param"] is None and error["message"] == f"the body is not valid UTF-8 text ({reason})"
    after = post(client, f"{base_url}/completions", COMPLETION)
    assert after.status_code == 200 and _local_port(after) == _local_port(response)


def test_an_unexpected_failure_is_a_500_in_openais_shape_on_a_connection_left_open():
    """Whatever fails in a route is answered by the server's guard, which keeps the connection: the
    route here is added to the real app for the test, as a failure no request should find."""
    from rag_speculate.entrypoints.engines import shared_engine
    from rag_speculate.entrypoints.openai import Server
    from rag_speculate.entrypoints.openai.app import create_app

    app = create_app(Server(shared_engine(MODEL, dtype="float32", device="cpu", draft_budget=None), MODEL))

    @app.get("/v1/failing")
    async def failing() -> dict:
        raise RuntimeError("a bug")

    with serving(app) as url, httpx.Client(timeout=60) as client:
        failed = client.get(f"{url}/failing")
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        after = client.get(f"{url}/models")
        assert after.status_code == 200 and _local_port(after) == _local_port(failed)


def _local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


# --- any field, any value ------------------------------------------------------------------------

LONE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXT = st.text(st.one_of(st.characters(), LONE, st.just("\x00")), max_size=6)
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), TEXT)
JSON_VALUE = st.recursive(
    SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8
)
DEEP = st.integers(60, 300).map(lambda levels: json.loads("[" * levels + "]" * levels))
# Text holding JSON: what a tool call's arguments are, and what a field of text may be sent.
JSON_TEXT = JSON_VALUE.map(json.dumps)
HOSTILE = st.one_of(JSON_VALUE, DEEP, JSON_TEXT, st.just("\x00"), st.just(float("nan")))
CHAT_PATHS = [
    ("model",), ("messages",), ("messages", 1), ("messages", 1, "content"), ("messages", 1, "role"),
    ("messages", 0, "name"), ("messages", 2, "content"), ("messages", 2, "tool_calls"),
    ("messages", 2, "tool_calls", 0),
    ("messages", 2, "tool_calls", 0, "id"), ("messages", 2, "tool_calls", 0, "function"),
    ("messages", 2, "tool_calls", 0, "function", "name"), ARGUMENTS, ("messages", 3, "tool_call_id"), ("tools",),
    ("tool_choice",), ("response_format",), ("response_format", "type"), ("response_format", "json_schema"),
    ("response_format", "json_schema", "schema"), ("stop",), ("stop", 0), ("documents",), ("documents", 0),
    ("temperature",), ("top_p",), ("top_k",), ("seed",), ("n",), ("logprobs",), ("logit_bias",), ("metadata",),
    ("stream",), ("stream_options",), ("retrieve",),
]
COMPLETION_PATHS = [("prompt",), ("model",), ("stop",), ("documents",), ("echo",), ("suffix",), ("seed",)]
UNKNOWN = TEXT.filter(lambda key: key not in CHAT).map(lambda key: (key,))
BOUNDS = st.sampled_from([("max_tokens",), ("max_completion_tokens",)])
CHANGES = st.one_of(
    st.tuples(st.just("chat/completions"), st.just(CHAT), st.sampled_from(CHAT_PATHS), HOSTILE),
    st.tuples(st.just("completions"), st.just(COMPLETION), st.sampled_from(COMPLETION_PATHS), HOSTILE),
    # A field no request has, named anything; and the answer's bounds, never null, which would answer at length.
    st.tuples(st.just("chat/completions"), st.just(CHAT), UNKNOWN, HOSTILE),
    st.tuples(st.just("chat/completions"), st.just(CHAT), BOUNDS, HOSTILE.filter(lambda value: value is not None)),
)


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(change=CHANGES)
def test_no_body_gets_a_500_and_its_connection_serves_the_next_request(base_url, client, change):
    endpoint, body, path, value = change
    if path[0] in ("max_tokens", "max_completion_tokens") and type(value) is int and 1 < value:
        value = 1  # a valid bound: answered in one token, not thousands
    response = post(client, f"{base_url}/{endpoint}", changed(body, path, value))
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
    after = post(client, f"{base_url}/completions", COMPLETION)
    assert after.status_code == 200 and _local_port(after) == _local_port(response)


# No digits: spliced into max_tokens, they would ask for a long answer.
JUNK = st.binary(min_size=1, max_size=8).filter(lambda junk: not set(junk) & set(b"0123456789"))


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), junk=JUNK)
def test_bytes_spliced_into_a_body_never_get_a_500_and_leave_its_connection_open(base_url, client, data, junk):
    text = json.dumps(CHAT).encode()
    at = data.draw(st.integers(0, len(text)))
    response = client.post(f"{base_url}/chat/completions", content=text[:at] + junk + text[at:],
                           headers={"content-type": "application/json"})
    assert response.status_code in (200, 400), response.text
    after = post(client, f"{base_url}/completions", COMPLETION)
    assert after.status_code == 200 and _local_port(after) == _local_port(response)
