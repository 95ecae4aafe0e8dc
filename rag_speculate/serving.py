"""What a server or framework adapter needs beyond `generate` and `stream`: one engine per
configuration and process, async iteration that never blocks the event loop, token usage."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import torch

from .decoding.engine import SpeculativeEngine
from .models.device import Device, resolve_device
from .decoding.result import GenerationResult, GenerationStats, GenerationStream

# "auto": bf16 where the hardware computes in it, else fp32 (models.loading.default_dtype).
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Key under which a corpus index stores a chunk's token ids (from the target's tokenizer) in its
# metadata, so the drafters get them without tokenizing the text again.
TOKEN_IDS_KEY = "token_ids"

_engines: dict[tuple, SpeculativeEngine] = {}
_engines_lock = threading.Lock()
_DONE = object()


def shared_engine(model: str, *, dtype: str, device: Device, draft_budget: int | None) -> SpeculativeEngine:
    """One engine per configuration and process: adapters built from the same name share the weights
    (and, through the engine's lock, take turns on them). `device` as `models.device.resolve_device`
    reads it (None: CUDA when available), so "cuda" and None name the same engine on a GPU machine."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    resolved = resolve_device(device)
    key = (model, dtype, str(resolved), draft_budget)
    # Loading under the lock makes a concurrent second caller wait for this copy instead of loading another.
    with _engines_lock:
        if key not in _engines:
            _engines[key] = SpeculativeEngine.from_pretrained(
                model, dtype=DTYPES[dtype], device=resolved, draft_budget=draft_budget
            )
        return _engines[key]


def check_call_arguments(owner: str, kwargs: dict, allowed: tuple[str, ...]) -> None:
    """Reject per-call arguments an adapter would otherwise silently ignore, naming them."""
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(
            f"{owner} got unsupported argument(s) {', '.join(map(repr, unknown))}; "
            f"per-call arguments are {', '.join(allowed)}"
        )
    if "max_tokens" in kwargs and "max_new_tokens" in kwargs:
        raise TypeError("pass max_new_tokens or its alias max_tokens, not both")


def token_usage(stats: GenerationStats) -> dict:
    """OpenAI-style usage: the prompt's tokens read from the prompt cache are its `cached_tokens`."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
    }


async def aiterate(stream: GenerationStream) -> AsyncIterator[str]:
    """The stream's text deltas, generated on a worker thread so the event loop never waits on a forward.

    Errors from the generation are raised here. Leaving early (break, cancellation, an error downstream)
    stops generation at its next step, which frees the engine for the next caller.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    abandoned = threading.Event()

    def put(item: object) -> None:
        if abandoned.is_set():
            return
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            abandoned.set()

    def produce() -> None:
        try:
            for delta in stream:
                if abandoned.is_set():
                    return
                put(delta)
            put(_DONE)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, who re-raises it
            put(error)
        finally:
            stream.close()

    threading.Thread(target=produce, name="rag-speculate-generation", daemon=True).start()
    try:
        while (item := await queue.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # Stop the generation now rather than when the producer next hears from it.
        abandoned.set()
        stream.close()


def collect(stream: GenerationStream) -> GenerationResult:
    """Run the stream to its end and return its result."""
    for _ in stream:
        pass
    return stream.result


async def acollect(stream: GenerationStream) -> GenerationResult:
    """`collect` without blocking the event loop; cancelling the caller stops the generation."""
    async for _ in aiterate(stream):
        pass
    return stream.result
