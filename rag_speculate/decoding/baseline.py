"""Plain `model.generate`, timed the way the engine times itself: what every speed-up is measured against."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.generation.streamers import BaseStreamer


@dataclass(frozen=True)
class TimedGeneration:
    token_ids: list[int]
    total_s: float
    # From the first new tokens to the last: prefill is the same work for every method.
    decode_s: float
    # The tokens emitted within decode_s: all but the first step's. Plain decoding's first step is
    # one token; assisted generation drafts before the prefill and verifies the draft inside it, so
    # its first step emitted up to 14 of 64 tokens on math answers here, not decoded in no time.
    decode_tokens: int


class _FirstTokenClock(BaseStreamer):
    """Records when `generate` produced its first new tokens, and how many (its first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None
        self.first_tokens = 0

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()
            self.first_tokens = value.numel()

    def end(self) -> None:
        pass


def timed_generate(
    model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int, *,
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext, **kwargs: Any,
) -> TimedGeneration:  # fmt: skip
    """Greedy `model.generate` (plus `kwargs`: prompt lookup, an assistant model), with its timings,
    inside `context()` (the engine's CPU kernels, say).

    It runs on a thread of its own, as the engine runs its forwards (`engine/thread.py`): from a
    process's main thread the CPU kernels' forwards ran at half the speed they run at on a thread of
    their own (torch's OpenMP team and the kernels' pool contend there: with OMP_WAIT_POLICY=PASSIVE
    the gap closed), which would flatter every speed-up."""
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(_timed_generate, model, prompt_ids, max_new_tokens, context, kwargs).result()


def _timed_generate(
    model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int, context: Callable[[], AbstractContextManager],
    kwargs: dict[str, Any],
) -> TimedGeneration:  # fmt: skip
    inputs = torch.tensor([prompt_ids], device=model.device)
    clock = _FirstTokenClock()
    started = time.perf_counter()
    with torch.inference_mode(), context():
        out = model.generate(
            inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=max_new_tokens,
            streamer=clock, **kwargs,
        )
    ended = time.perf_counter()
    new = out[0, len(prompt_ids) :].tolist()
    return TimedGeneration(new, ended - started, ended - (clock.first_token_at or ended), max(len(new) - clock.first_tokens, 0))
