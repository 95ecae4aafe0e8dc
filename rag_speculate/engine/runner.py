"""Where the sequences in flight keep their KV entries, and how their forwards run.

`BatchRunner`: every sequence a row of one `BatchCache`, every step's verification one forward over
all of them (`decoding/batch.py`); given a `StaticLayout`, the cache is allocated once and each
verification runs in fixed shapes (`decoding/static.py`), which CUDA graphs may replay
(`rag_speculate/cuda/graphs.py`). `SequentialRunner`: each sequence a cache of its own and a
forward of its own, one after another: for a model whose cache cannot be laid out in rows (sliding
windows) or that verifies chains only; the engine then runs one generation at a time. Both take
their prompts' cached prefixes from the prompt cache and give it their entries back at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from ..decoding import probe
from ..decoding.batch import BatchCache, BatchForward, Fed
from ..decoding.forward import TreeForward
from ..decoding.kv_cache import keep_cache_entries, make_cache, window_holds
from ..decoding.prompt_cache import PromptCache, Reused
from ..decoding.static import Replay, StaticStep
from ..decoding.tree import DraftTree
from .traits import ModelTraits


# A preallocated row's entries are a whole number of these: the attention's reads stay aligned.
_ROW_ALIGNMENT = 64


@dataclass(frozen=True)
class StaticLayout:
    """A preallocated cache for a fixed-shape step: `rows` (the engine's max_batch) of `capacity`
    entries each, every step feeding a row at most `tokens` (draft budget + 1)."""

    rows: int
    capacity: int
    tokens: int

    @classmethod
    def for_budget(cls, kv_tokens: int, rows: int, tokens: int) -> StaticLayout:
        """The engine's KV entries shared out evenly among its rows, each rounded up to a whole number
        of aligned blocks and holding at least one step."""
        capacity = -(-max(kv_tokens // rows, tokens) // _ROW_ALIGNMENT) * _ROW_ALIGNMENT
        return cls(rows, capacity, tokens)


def make_runner(
    model: PreTrainedModel, traits: ModelTraits, prompt_cache: PromptCache, layout: StaticLayout | None = None,
    replay: Replay | None = None,
) -> BatchRunner | SequentialRunner:  # fmt: skip
    """Rows of one cache where the model takes them (preallocated, verified in fixed shapes, with a
    `layout`; `replay` runs each shape's forward, CUDA graphs' say), else a cache and a forward per
    sequence."""
    forwards = {"forward": traits.forward, "context": traits.context}
    if traits.rows:
        return BatchRunner(model, BatchForward(model, **forwards), prompt_cache, layout, replay)
    return SequentialRunner(model, TreeForward(model, **forwards), prompt_cache, bool(traits.tree_attention))


class BatchRunner:
    def __init__(
        self, model: PreTrainedModel, forward: BatchForward, prompt_cache: PromptCache, layout: StaticLayout | None = None,
        replay: Replay | None = None,
    ):  # fmt: skip
        self.model, self.forward, self.prompt_cache = model, forward, prompt_cache
        self.cache = BatchCache(model) if layout is None else BatchCache(model, layout.rows, layout.capacity)
        # Verification in fixed shapes on the preallocated cache; prompts' chunks still run through `forward`.
        self.step = None if layout is None else StaticStep(forward, self.cache, layout.tokens, replay)
        self.rows: dict[int, int] = {}  # sequence id -> row

    def add(self, key: int, prompt: Sequence[int], longest: int) -> Reused:
        """A row for sequence `key` (which may grow to `longest` entries), holding the longest cached
        prefix of `prompt` (from memory, then disk)."""
        row = self.rows[key] = self.cache.add_row()
        return self.prompt_cache.fetch(self.model, prompt, self.cache.row_cache(row))

    def prefill(self, key: int, tokens: list[int]) -> torch.Tensor:
        """Feed a chunk of the prompt; the logits after its last token."""
        row = self.rows[key]
        logits = self.forward(self.cache, [Fed(row, tokens)], last_only=True)[0][0]
        self.cache.advance(row, len(tokens))
        return logits

    def verify(self, steps: Sequence[tuple[int, int, DraftTree]], width: int) -> list[torch.Tensor]:
        """One forward over every (sequence, root, draft) given, each padded to `width` tokens; each's
        logits, `[1 + nodes, vocab]`."""
        inputs = [Fed(self.rows[key], [root, *tree.tokens], tree.fed_parents()) for key, root, tree in steps]
        return self.forward(self.cache, inputs) if self.step is None else self.step(inputs)

    def keep(self, kept: dict[int, list[int]]) -> None:
        """Of the tokens each sequence was fed by `verify`, keep the entries at these offsets."""
        (self.cache if self.step is None else self.step).keep({self.rows[key]: offsets for key, offsets in kept.items()})

    def held(self, key: int) -> int:
        return self.cache.lengths[self.rows[key]]

    def row_room(self) -> int | None:
        """The entries one sequence may hold at most: a preallocated row's (None: rows grow)."""
        return None if self.step is None else self.cache.capacity

    def tree_mode(self, key: int) -> bool:
        return True

    def remove(self, key: int, tokens: Sequence[int] | None) -> None:
        """Free the sequence's row; `tokens` (those its entries hold, in order) go to the prompt cache."""
        row = self.rows.pop(key)
        if tokens:
            self.prompt_cache.insert(self.model, tokens, self.cache.row_cache(row))
        self.cache.remove_row(row)

    def held_tokens(self) -> int:
        return self.cache.held_tokens()

    def timed(self) -> Callable[[int], None]:
        """A forward over q tokens of one row, as `verify` runs them (through the fixed-shape step where
        it verifies), for the cost curve."""
        return probe.timed_rows(self.forward) if self.step is None else probe.timed_static(self.step)


class SequentialRunner:
    def __init__(self, model: PreTrainedModel, forward: TreeForward, prompt_cache: PromptCache, tree_attention: bool):
        self.model, self.forward, self.prompt_cache, self.tree_attention = model, forward, prompt_cache, tree_attention
        self.caches: dict[int, DynamicCache] = {}
        self._tree: dict[int, bool] = {}
        self._fed: dict[int, int] = {}

    def add(self, key: int, prompt: Sequence[int], longest: int) -> Reused:
        cache = self.caches[key] = make_cache(self.model)
        # Tree verification, unless the model cannot, or a sliding window would outgrow its past.
        self._tree[key] = self.tree_attention and window_holds(cache, longest)
        return self.prompt_cache.fetch(self.model, prompt, cache)

    def prefill(self, key: int, tokens: list[int]) -> torch.Tensor:
        return self.forward.prefill(self.caches[key], tokens)

    def verify(self, steps: Sequence[tuple[int, int, DraftTree]], width: int) -> list[torch.Tensor]:
        out = []
        for key, root, tree in steps:
            cache = self.caches[key]
            self._fed[key] = len(tree) + 1
            # Without a draft, plain decoding's own forward (no custom mask to build and apply) is the cheapest.
            chain = not self._tree[key] or not tree.tokens
            out.append((self.forward.chain if chain else self.forward.tree)(cache, root, tree))
        return out

    def keep(self, kept: dict[int, list[int]]) -> None:
        for key, offsets in kept.items():
            keep_cache_entries(self.caches[key], self._fed.pop(key), offsets)

    def held(self, key: int) -> int:
        return self.caches[key].get_seq_length()

    def row_room(self) -> int | None:
        return None

    def tree_mode(self, key: int) -> bool:
        return self._tree[key]

    def remove(self, key: int, tokens: Sequence[int] | None) -> None:
        cache = self.caches.pop(key)
        self._tree.pop(key)
        if tokens:
            self.prompt_cache.insert(self.model, tokens, cache)

    def held_tokens(self) -> int:
        return sum(c.get_seq_length() for c in self.caches.values())

    def timed(self) -> Callable[[int], None]:
        """A forward over q tokens of one sequence, as `verify` runs them, for the cost curve."""
        return probe.timed_tree(self.forward, self.tree_attention)
