"""From an OpenAI request to a generation and back: what the HTTP layer (`app.py`) calls.

A request takes its place in the bounded queue (`admission.py`) as it arrives, then is checked and
tokenized (`admit`: a bad one is refused at once, naming its field), waits for the engine (`start`)
and runs there (`run`, `stream`); leaving early, as a client that disconnects does, stops the
generation at its next step and frees the engine for the next request. `shut_down` refuses new
and waiting requests and stops the running ones after a grace period.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from ...decoding.result import GenerationResult, GenerationStream
from ...engine import SpeculativeEngine
from ...errors import InvalidArgumentError
from ...retrieval.corpus import CorpusIndex
from ..prompt import Prepared, prepare
from ..tool_calls import call_id_prefix, parse_tool_calls
from .admission import Admission, Ticket, Unavailable
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError

# Where the model states no position limit, a request that names no max_tokens gets this many.
FALLBACK_MAX_TOKENS = 1024
# The request field each engine argument comes from (a chat's prompt is its messages); the answer's
# token bound is checked against the model's limit here, in the request's own terms (`_answer_tokens`).
_FIELDS = {"prompt": "prompt", "messages": "messages", "documents": "documents",
           "tools": "tools", "tool_choice": "tool_choice", "response_format": "response_format", "stop": "stop",
           "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"}
# OpenAI's finish_reason has no value for an answer the server stopped as it shut down: this one says so.
SHUTDOWN = "shutdown"
logger = logging.getLogger(__name__)


@dataclass
class Job:
    """One request, checked and tokenized, waiting to run."""

    prepared: Prepared
    chat: bool
    ticket: Ticket | None = None  # its place in the queue
    arrived: float = field(default_factory=time.perf_counter)
    started: float = 0.0


@dataclass
class ToolCallsRead:
    content: str | None
    calls: list[dict[str, Any]]


class Server:
    """One engine (and optionally a corpus index) behind an OpenAI-compatible API."""

    def __init__(
        self, engine: SpeculativeEngine, name: str, index: CorpusIndex | None = None, *,
        max_queued: int = 16, metrics: Metrics | None = None,
    ):
        self.engine, self.name, self.index = engine, name, index
        self.metrics = metrics or Metrics()
        # As many run at once as the engine batches: a server's throughput is its batch.
        self.admission = Admission(max_running=engine.max_batch, max_queued=max_queued, observe=self.metrics.queue)
        self._generations: set[GenerationStream] = set()
        self._stopped = False

    # --- requests in ---------------------------------------------------------------------

    async def admit(self, body: ChatCompletionRequest | CompletionRequest) -> Job:
        """The request's place in the queue (Unavailable at once if there is none, before any work),
        then the request checked and tokenized off the event loop (RequestError naming the field)."""
        ticket = self.admission.enter()
        try:
            make = self.chat_job if isinstance(body, ChatCompletionRequest) else self.completion_job
            job = await asyncio.to_thread(make, body)
        except BaseException:
            ticket.release()
            raise
        job.ticket = ticket
        return job

    def chat_job(self, body: ChatCompletionRequest) -> Job:
        self._check_model(body.model)
        messages = _as_param(None, lambda: [m.template_message(f"messages.{i}") for i, m in enumerate(body.messages)])
        chunks = self._retrieve(messages, body.retrieve) if body.retrieve else []
        prepared = self._prepare(
            messages, body, chat=True, chunks=chunks, tools=body.tools, tool_choice=body.tool_choice,
            response_format=body.response_format,
        )  # fmt: skip
        return Job(prepared, chat=True)

    def completion_job(self, body: CompletionRequest) -> Job:
        self._check_model(body.model)
        return Job(self._prepare(body.prompt, body, chat=False), chat=False)

    def _check_model(self, model: str) -> None:
        # Only ever compared, never opened: a request cannot make the server load anything.
        if model != self.name:
            raise RequestError("model", f"model {model!r} is not served here; this server serves {self.name!r}")

    def _retrieve(self, messages: list[dict], k: int) -> list:
        """The index's `k` best chunks for the last user turn."""
        if self.index is None:
            raise RequestError("retrieve", "this server has no index to retrieve from: start it with --index DIR")
        users = [m for m in messages if m["role"] == "user"]
        if not users:
            raise RequestError("messages", "retrieve needs a user message to retrieve for")
        return _as_param("messages", self.index.search, users[-1]["content"], k)

    def _prepare(self, prompt: Any, body: ChatCompletionRequest | CompletionRequest, *, chat: bool, **extra: Any) -> Prepared:
        options = dict(documents=list(body.documents or []), temperature=body.temperature, top_p=body.top_p,
                       top_k=max(body.top_k, 0), stop=body.stop, seed=body.seed)
        max_new_tokens = self._answer_tokens(body, "messages" if chat else "prompt")
        return _as_param(None, prepare, self.engine, prompt, chat=chat, max_new_tokens=max_new_tokens, **options, **extra)

    def _answer_tokens(self, body: ChatCompletionRequest | CompletionRequest, prompt_field: str) -> int | Callable[[int], int]:
        """The answer's token bound, in the request's own terms: where the model has a position limit,
        a function of the prompt's length that checks the bound asked for fits beside the prompt, or,
        when none was asked for, gives as many as the limit leaves after it."""
        field_, asked = body.answer_limit
        limit = self.engine.traits.max_positions
        if limit is None:
            return asked or FALLBACK_MAX_TOKENS

        def within_limit(prompt_tokens: int) -> int:
            room = limit - prompt_tokens
            if asked is None:
                if room < 1:
                    raise RequestError(prompt_field, f"the prompt is {prompt_tokens} tokens, and the model's limit is "
                                                     f"{limit} in all: no room is left for an answer")
                return room
            if asked > room:
                raise RequestError(field_, f"{field_}={asked} and the prompt's {prompt_tokens} tokens add up to "
                                           f"{prompt_tokens + asked}, over the model's limit of {limit}")
            return asked

        return within_limit

    # --- generations out -----------------------------------------------------------------

    async def start(self, job: Job) -> None:
        """Wait for the engine (Unavailable if the server shuts down first); from here the job holds it
        until `run` or `stream` ends, or its ticket is released."""
        await job.ticket.start()
        job.started = time.perf_counter()

    async def run(self, job: Job) -> GenerationResult:
        """The whole generation of a started job; cancelling the caller stops it."""
        with self._generation(job) as stream:
            result = await stream.acollect()
        if result.finish_reason == "cancelled":  # only `shut_down` stops a generation someone still reads
            raise Unavailable("the server is shutting down: the answer was stopped before its end")
        self._finished(job, result)
        return result

    async def stream(self, job: Job) -> AsyncIterator[str | GenerationResult]:
        """Text deltas of a started job as the engine accepts them, then the GenerationResult (its
        finish_reason "cancelled" where the server stopped it to shut down)."""
        with self._generation(job) as stream:
            async for delta in stream:
                yield delta
        self._finished(job, stream.result)
        yield stream.result

    @contextmanager
    def _generation(self, job: Job) -> Iterator[GenerationStream]:
        """The job's generation, stopped by `shut_down` at its deadline; as the block ends it is stopped
        if the reader left early, and the engine goes to the next request."""
        with ExitStack() as cleanup:
            cleanup.callback(job.ticket.release)
            stream = self.engine.stream_request(job.prepared.request)
            cleanup.callback(stream.close)
            self._generations.add(stream)
            cleanup.callback(self._generations.discard, stream)
            if self._stopped:
                stream.close()
            yield stream

    def shut_down(self, timeout_s: float) -> None:
        """Refuse new and waiting requests from now on; stop the running generations after `timeout_s`
        unless they end first. Called on the event loop."""
        logger.warning("shutting down: refusing new requests; running ones get %s s to finish", timeout_s)
        self.admission.close()
        asyncio.get_running_loop().call_later(timeout_s, self._stop)

    def _stop(self) -> None:
        self._stopped = True
        for stream in list(self._generations):
            stream.close()

    def _finished(self, job: Job, result: GenerationResult) -> None:
        now = time.perf_counter()
        self.metrics.finished(result.stats, now - job.arrived, job.started - job.arrived + result.stats.time_to_first_token_s)
        self.metrics.prompt_cache(self.engine.prompt_cache.stats())
        self.metrics.engine(self.engine.stats())

    def tool_calls(self, job: Job, text: str) -> ToolCallsRead | None:
        """The calls an answer makes, in OpenAI's shape (None when the request gave no tools or none
        was called); a malformed call stays in the content, as text."""
        if not job.prepared.tools:
            return None
        parsed = parse_tool_calls(text)
        if not parsed.calls:
            return None
        prefix = call_id_prefix(job.prepared.messages, text)
        calls = [
            {"id": f"{prefix}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for i, c in enumerate(parsed.calls)
        ]
        return ToolCallsRead(parsed.content or None, calls)


def _as_param(param: str | None, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`check(*args, **kwargs)`, its InvalidArgumentError as a RequestError naming `param`, or, for
    `param=None` (a call into the engine), the request field the error's argument comes from (a place
    inside a field, "messages.1.tool_calls.0.function.arguments", named whole)."""
    try:
        return check(*args, **kwargs)
    except InvalidArgumentError as error:
        head, dot, inside = (error.argument or "").partition(".")
        field_ = param or (_FIELDS[head] + dot + inside if head in _FIELDS else None)
        if field_ == "prompt" and kwargs.get("chat"):
            field_ = "messages"
        raise RequestError(field_, str(error)) from None


def finish_reason(result: GenerationResult, calls: ToolCallsRead | None) -> str:
    """OpenAI's name for why the answer ended."""
    if calls is not None:
        return "tool_calls"
    return {"length": "length", "cancelled": SHUTDOWN}.get(result.finish_reason, "stop")
