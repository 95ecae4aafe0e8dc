"""From an OpenAI request to a generation and back: what the HTTP layer (`app.py`) calls.

A request is checked and tokenized when it arrives (`chat_job`, `completion_job`: a bad one is
refused at once, naming its field), then waits for the engine in the bounded queue (`admission.py`)
and runs there (`run`, `stream`); leaving early, as a client that disconnects does, stops the
generation at its next step and frees the engine for the next request.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from ..decoding.engine import SpeculativeEngine
from ..decoding.instructions import chosen_tool, json_instruction, template_tools, with_instructions
from ..decoding.request import Request
from ..decoding.result import GenerationResult
from ..decoding.tool_calls import call_id_prefix, check_tools, parse_tool_calls, tool_documents
from ..errors import InvalidArgumentError
from ..retrieval.corpus import CorpusIndex
from ..retrieval.documents import Chunk
from ..retrieval.rag import drafting_documents, rag_messages
from ..serving import acollect, aiterate
from .admission import Admission
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest

# Where the model states no position limit, a request that names no max_tokens gets this many.
FALLBACK_MAX_TOKENS = 1024


class RequestError(ValueError):
    """A request the server refuses (HTTP 400); `param` names the field at fault, as OpenAI's errors do."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class Job:
    """One request, checked and tokenized, waiting to run."""

    request: Request
    chat: bool
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict] | None = None
    sources: list[Chunk] = field(default_factory=list)
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
        self.admission = Admission(max_running=1, max_queued=max_queued, observe=self.metrics.queue)

    # --- requests in ---------------------------------------------------------------------

    def chat_job(self, body: ChatCompletionRequest) -> Job:
        self._check_model(body.model)
        messages = _as_param("messages", lambda: [m.template_message() for m in body.messages])
        offered = _as_param("tools", check_tools, body.tools) if body.tools is not None else []
        tools, call_instruction = template_tools(offered, _as_param("tool_choice", chosen_tool, body.tool_choice, offered))
        json_answer = _as_param("response_format", json_instruction, body.response_format)
        documents: list[str | list[int]] = list(body.documents or [])
        sources: list[Chunk] = []
        if body.retrieve:
            messages, sources = self._retrieve(messages, body.retrieve)
            documents += drafting_documents(sources)
        messages = with_instructions(messages, system=json_answer, last=call_instruction)
        prompt_ids = _as_param(None, self.engine.encode_prompt, messages, chat=True, tools=tools)
        documents += tool_documents(tools, messages)
        request = self._request(prompt_ids, documents, body.max_new_tokens, body)
        return Job(request, chat=True, messages=messages, tools=tools, sources=sources)

    def completion_job(self, body: CompletionRequest) -> Job:
        self._check_model(body.model)
        prompt_ids = _as_param(None, self.engine.encode_prompt, body.prompt)
        return Job(self._request(prompt_ids, list(body.documents or []), body.max_new_tokens, body), chat=False)

    def _check_model(self, model: str) -> None:
        # Only ever compared, never opened: a request cannot make the server load anything.
        if model != self.name:
            raise RequestError("model", f"model {model!r} is not served here; this server serves {self.name!r}")

    def _retrieve(self, messages: list[dict], k: int) -> tuple[list[dict], list[Chunk]]:
        """The conversation with the last user turn asking over the index's `k` best chunks for it."""
        if self.index is None:
            raise RequestError("retrieve", "this server has no index to retrieve from: start it with --index DIR")
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise RequestError("messages", "retrieve needs a user message to retrieve for")
        last = users[-1]
        question = messages[last]["content"]
        chunks = _as_param("messages", self.index.search, question, k)
        system, user = rag_messages(question, chunks)
        messages = [*messages[:last], {**messages[last], "content": user["content"]}, *messages[last + 1 :]]
        if messages[0]["role"] != "system":
            messages.insert(0, system)
        return messages, chunks

    def _request(self, prompt_ids: list[int], documents: list, max_tokens: int | None, body: Any) -> Request:
        limit = self.engine.max_positions
        if max_tokens is None:
            max_tokens = limit - len(prompt_ids) if limit else FALLBACK_MAX_TOKENS
            if max_tokens < 1:
                raise RequestError("messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                                   f"the prompt is {len(prompt_ids)} tokens; the model's limit is {limit}")
        options = dict(documents=documents, max_new_tokens=max_tokens, temperature=body.temperature,
                       top_p=body.top_p, top_k=max(body.top_k, 0), stop=body.stop, seed=body.seed)
        return _as_param(None, self.engine.prepare, prompt_ids, **options)

    # --- generations out -----------------------------------------------------------------

    async def run(self, job: Job) -> GenerationResult:
        """The whole generation, once the engine is free; cancelling the caller stops it."""
        async with self._slot(job):
            result = await acollect(self.engine.stream_request(job.request))
        self._finished(job, result)
        return result

    async def stream(self, job: Job) -> AsyncIterator[str | GenerationResult]:
        """Text deltas as the engine accepts them, then the GenerationResult."""
        async with self._slot(job):
            stream = self.engine.stream_request(job.request)
            async for delta in aiterate(stream):
                yield delta
        self._finished(job, stream.result)
        yield stream.result

    @asynccontextmanager
    async def _slot(self, job: Job) -> AsyncIterator[None]:
        async with self.admission.slot():
            job.started = time.perf_counter()
            yield

    def _finished(self, job: Job, result: GenerationResult) -> None:
        now = time.perf_counter()
        self.metrics.finished(result.stats, now - job.arrived, job.started - job.arrived + result.stats.time_to_first_token_s)

    def tool_calls(self, job: Job, text: str) -> ToolCallsRead | None:
        """The calls an answer makes, in OpenAI's shape (None when the request gave no tools or none
        was called); a malformed call stays in the content, as text."""
        if not job.tools:
            return None
        parsed = parse_tool_calls(text)
        if not parsed.calls:
            return None
        prefix = call_id_prefix(job.messages, text)
        calls = [
            {"id": f"{prefix}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for i, c in enumerate(parsed.calls)
        ]
        return ToolCallsRead(parsed.content or None, calls)


# The engine names its own arguments in its errors: those a request can still get wrong once its
# fields have been checked, and the request field each comes from, in the order they are looked for.
_ENGINE_PARAMS = (("max_new_tokens", "max_tokens"), ("tools", "tools"), ("documents", "documents"),
                  ("stop", "stop"), ("message", "messages"), ("prompt", "prompt"))


def _as_param(param: str | None, check: Any, *args: Any, **kwargs: Any) -> Any:
    """`check(*args, **kwargs)`, its InvalidArgumentError as a RequestError naming `param`, or, for
    `param=None` (a call into the engine), the field the engine's message names."""
    try:
        return check(*args, **kwargs)
    except InvalidArgumentError as error:
        message = str(error)
        if param is None:
            param = next((field for word, field in _ENGINE_PARAMS if word in message), None)
        raise RequestError(param, message.replace("max_new_tokens", "max_tokens")) from None


def finish_reason(result: GenerationResult, calls: ToolCallsRead | None) -> str:
    """OpenAI's name for why the answer ended."""
    if calls is not None:
        return "tool_calls"
    return "length" if result.finish_reason == "length" else "stop"
