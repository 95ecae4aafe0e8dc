"""The drafter interface: propose a draft tree, learn from the verification.

A drafter never decides what is emitted, only what is checked, so any drafter (even a random
one) keeps the output identical to plain decoding; a good one just gets more of it accepted.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from ..decoding.budget import CostModel
from ..decoding.tree import DraftTree
from ..decoding.verify import Verification

ForwardContext = Callable[[], AbstractContextManager]


def plain_forwards(model: torch.nn.Module) -> ForwardContext:
    """Forwards as torch runs them, with no kernel layer."""
    return contextlib.nullcontext


@dataclass(frozen=True)
class Target:
    """The model a drafter serves, as the engine describes it when it is built."""

    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    device: torch.device
    # The context a model's forwards run in on this engine (the CPU kernels' mode, where they serve
    # that model): a drafter that runs a model of its own runs it the way the engine would.
    forward_context: Callable[[torch.nn.Module], ForwardContext] = plain_forwards


@dataclass(frozen=True)
class DraftContext:
    """What the drafter may use for one generation, given before the first proposal."""

    prompt_ids: Sequence[int]
    document_ids: Sequence[Sequence[int]]
    vocab_size: int
    # The target's forward cost by tokens fed, as the engine measured it: what a drafter that
    # spends time of its own (a draft model) weighs that time against. None where nothing was timed.
    target_cost: CostModel | None = None


class Drafter(ABC):
    """Base class: override `propose`, and `start` / `observe` when the drafter keeps state."""

    name: str = "drafter"
    # True where the drafter backs off by itself after failed drafts (an empty tree at next to no
    # cost) and comes back as soon as it is right again: a combiner then leaves its pacing to it
    # instead of judging it on averages, which miss the short stretches where it predicts.
    paces_itself: bool = False

    def attach(self, target: Target) -> None:
        """The engine this drafter serves is being built: refuse a target whose token ids mean other
        text, or a model of the drafter's own on another device than the target's."""

    def fork(self) -> Drafter:
        """A drafter for one more generation running at the same time, attached to the same target:
        what only reads (documents indexed at `start`, a corpus) may be shared, state a generation
        changes may not. A shallow copy serves a drafter whose `start` replaces all such state."""
        return copy.copy(self)

    def start(self, context: DraftContext) -> None:
        """A new generation begins; drop per-generation state and index the context."""

    @abstractmethod
    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        """A tree of at most `budget` nodes that may follow `tokens` (prompt plus output so far)."""

    def observe(self, verification: Verification) -> None:
        """The target's verdict on the last proposal."""
