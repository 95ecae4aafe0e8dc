"""What a generation returns: the text, the new token ids, why it ended, and what acceleration did."""

from __future__ import annotations

from collections import Counter
import queue
import threading
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    # Of them, those whose KV entries came from the prompt cache rather than the prefill.
    cached_prompt_tokens: int = 0
    new_tokens: int = 0
    # Prefill included: plain decoding needs exactly `new_tokens` of them.
    target_forwards: int = 0
    # Tokens fed to each decode forward (the draft nodes verified + 1) -> how many forwards: on a
    # CPU a forward's cost grows with them, so this with the cost curve explains decode_s.
    forward_sizes: Counter = field(default_factory=Counter)
    drafted_tokens: Counter = field(default_factory=Counter)
    accepted_tokens: Counter = field(default_factory=Counter)
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
        out["drafted_tokens"] = dict(self.drafted_tokens)
        out["accepted_tokens"] = dict(self.accepted_tokens)
        out["tokens_per_forward"] = self.tokens_per_forward
        out["decode_tokens_per_s"] = self.decode_tokens_per_s
        return out


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop" or "length"
    stats: GenerationStats


class GenerationStream(Iterator[str]):
    """Text deltas as tokens are accepted; `result` once the iteration has finished.

    The generation runs on a worker thread of its own and hands its deltas over through a queue (at
    most `max_new_tokens` of them), so it never waits on the reader: a stream read slowly, from
    another thread, or not at all, still finishes and frees the engine for the next caller. `close()`,
    or dropping the stream, stops the generation at its next step.
    """

    def __init__(self, run: Callable[[threading.Event], Generator[str, None, GenerationResult]]):
        """`run(cancelled)`: the generation's steps, which stop once `cancelled` is set."""
        self._deltas: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._result: GenerationResult | None = None
        self._finished = False
        # The worker holds the queue and the event, never the stream, so dropping it is seen here.
        weakref.finalize(self, self._cancelled.set)
        worker = threading.Thread(target=_produce, args=(run(self._cancelled), self._deltas), name="rag-speculate-stream", daemon=True)
        worker.start()

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        kind, value = self._deltas.get()
        if kind is _DELTA:
            return value
        self._finished = True
        if kind is _ERROR:
            raise value
        self._result = value
        raise StopIteration

    def close(self) -> None:
        """Stop generating early: the engine is free for the next caller after the current step."""
        self._cancelled.set()

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished: iterate it to the end first")
        return self._result


_DELTA, _DONE, _ERROR = object(), object(), object()


def _produce(steps: Generator[str, None, GenerationResult], deltas: queue.SimpleQueue) -> None:
    try:
        while True:
            deltas.put((_DELTA, next(steps)))
    except StopIteration as finished:
        deltas.put((_DONE, finished.value))
    except BaseException as error:  # noqa: BLE001 - handed to the reader, who raises it
        deltas.put((_ERROR, error))


def run_to_end(steps: Generator[str, None, GenerationResult]) -> GenerationResult:
    """Run a generation's steps on this thread and return its result."""
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value
