"""Several sequences in one forward of an unmodified model: `BatchCache` and `BatchForward`.

Each sequence in flight owns a row of the cache, `[rows, kv_heads, capacity, head_dim]` per layer,
filled up to its own length. A forward feeds every row's tokens padded to the longest (a draft
tree's `[root, *draft]`, or a chunk of a prompt), at each row's own positions, under one additive
4D mask that lets a token see its row's cached entries, itself and its ancestors among the fed,
nothing of another row and no padding. The model writes the fed tokens' keys and values through
the cache's `update` after each row's length; `keep` then holds on to the accepted path's entries
only, gathered in place, as `kv_cache.keep_cache_entries` does for one sequence.

    cache = BatchCache(model)
    a, b = cache.add_row(), cache.add_row()
    logits = BatchForward(model)(cache, [Fed(a, prompt_ids), Fed(b, [root, *draft], parents)])
    cache.advance(a, len(prompt_ids))            # a prompt's entries, all kept
    cache.keep({b: [0, 1, 2]})                   # the root and two accepted nodes

The rows' arithmetic stays their own only through kernels that compute each row as if alone (the
CPU kernels do; torch's do not: docs/design.md, "Losslessness").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from .forward import ModelForward, shared_kv_heads
from .kv_cache import kv_shape
from .tree import additive_mask, fed_depths, fed_visibility


@dataclass(frozen=True)
class Fed:
    """What one row feeds a forward: tokens after its cached entries, each with its parent among them
    (ROOT: the cached entries alone); None for a chain, each token after the one before it."""

    row: int
    tokens: list[int]
    parents: list[int] | None = None


class BatchCache:
    """The keys and values of several sequences, a row each, grown as they need; what a model's
    forward calls `update` on. Rows are added and removed between forwards."""

    def __init__(self, model: PreTrainedModel):
        self.layers, self.kv_heads, self.head_dim = kv_shape(model)
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []  # entries held, by row
        self._free: list[int] = []
        # Set by BatchForward for the forward under way: the rows fed, in order, and where each writes.
        self._rows: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._span: tuple[int, int] | None = None  # the rows fed, when they are a contiguous run
        self._block: tuple[int, int, int, int] | None = None  # that run, its one start and the tokens fed
        self._seen = 0  # entries the forward's attention reads per row

    # --- rows ------------------------------------------------------------------------------

    def add_row(self) -> int:
        """A new, empty row; a removed row's place is used again."""
        if self._free:
            row = self._free.pop()
        else:
            row = len(self.lengths)
            self.lengths.append(0)
        self.lengths[row] = 0
        return row

    def remove_row(self, row: int) -> None:
        """Free `row`; its entries are dropped."""
        self.lengths[row] = 0
        self._free.append(row)

    @property
    def rows(self) -> int:
        return len(self.lengths) - len(self._free)

    def held_tokens(self) -> int:
        return sum(self.lengths)

    def reserve(self, needed: int) -> None:
        """Room in every row for `needed` entries, and for every row there is."""
        capacity = self.keys[0].shape[2] if self.keys else 0
        rows_now = self.keys[0].shape[0] if self.keys else 0
        if needed <= capacity and len(self.lengths) <= rows_now:
            return
        # Grown by doubling, so a sequence that grows a token at a time copies its cache rarely.
        capacity = max(needed, 2 * capacity, 64)
        rows = max(len(self.lengths), rows_now)
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        for store in (self.keys, self.values):
            for i in range(self.layers):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    old = store[i]
                    grown[: old.shape[0], :, : old.shape[2]] = old
                    store[i] = grown
                else:
                    store.append(grown)

    # --- the forward's side ------------------------------------------------------------------

    def begin(self, rows: list[int], fed: int) -> None:
        """The next forward feeds `fed` tokens (padding included) to each of `rows`, in that order."""
        self.reserve(max(self.lengths[r] for r in rows) + fed)
        device = self.device
        self._rows = torch.tensor(rows, device=device)
        starts = torch.tensor([self.lengths[r] for r in rows], device=device)
        self._positions = starts[:, None] + torch.arange(fed, device=device)[None]
        self._span = (rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) else None
        # Rows side by side that all write at one position (one row, always): a slice, copied
        # without the index tensors' gather-scatter.
        writes_at = {self.lengths[r] for r in rows}
        self._block = (*self._span, writes_at.pop(), fed) if self._span is not None and len(writes_at) == 1 else None
        self._seen = max(self.lengths[r] for r in rows) + fed

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """Write the fed tokens' keys and values `[rows fed, kv_heads, fed, head_dim]` after each
        row's entries; the rows' keys and values up to the longest, for the attention to read."""
        if self._block is not None:
            first, end, start, fed = self._block
            self.keys[layer_idx][first:end, :, start : start + fed] = key_states
            self.values[layer_idx][first:end, :, start : start + fed] = value_states
        else:
            rows, positions = self._rows[:, None], self._positions
            for store, new in ((self.keys, key_states), (self.values, value_states)):
                store[layer_idx][rows, :, positions] = new.transpose(1, 2).to(self.dtype)
        if self._span is not None:
            first, end = self._span
            return self.keys[layer_idx][first:end, :, : self._seen], self.values[layer_idx][first:end, :, : self._seen]
        return (self.keys[layer_idx].index_select(0, self._rows)[:, :, : self._seen],
                self.values[layer_idx].index_select(0, self._rows)[:, :, : self._seen])  # fmt: skip

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def advance(self, row: int, fed: int) -> None:
        """After a forward: keep every entry `row` was fed (a prompt's chunk), in order."""
        self.lengths[row] += fed

    def keep(self, kept: dict[int, list[int]]) -> None:
        """After a forward: of the entries each row was fed, keep those at the given offsets
        (ascending), in that order, right after the row's earlier entries."""
        rows = [r for r in kept if kept[r]]
        if not rows:
            return
        width = max(len(kept[r]) for r in rows)
        # Rows keeping fewer repeat their last entry: writing the same entry twice changes nothing.
        source = np.array([[self.lengths[r] + kept[r][min(j, len(kept[r]) - 1)] for j in range(width)] for r in rows])
        target = np.array([[self.lengths[r] + min(j, len(kept[r]) - 1) for j in range(width)] for r in rows])
        index = torch.tensor(rows, device=self.device)[:, None]
        source_t, target_t = torch.from_numpy(source).to(self.device), torch.from_numpy(target).to(self.device)
        for store in (self.keys, self.values):
            for layer in store:
                layer[index, :, target_t] = layer[index, :, source_t]
        for r in rows:
            self.lengths[r] += len(kept[r])

    # --- a row as a cache of its own (the prompt cache copies entries in and out) -------------

    def row_cache(self, row: int) -> RowCache:
        return RowCache(self, row)


class RowCache:
    """One row of a BatchCache as the prompt cache reads and writes a cache: `update` appends
    entries, `layers[i].keys` / `.values` are the row's entries so far."""

    def __init__(self, cache: BatchCache, row: int):
        self.cache, self.row = cache, row

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> None:
        cache, row = self.cache, self.row
        start, end = cache.lengths[row], cache.lengths[row] + keys.shape[2]
        cache.reserve(end)
        cache.keys[layer_idx][row, :, start:end] = keys[0]
        cache.values[layer_idx][row, :, start:end] = values[0]
        if layer_idx == cache.layers - 1:
            cache.lengths[row] = end

    @property
    def layers(self) -> list:
        cache, row, length = self.cache, self.row, self.cache.lengths[self.row]
        return [
            _Entries(cache.keys[i][row : row + 1, :, :length], cache.values[i][row : row + 1, :, :length])
            for i in range(cache.layers)
        ]

    def get_seq_length(self) -> int:
        return self.cache.lengths[self.row]


@dataclass(frozen=True)
class _Entries:
    keys: torch.Tensor
    values: torch.Tensor


class BatchForward(ModelForward):
    """One forward of a model over several rows of a BatchCache, returning each row's logits."""

    @torch.inference_mode()
    def __call__(self, cache: BatchCache, inputs: Sequence[Fed], last_only: bool = False) -> list[torch.Tensor]:
        """Logits `[len(tokens), vocab]` per input, in order (`last_only`: the last token's alone,
        `[1, vocab]`: a prompt's chunk needs no more)."""
        fed = max(len(i.tokens) for i in inputs)
        rows = [i.row for i in inputs]
        lengths = [cache.lengths[r] for r in rows]
        cache.begin(rows, fed)
        # Built on the host, whatever torch's default device: only the finished arrays cross to the model's.
        ids = np.zeros((len(inputs), fed), dtype=np.int64)
        depths = np.zeros((len(inputs), fed), dtype=np.int64)
        for b, item in enumerate(inputs):
            ids[b, : len(item.tokens)] = item.tokens
            depths[b, : len(item.tokens)] = fed_depths(item.parents, len(item.tokens))
            depths[b, len(item.tokens) :] = np.arange(len(item.tokens), fed)  # padding: positions of its own
        positions = torch.from_numpy(depths).to(self.device) + torch.tensor(lengths, device=self.device)[:, None]
        mask = self._mask(inputs, lengths, fed, cache.get_seq_length())
        keep = {"logits_to_keep": 1} if last_only and self._keeps_logits and len({len(i.tokens) for i in inputs}) == 1 else {}
        with shared_kv_heads(self.device):
            logits = self.logits(cache, input_ids=torch.from_numpy(ids).to(self.device), position_ids=positions, attention_mask=mask, **keep)
        if last_only:
            return [logits[b, len(item.tokens) - 1 if not keep else -1][None] for b, item in enumerate(inputs)]
        return [logits[b, : len(item.tokens)] for b, item in enumerate(inputs)]

    def _mask(self, inputs: Sequence[Fed], lengths: list[int], fed: int, seen: int) -> torch.Tensor:
        """Additive `[rows, 1, fed, seen]`: a row's tokens see its cached entries, themselves and
        their ancestors among the fed; padding sees only itself."""
        visible = np.zeros((len(inputs), fed, seen), dtype=bool)
        for b, (item, past) in enumerate(zip(inputs, lengths)):
            real = len(item.tokens)
            # Padding reads nothing real: not the cache, not the row's tokens, only itself.
            visible[b, :real, :past] = True
            visible[b, :real, past : past + real] = fed_visibility(item.parents, real)
            visible[b, real:, past + real : past + fed] = np.eye(fed - real, dtype=bool)
        return additive_mask(visible[:, None], 0, self.mask_dtype, self.device)
