"""The OpenAI-compatible HTTP API over a `Server`: FastAPI routes, OpenAI's own response types.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET|HEAD /health   GET /metrics

Responses are built from the `openai` package's pydantic types, so their schema is OpenAI's, plus
two extension fields: `acceleration` (what speculation did: the engine's GenerationStats) and, when
the request asked the server to retrieve, `sources` (the chunks the answer was given). Errors have
OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 naming the field at fault, 401
without the API key the server was started with, 408 for a body that arrives too slowly, 413 for a
body over the size limit, 503 with Retry-After when the queue is full or the server shuts down, 500
for a failure of the server's own (on a connection left open for the client's next request).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...decoding.result import GenerationResult
from ...files.schema import too_deep
from ...retrieval.documents import Chunk
from ..tool_calls import MAX_NESTING, HeldText
from .admission import Unavailable
from .config import BODY_TIMEOUT_S, MAX_BODY_BYTES, SEND_TIMEOUT_S
from .protocol import FIELD_NAMES, ChatCompletionRequest, CompletionRequest, RequestError
from .server import Job, Server, finish_reason

# What a client refused for a full queue is told to wait before trying again.
RETRY_AFTER_S = 1
# The status a request whose client disconnected is counted under (nginx's); nobody reads it.
CLIENT_GONE = 499
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
# What answers without the API key: a load balancer's or orchestrator's liveness probe.
OPEN_PATHS = ("/health",)
T = TypeVar("T")
logger = logging.getLogger(__name__)


def create_app(
    server: Server, *, max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None,
    send_timeout_s: float = SEND_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
) -> FastAPI:  # fmt: skip
    """The API over `server`. With `api_key`, every endpoint but /health asks for it as a bearer
    token. A streamed answer whose client takes nothing for `send_timeout_s` is cut off; a body
    that has not arrived whole within `body_timeout_s` gets a 408. No /docs: it would be open."""
    app = FastAPI(title="rag-speculate", summary="OpenAI-compatible API with lossless speculative decoding",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, server=server, max_body_bytes=max_body_bytes, api_key=api_key, body_timeout_s=body_timeout_s)
    _error_handlers(app)

    # HEAD too: what load balancers' and uptime monitors' probes send.
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "ok", "model": server.name}

    @app.get("/v1/models")
    async def models() -> dict:
        model = Model(id=server.name, created=0, object="model", owned_by="rag-speculate")
        return {"object": "list", "data": [_plain(model)]}

    if server.metrics.backend == "prometheus":

        @app.get("/metrics")
        async def metrics() -> Response:
            server.metrics.prompt_cache(server.engine.prompt_cache.stats())
            server.metrics.engine(server.engine.stats())
            return Response(server.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, server, body, send_timeout_s)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, server, body, send_timeout_s)

    return app


async def _respond(request: Request, server: Server, body: ChatCompletionRequest | CompletionRequest, send_timeout_s: float) -> Response:
    """The whole answer once generated, or (with `stream`) its chunks as server-sent events. The
    request holds its place in the queue before any work is done for it, and a streamed one its turn
    on the engine before any byte is sent, so a full queue is a 503 for streams too."""
    job = await server.admit(body)
    try:
        await _unless_disconnected(request, server.start(job))
    except BaseException:
        job.ticket.release()
        raise
    reply = _Reply(server, body, job)
    if body.stream:
        return _EventStream(_events(reply.chunks(server.stream(job))), send_timeout_s, on_end=job.ticket.release)
    return JSONResponse(reply.whole(await _unless_disconnected(request, server.run(job))))


class _Reply:
    """The responses to one request, in OpenAI's types; one id and creation time for all its chunks."""

    def __init__(self, server: Server, body: ChatCompletionRequest | CompletionRequest, job: Job):
        self.server, self.body, self.job, self.model = server, body, job, server.name
        self.id, self.created = f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())

    def whole(self, result: GenerationResult) -> dict:
        return self.chat_completion(result) if self.job.chat else self.completion(result)

    def chunks(self, deltas: AsyncIterator) -> AsyncIterator[dict]:
        return self.chat_chunks(deltas) if self.job.chat else self.completion_chunks(deltas)

    def chat_completion(self, result: GenerationResult) -> dict:
        calls = self.server.tool_calls(self.job, result.text)
        message = {"role": "assistant", "content": result.text if calls is None else calls.content}
        if calls is not None:
            message["tool_calls"] = calls.calls
        choice = Choice(index=0, message=message, finish_reason=finish_reason(result, calls), logprobs=None)
        response = ChatCompletion(id=self.id, object="chat.completion", created=self.created, model=self.model,
                                  choices=[choice], usage=CompletionUsage(**result.stats.usage()))
        return self._extended(response, result)

    def completion(self, result: GenerationResult) -> dict:
        choice = CompletionChoice(index=0, text=result.text, finish_reason=finish_reason(result, None), logprobs=None)
        response = Completion(id=self.id, object="text_completion", created=self.created, model=self.model,
                              choices=[choice], usage=CompletionUsage(**result.stats.usage()))
        return self._extended(response, result)

    async def chat_chunks(self, deltas: AsyncIterator) -> AsyncIterator[dict]:
        yield _plain(self._chat_chunk(ChoiceDelta(role="assistant", content="")))
        held = HeldText() if self.job.prepared.tools else None
        async with contextlib.aclosing(deltas):
            async for item in deltas:
                if isinstance(item, str):
                    text = held.feed(item) if held else item
                    if text:
                        yield _plain(self._chat_chunk(ChoiceDelta(content=text)))
                    continue
                calls = self.server.tool_calls(self.job, item.text)
                if held is not None:
                    rest = held.finish(item.text if calls is None else calls.content or "")
                    if rest:
                        yield _plain(self._chat_chunk(ChoiceDelta(content=rest)))
                if calls is not None:
                    tool_deltas = [{"index": i, **call} for i, call in enumerate(calls.calls)]
                    yield _plain(self._chat_chunk(ChoiceDelta(tool_calls=tool_deltas)))
                yield self._extended(self._chat_chunk(ChoiceDelta(), finish_reason(item, calls)), item)
                if self.body.stream_options and self.body.stream_options.include_usage:
                    yield self._usage_chunk(ChatCompletionChunk, "chat.completion.chunk", item)

    async def completion_chunks(self, deltas: AsyncIterator) -> AsyncIterator[dict]:
        async with contextlib.aclosing(deltas):
            async for item in deltas:
                if isinstance(item, str):
                    yield _plain(self._completion_chunk(item, None))
                    continue
                yield self._extended(self._completion_chunk("", finish_reason(item, None)), item)
                if self.body.stream_options and self.body.stream_options.include_usage:
                    yield self._usage_chunk(Completion, "text_completion", item)

    def _chat_chunk(self, delta: ChoiceDelta, finish: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created, model=self.model,
                                   choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish, logprobs=None)])

    def _completion_chunk(self, text: str, finish: str | None) -> Completion:
        # OpenAI streams finish_reason null until the last chunk, which the type does not admit.
        choice = CompletionChoice.model_construct(index=0, text=text, finish_reason=finish, logprobs=None)
        return Completion(id=self.id, object="text_completion", created=self.created, model=self.model, choices=[choice])

    def _usage_chunk(self, kind: type, obj: str, result: GenerationResult) -> dict:
        """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
        return _plain(kind(id=self.id, object=obj, created=self.created, model=self.model, choices=[],
                           usage=CompletionUsage(**result.stats.usage())))

    def _extended(self, response: Any, result: GenerationResult) -> dict:
        out = _plain(response)
        out["acceleration"] = result.stats.as_dict()
        if self.job.prepared.sources:
            out["sources"] = [_source(c) for c in self.job.prepared.sources]
        return out


def _plain(response: Any) -> dict:
    """An OpenAI type as JSON-ready data: the fields set, no others (OpenAI's bodies leave unused ones out)."""
    return response.model_dump(mode="json", exclude_unset=True)


def _source(chunk: Chunk) -> dict:
    return {"id": chunk.id, "title": chunk.title, "text": chunk.text, "score": chunk.score}


async def _events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events of one streamed answer, ending with OpenAI's `[DONE]`; closing them closes
    `chunks`, which stops the generation."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield _event(json.dumps(chunk, ensure_ascii=False))
        except Exception as error:  # noqa: BLE001 - the response has begun: it can only be told in the stream
            logger.exception("generation failed mid-stream")
            yield _event(json.dumps(_error_body(str(error), None, 500)))
    yield _event("[DONE]")


def _event(data: str) -> str:
    return f"data: {data}\n\n"


class _SlowClient(Exception):
    """A send waited longer than the send timeout: the client is not reading."""


class _EventStream(StreamingResponse):
    """Server-sent events, each sent within `send_timeout_s` or the client is cut off: one that reads
    nothing cannot hold the engine. However the response ends (its last event sent, the client cut
    off or gone, or never started), its events are closed, which stops the generation, and `on_end`
    is called, which gives the engine to the next request."""

    def __init__(self, events: AsyncIterator[str], send_timeout_s: float, on_end: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self.send_timeout_s, self.on_end = send_timeout_s, on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed(message: Message) -> None:
            with anyio.move_on_after(self.send_timeout_s) as waited:
                await send(message)
            if waited.cancelled_caught:
                raise _SlowClient

        try:
            await super().__call__(scope, receive, timed)
        except _SlowClient:
            logger.warning("a client read nothing of its stream for %s s: it was cut off", self.send_timeout_s)
        finally:
            await self.body_iterator.aclose()
            self.on_end()


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (which stops its
    generation, or takes it out of the queue) and _ClientGone raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):  # let it leave the queue, or stop its generation
        await task
    raise _ClientGone


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message the server hands over is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- errors --------------------------------------------------------------------------------------

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error", 503: "server_overloaded", 500: "server_error"}


def _error_body(message: str, param: str | None, status: int, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def _error(message: str, param: str | None, status: int, code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(_error_body(message, param, status, code), status_code=status, headers=headers)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0]
        if error["type"] == "json_invalid":
            return _error(f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}", None, 400)
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, RequestError):
            return _error(str(cause), cause.param, 400, cause.code)
        # loc is ("body", field, index, ..., then the union member tried, e.g. "list[str]"): the
        # field's path, as OpenAI names nested fields ("messages.0.content").
        path = []
        for part in error["loc"][1:]:
            if not isinstance(part, int) and part not in FIELD_NAMES:
                break
            path.append(str(part))
        param = ".".join(path) or None
        detail = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            name = ".".join(map(str, error["loc"][1:]))
            return _error(f"unrecognized request argument supplied: {name}", name, 400, "unknown_parameter")
        if error["type"] == "missing":
            return _error(f"missing required field: {param}", param, 400)
        return _error(f"{param or 'body'}: {detail}", param, 400)

    @app.exception_handler(RequestError)
    async def refused(_: Request, exc: RequestError) -> JSONResponse:
        return _error(str(exc), exc.param, 400, exc.code)

    @app.exception_handler(Unavailable)
    async def overloaded(_: Request, exc: Unavailable) -> JSONResponse:
        return _error(f"{exc}; retry later", None, 503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(_ClientGone)
    async def gone(_: Request, exc: _ClientGone) -> Response:
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return _error(str(exc.detail), None, exc.status_code)


class _Guard:
    """ASGI middleware, before anything parses a request: refuses one without the API key (401), a
    body that arrives too slowly (408), one over the size limit (413), one that is not UTF-8 and one
    nested too deep for the parser and the chat templates (400, naming the field); answers what
    fails after it with a 500 in OpenAI's shape; counts every answer in the metrics by endpoint and
    status."""

    def __init__(self, app: ASGIApp, server: Server, max_body_bytes: int, api_key: str | None, body_timeout_s: float):
        self.app, self.server, self.limit, self.body_timeout_s = app, server, max_body_bytes, body_timeout_s
        self.authorization = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, started = 500, False

        async def counted(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            refusal = self._unauthorized(scope)
            if refusal is None:
                try:
                    async with asyncio.timeout(self.body_timeout_s):
                        body = await self._body(scope, receive)
                except TimeoutError:
                    refusal = _error(f"the request body did not arrive within {self.body_timeout_s} s", None, 408, "request_timeout")
                else:
                    refusal = await self._refused(body)
            if refusal is not None:
                return await refusal(scope, receive, counted)
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if replayed:  # after the body, the connection's own messages (a disconnect)
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            try:
                await self.app(scope, replay, counted)
            except Exception:
                if started:  # the answer has begun: only closing the connection can end it
                    raise
                # A 500 in OpenAI's shape, sent here rather than by Starlette, which would then close
                # the connection under the client's next request.
                logger.exception("a request failed")
                failed = _error("the server failed to answer this request; the failure is logged", None, 500)
                await failed(scope, replay, counted)
        finally:
            path = scope["path"]
            self.server.metrics.request(path if path in ENDPOINTS else "other", status)

    def _unauthorized(self, scope: Scope) -> Response | None:
        if self.authorization is None or scope["path"] in OPEN_PATHS:
            return None
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.authorization):  # in constant time: no guessing it byte by byte
            return None
        response = _error("a valid API key is required: send it as Authorization: Bearer KEY", None, 401, "invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    async def _refused(self, body: bytes | None) -> Response | None:
        if body is None:
            return _error(f"the request body is over the {self.limit}-byte limit", None, 413, "request_too_large")
        return await asyncio.to_thread(_unreadable, body)

    async def _body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None once it is over the limit."""
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return None
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return None
            if not message.get("more_body"):
                return b"".join(parts)


def _unreadable(body: bytes) -> Response | None:
    """A 400 for a body that is not UTF-8 (JSON's only encoding between systems) or that nests too deep
    for the parser and the chat templates, naming the field."""
    try:
        body.decode()
    except UnicodeDecodeError as error:
        return _error(f"the body is not valid UTF-8 text ({error.reason} at byte {error.start})", None, 400)
    path = too_deep(body, MAX_NESTING)
    if path is None:
        return None
    # The field as OpenAI names it ("messages.0.tool_calls"): the path up to its last request field.
    end = next((i for i, part in enumerate(path) if isinstance(part, str) and part not in FIELD_NAMES), len(path))
    while end and isinstance(path[end - 1], int):
        end -= 1
    field = ".".join(map(str, path[:end])) or None
    return _error(f"{field or 'the body'} is nested more than {MAX_NESTING} levels deep", field, 400)
