"""What a generation returns: the text, the new token ids, why it ended, and what acceleration did."""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    # Of them, those whose KV entries came from the prompt cache rather than the prefill, and of
    # those, the ones its disk tier supplied (the rest came from memory).
    cached_prompt_tokens: int = 0
    disk_cached_prompt_tokens: int = 0
    new_tokens: int = 0
    # Prefill included: plain decoding needs exactly `new_tokens` of them.
    target_forwards: int = 0
    # Tokens this generation fed to each decode forward (the draft nodes verified + 1) -> how many
    # forwards: on a CPU a forward's cost grows with them, so this with the cost curve explains decode_s.
    forward_sizes: Counter = field(default_factory=Counter)
    # Generations each of its decode forwards verified together -> how many, and the tokens the
    # whole forward fed (every row's, padding included) -> how many.
    batch_sizes: Counter = field(default_factory=Counter)
    step_tokens: Counter = field(default_factory=Counter)
    drafted_tokens: Counter = field(default_factory=Counter)
    accepted_tokens: Counter = field(default_factory=Counter)
    # Seconds it waited for room before it started, and from its request to its first token.
    queue_s: float = 0.0
    time_to_first_token_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # The drafters' preparation before the prefill (indexing documents, a draft model's own
    # prefill), then their proposing and learning during decode (part of decode_s).
    draft_setup_s: float = 0.0
    drafting_s: float = 0.0
    # "tree": one forward verifies the whole draft tree; "chain": only its longest branch.
    verification: str = "tree"

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding: the part speculation accelerates."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out["forward_sizes"] = dict(self.forward_sizes)
        out["batch_sizes"] = dict(self.batch_sizes)
        out["step_tokens"] = dict(self.step_tokens)
        out["drafted_tokens"] = dict(self.drafted_tokens)
        out["accepted_tokens"] = dict(self.accepted_tokens)
        out["tokens_per_forward"] = self.tokens_per_forward
        out["decode_tokens_per_s"] = self.decode_tokens_per_s
        return out

    def usage(self) -> dict:
        """OpenAI-style usage: the prompt's tokens read from the prompt cache, either tier, are its `cached_tokens`."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.new_tokens,
            "total_tokens": self.prompt_tokens + self.new_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_prompt_tokens},
        }


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop" or "length"
    stats: GenerationStats


_DELTA, _DONE, _ERROR = object(), object(), object()


class Channel:
    """Where a generation hands its deltas, its result or its error to the stream reading them.

    The engine's thread writes, any thread or event loop reads: the writer never waits on the reader,
    so a stream read slowly or not at all still lets the engine go on. A reader in an event loop
    waits on a future the writer resolves, so no thread blocks for it.
    """

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None

    def delta(self, text: str) -> None:
        self._put(_DELTA, text)

    def finish(self, result: GenerationResult) -> None:
        self._put(_DONE, result)

    def fail(self, error: BaseException) -> None:
        self._put(_ERROR, error)

    def _put(self, kind: object, value: Any) -> None:
        self._items.put((kind, value))
        with self._lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, future = waiter
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # the reader's loop has closed: nobody is listening any more
                self.cancelled.set()

    def get(self) -> tuple[object, Any]:
        return self._items.get()

    async def get_async(self) -> tuple[object, Any]:
        while True:
            try:
                return self._items.get_nowait()
            except queue.Empty:
                pass
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            with self._lock:
                self._waiter = (loop, future)
            # An item put before the waiter was registered found none to wake: look once more.
            if not self._items.empty():
                with self._lock:
                    self._waiter = None
                continue
            await future


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class GenerationStream(Iterator[str]):
    """Text deltas as tokens are accepted, by `for` or `async for`; `result` once the iteration has
    finished (`collect()` and `acollect()` run it to the end and return it).

    The generation runs on the engine's thread, which never waits on the reader: a stream read slowly,
    from another thread or event loop, or not at all, still finishes and frees the engine. `close()`,
    dropping the stream, or leaving an `async for` early stops the generation at its next step.
    """

    def __init__(self, channel: Channel):
        self._channel = channel
        self._result: GenerationResult | None = None
        self._finished = False
        # The generation holds the channel, never the stream, so dropping the stream is seen here.
        weakref.finalize(self, channel.cancelled.set)

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        value = self._take(*self._channel.get())
        if value is None:
            raise StopIteration
        return value

    async def __aiter__(self) -> AsyncIterator[str]:
        # An async generator: leaving the loop early (break, an error, a cancelled task) closes it,
        # which stops the generation.
        try:
            while not self._finished:
                value = self._take(*await self._channel.get_async())
                if value is not None:
                    yield value
        finally:
            if not self._finished:
                self.close()

    def _take(self, kind: object, value: Any) -> str | None:
        """A delta's text, or None once the generation ended (its error raised here)."""
        if kind is _DELTA:
            return value
        self._finished = True
        if kind is _ERROR:
            raise value
        self._result = value
        return None

    def close(self) -> None:
        """Stop generating early: the engine is free for the next caller after the current step."""
        self._channel.cancelled.set()

    def collect(self) -> GenerationResult:
        """Run the stream to its end and return its result."""
        for _ in self:
            pass
        return self.result

    async def acollect(self) -> GenerationResult:
        """`collect` without blocking the event loop; cancelling the caller stops the generation."""
        async for _ in self:
            pass
        return self.result

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished: iterate it to the end first")
        return self._result
