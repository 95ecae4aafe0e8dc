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

Built with `rows` and `capacity`, the cache is allocated once and never grows (a CUDA graph holds
its addresses): one row more than asked for, the spare, takes the writes of a fixed-shape step's
padding (`static.py`), and nothing reads it but that padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from ..errors import RagSpeculateError
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
    """The keys and values of several sequences, a row each, grown as they need (or, given `rows` and
    `capacity`, allocated once); what a model's forward calls `update` on. Rows are added and removed
    between forwards."""

    def __init__(self, model: PreTrainedModel, rows: int | None = None, capacity: int | None = None):
        self.layers, self.kv_heads, self.head_dim = kv_shape(model)
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        self.keys: list[torch.Tensor] = []  # by layer, `[rows, kv_heads, capacity, head_dim]`
        self.values: list[torch.Tensor] = []
        # What `move` moves entries within, `[layers, rows, kv_heads, capacity, head_dim]`: where the
        # cache is allocated once, one tensor for every layer's keys and one for values (one operation
        # moves all layers' entries); where it grows, one per layer and kind (growing a layer at a
        # time never holds two whole copies).
        self.stores: list[torch.Tensor] = []
        self.lengths: list[int] = []  # entries held, by row
        self._free: list[int] = []
        self.fixed_rows = rows  # rows sequences may take, where the cache is allocated once
        if rows is not None:
            shape = (self.layers, rows + 1, self.kv_heads, capacity, self.head_dim)  # the last row is the spare
            self.stores = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2)]
            self.keys, self.values = (list(store.unbind(0)) for store in self.stores)
        # Set by `begin` or `fix` for the forward under way: the rows it reads, where it writes.
        self._read_rows: torch.Tensor | None = None
        self._write_rows: torch.Tensor | None = None
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
            if self.fixed_rows is not None and row >= self.fixed_rows:
                raise RagSpeculateError(f"the preallocated cache has {self.fixed_rows} rows, all taken")
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

    @property
    def capacity(self) -> int:
        """Entries each row has room for now."""
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def spare_row(self) -> int:
        """The preallocated cache's row that only padding writes and reads."""
        return self.fixed_rows

    def held_tokens(self) -> int:
        return sum(self.lengths)

    def reserve(self, needed: int) -> None:
        """Room in every row for `needed` entries, and for every row there is."""
        if self.fixed_rows is not None:
            if needed > self.capacity:
                raise RagSpeculateError(f"a row of the preallocated KV cache holds {self.capacity} entries, not {needed}")
            return
        rows_now = self.keys[0].shape[0] if self.keys else 0
        if needed <= self.capacity and len(self.lengths) <= rows_now:
            return
        # Grown by doubling, so a sequence that grows a token at a time copies its cache rarely.
        shape = (max(len(self.lengths), rows_now), self.kv_heads, max(needed, 2 * self.capacity, 64), self.head_dim)
        for store in (self.keys, self.values):
            for i in range(self.layers):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    old = store[i]
                    grown[: old.shape[0], :, : old.shape[2]] = old
                    store[i] = grown
                else:
                    store.append(grown)
        self.stores = [layer[None] for layer in (*self.keys, *self.values)]

    # --- the forward's side ------------------------------------------------------------------

    def begin(self, rows: list[int], fed: int) -> None:
        """The next forward feeds `fed` tokens (padding included) to each of `rows`, in that order."""
        self.reserve(max(self.lengths[r] for r in rows) + fed)
        device = self.device
        self._read_rows = torch.tensor(rows, device=device)
        self._write_rows = self._read_rows[:, None]
        starts = torch.tensor([self.lengths[r] for r in rows], device=device)
        self._positions = starts[:, None] + torch.arange(fed, device=device)[None]
        self._span = (rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) else None
        # Rows side by side that all write at one position (one row, always): a slice, copied
        # without the index tensors' gather-scatter.
        writes_at = {self.lengths[r] for r in rows}
        self._block = (*self._span, writes_at.pop(), fed) if self._span is not None and len(writes_at) == 1 else None
        self._seen = max(self.lengths[r] for r in rows) + fed

    def fix(self, read_rows: torch.Tensor, write_rows: torch.Tensor, write_at: torch.Tensor) -> None:
        """The next forward is a fixed-shape step (a preallocated cache's): it reads the whole capacity
        of rows `read_rows` `[batch]` and writes its token `[b, j]` at row `write_rows[b, j]`, entry
        `write_at[b, j]`; the same tensors, whatever the step, so a CUDA graph may replay it."""
        self._read_rows, self._write_rows, self._positions = read_rows, write_rows, write_at
        self._span = self._block = None
        self._seen = self.capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """Write the fed tokens' keys and values `[rows fed, kv_heads, fed, head_dim]` where `begin` or
        `fix` said; the rows' keys and values up to the longest, for the attention to read."""
        if self._block is not None:
            first, end, start, fed = self._block
            self.keys[layer_idx][first:end, :, start : start + fed] = key_states
            self.values[layer_idx][first:end, :, start : start + fed] = value_states
        else:
            for store, new in ((self.keys, key_states), (self.values, value_states)):
                store[layer_idx][self._write_rows, :, self._positions] = new.transpose(1, 2).to(self.dtype)
        if self._span is not None:
            first, end = self._span
            return self.keys[layer_idx][first:end, :, : self._seen], self.values[layer_idx][first:end, :, : self._seen]
        return (self.keys[layer_idx].index_select(0, self._read_rows)[:, :, : self._seen],
                self.values[layer_idx].index_select(0, self._read_rows)[:, :, : self._seen])  # fmt: skip

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def advance(self, row: int, fed: int) -> None:
        """After a forward: keep every entry `row` was fed (a prompt's chunk), in order."""
        self.lengths[row] += fed

    def keep(self, kept: dict[int, list[int]]) -> None:
        """After a forward: of the entries each row was fed, keep those at the given offsets
        (ascending), in that order, right after the row's earlier entries."""
        kept = {r: offsets for r, offsets in kept.items() if offsets}
        if not kept:
            return
        moves = np.empty((3, len(kept), max(len(offsets) for offsets in kept.values())), dtype=np.int64)
        self.keep_moves(kept, moves)
        self.move(*torch.from_numpy(moves).to(self.device))
        self.advance_kept(kept)

    def keep_moves(self, kept: dict[int, list[int]], moves: np.ndarray) -> None:
        """Where `keep` moves entries, into `moves` `[3, rows, width]` (each entry's row, the place it
        is read from, the place it is written to), row by row in `kept`'s order; the rest of `moves`
        is left as it is."""
        for b, (row, offsets) in enumerate(kept.items()):
            # Rows keeping fewer repeat their last entry: writing the same entry twice changes nothing.
            last = np.minimum(np.arange(moves.shape[2]), len(offsets) - 1)
            moves[0, b], moves[1, b], moves[2, b] = row, self.lengths[row] + np.asarray(offsets)[last], self.lengths[row] + last

    def move(self, rows: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
        """Every layer's entry at (`rows`, `source`) copied to (`rows`, `target`), all read before any is written."""
        for store in self.stores:
            store[:, rows, :, target] = store[:, rows, :, source]

    def advance_kept(self, kept: dict[int, list[int]]) -> None:
        """After `move`: each row holds its kept entries."""
        for row, offsets in kept.items():
            self.lengths[row] += len(offsets)

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
