"""A prompt cache: the KV entries of token prefixes seen before, reused across requests, in memory and,
with a folder, on disk for every process and replica that shares it.

One radix tree over token ids, in memory. Each node holds the keys and values of every layer for its
span of tokens, given all the tokens on the path above it: a request reuses the longest cached prefix
of its prompt and prefills only the rest, and a finished generation inserts its prompt and output so
the next turn of a conversation (or the next question over the same documents) starts warm.

Under it, optionally, a disk tier (`prompt_store.py`): fixed-size blocks of the same entries, keyed by
the model's identity and the token ids, verified before use. Every insert writes through (the new
full blocks, written by a background thread), so what memory evicts is already on disk: evictions
"spill" by write-through, and other processes see a prefix as soon as it is written. A lookup walks
memory first; where the disk holds a longer run of full blocks, those are loaded when that is
predicted faster than prefilling their tokens (`_disk_pays`), and promoted into memory.

Invariants:
- a node's entries were computed after exactly the tokens on its path (exact prefixes only: the
  model's output stays its own), for the one model, dtype, attention and device the cache is bound
  to; the disk tier serves only the model it was opened for (its identity names the weights);
- `bytes` is the sum of every node's tensor bytes and never exceeds `max_bytes`: a node is added only
  once room is made for it, by evicting least recently used leaves (a parent becomes a leaf when its
  last child goes); entries being copied out are never evicted, since copying happens under the lock;
- nodes own their tensors (cloned, never views of a generation's cache), so the accounting is exact.

    cache = PromptCache(max_bytes=1 << 30)
    reused = cache.fetch(model, prompt_ids[:-1], kv)  # kv: a fresh DynamicCache, now holding reused.tokens entries
    ...                                                # prefill prompt_ids[reused.tokens:], decode
    cache.insert(model, tokens, kv)                    # kv holds the entries of tokens, in order
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from ..errors import InvalidArgumentError, check_int
from .kv_cache import kv_shape
from .probe import cache_layout
from .prompt_store import DEFAULT_MAX_BYTES, BlockShape, PromptStore, model_identity

logger = logging.getLogger(__name__)

# Tokens of KV the default budget has room for: several long RAG prompts and their conversations.
DEFAULT_TOKENS = 32768
# Prefills shorter than this teach nothing about the cost per token: a forward's fixed cost dominates.
_LEARNT_PREFILL_TOKENS = 32
# A disk load the rule refused is made anyway every this many refusals, to measure the disk again: a
# first read from a cold disk must not keep the tier off for good.
_RETRY_REFUSED = 32

Entries = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values over a node's span


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    entries: Entries
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.entries)


@dataclass
class PromptCacheStats:
    hits: int = 0  # requests that reused at least one token, from either tier
    misses: int = 0
    tokens_reused: int = 0
    evictions: int = 0  # nodes evicted from memory
    bytes: int = 0  # in memory
    max_bytes: int = 0
    nodes: int = 0
    # By tier: requests that reused tokens from memory, from disk (a request can do both), and how many.
    memory_hits: int = 0
    memory_tokens: int = 0
    disk_hits: int = 0
    disk_tokens: int = 0
    # The disk tier: its folder's blocks in bytes (as last seen) and budget; seconds spent loading
    # blocks, against the prefill seconds their tokens would have taken (at the prefill rate measured
    # so far: 0 until this engine has prefilled at least a few dozen tokens at once);
    # loads not made because prefilling was predicted faster; blocks written, failed writes, blocks
    # the writer's queue had no room for, blocks that failed verification (and were removed), blocks
    # evicted, and entries at a block's name the tier may not remove (another user's, a FIFO, a link).
    disk_bytes: int = 0
    disk_max_bytes: int = 0
    disk_load_s: float = 0.0
    disk_saved_s: float = 0.0
    disk_loads_skipped: int = 0
    disk_blocks_written: int = 0
    disk_write_failures: int = 0
    disk_writes_dropped: int = 0
    disk_blocks_rejected: int = 0
    disk_blocks_evicted: int = 0
    disk_entries_refused: int = 0


@dataclass(frozen=True)
class Reused:
    """A prefix taken from the cache: its first `memory` tokens from memory, the next `disk` from disk."""

    memory: int = 0
    disk: int = 0

    @property
    def tokens(self) -> int:
        return self.memory + self.disk


class _Rate:
    """Seconds per unit (a prefill's token, a load's byte), recent measurements weighing most."""

    def __init__(self) -> None:
        self.seconds = self.units = 0.0

    def observe(self, units: float, seconds: float) -> None:
        self.seconds, self.units = 0.75 * self.seconds + seconds, 0.75 * self.units + units

    @property
    def per_unit(self) -> float | None:
        return self.seconds / self.units if self.units else None


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes one token's keys and values take in every layer of `model`'s cache."""
    layers, heads, head_dim = kv_shape(model)
    return 2 * layers * heads * head_dim * next(model.parameters()).element_size()


def _key(model: torch.nn.Module) -> tuple:
    """What a cache's entries are bound to: the model object, its dtype, device and attention."""
    parameter = next(model.parameters())
    return id(model), parameter.dtype, parameter.device, getattr(model.config, "_attn_implementation", None)


class PromptCache:
    """A radix tree of cached prompt prefixes under a byte budget, over an optional disk tier; safe to
    share between threads."""

    def __init__(self, max_bytes: int, store: PromptStore | None = None, model: torch.nn.Module | None = None):
        """`store`: the disk tier, for `model`'s entries only."""
        self.max_bytes = check_int(max_bytes, "prompt_cache_bytes", 0)
        self.store = store
        self._store_key = _key(model) if store is not None else None
        self._root = _Node((), [], None)
        self._bound: tuple | None = None
        self._lock = threading.Lock()
        self._stats = PromptCacheStats(max_bytes=max_bytes)
        self._prefill_rate, self._disk_rate = _Rate(), _Rate()
        self._refused = 0
        self._warm: Callable[[Sequence[Any], dict[str, Any]], int] | None = None

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        max_bytes: int | None = None,
        *,
        folder: str | os.PathLike | None = None,
        disk_bytes: int | None = None,
        kernels: bool = False,
        off: str | None = None,
    ) -> PromptCache:
        """A cache for `model`'s entries: `max_bytes` of memory, or None for room for `DEFAULT_TOKENS`
        tokens; with `folder`, a disk tier there of `disk_bytes` (None: `DEFAULT_MAX_BYTES`; 0: none),
        its blocks filed under the model's identity (`kernels`: the CPU kernels compute its forwards).
        Off (0 bytes, no disk tier, one log line) for a model whose cache cannot be cut into prefixes:
        `off` says why ("" where it can; None: asked of the model, `probe.cache_layout`).
        A bad option raises InvalidArgumentError naming it."""
        if max_bytes is not None:
            check_int(max_bytes, "prompt_cache_bytes", 0)
        if disk_bytes is not None:
            check_int(disk_bytes, "prompt_cache_disk_bytes", 0)
            if folder is None:
                raise InvalidArgumentError("prompt_cache_disk_bytes is the budget of prompt_cache_dir, which is not "
                                           "given", "prompt_cache_disk_bytes")  # fmt: skip
        reason = cache_layout(model) if off is None else off
        if reason:
            logger.info("prompt cache off for %s: %s", type(model).__name__, reason)
            return cls(0)
        memory = DEFAULT_TOKENS * kv_bytes_per_token(model) if max_bytes is None else max_bytes
        disk_bytes = DEFAULT_MAX_BYTES if disk_bytes is None else disk_bytes
        if folder is None or disk_bytes == 0:
            return cls(memory)
        store = PromptStore(folder, model_identity(model, kernels), BlockShape.of(model), max_bytes=disk_bytes)
        return cls(memory, store, model)

    def stats(self) -> PromptCacheStats:
        with self._lock:
            stats = PromptCacheStats(**vars(self._stats))
            stats.disk_saved_s = stats.disk_tokens * (self._prefill_rate.per_unit or 0.0)
        if self.store is not None:
            disk = self.store.stats()
            stats.disk_bytes, stats.disk_max_bytes = disk.bytes, disk.max_bytes
            stats.disk_blocks_written, stats.disk_write_failures = disk.blocks_written, disk.write_failures
            stats.disk_writes_dropped, stats.disk_blocks_rejected = disk.writes_dropped, disk.blocks_rejected
            stats.disk_blocks_evicted, stats.disk_entries_refused = disk.blocks_evicted, disk.entries_refused
        return stats

    def clear(self) -> None:
        """Empty the memory tier. The disk tier's folder is shared with other processes and stays:
        delete the folder to empty it."""
        with self._lock:
            self._root = _Node((), [], None)
            self._stats.bytes = self._stats.nodes = 0

    # --- warming --------------------------------------------------------------------------------

    def warm_with(self, warm: Callable[[Sequence[Any], dict[str, Any]], int]) -> None:
        """How `warm` prefills: the engine that owns this cache registers `warm(prompts, options)`,
        which runs each prompt through the engine and returns the prompt tokens it prefilled."""
        self._warm = warm

    def warm(self, prompts: Sequence[Any], **options: Any) -> int:
        """Prefill `prompts` ahead of traffic (text, token ids, or chat messages; `options` as the
        engine's `prepare` takes them: documents, tools, chat), so that their entries are in memory
        and, with a disk tier, written to disk before this returns, for every process sharing it.
        Returns the prompt tokens prefilled (those already cached cost nothing)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidArgumentError("prompts must be a list of prompts (text, token ids or chat messages)", "prompts")
        if self._warm is None:
            raise InvalidArgumentError("this prompt cache belongs to no engine: warm it through engine.prompt_cache")
        prefilled = self._warm(prompts, options)
        if self.store is not None:
            self.store.flush()
        return prefilled

    # --- lookups and inserts ----------------------------------------------------------------------

    def fetch(self, model: torch.nn.Module, tokens: Sequence[int], cache: DynamicCache) -> Reused:
        """Copy the entries of the longest cached prefix of `tokens` into the empty `cache`, saying how
        many tokens came from each tier: memory's longest prefix first, then the disk's blocks beyond
        it, where loading them pays; those are promoted into memory."""
        with self._lock:
            self._bind(model)
            path, matched = self._walk(tokens)
            if matched:
                now = time.monotonic()
                for node in path:
                    node.last_used = now
                for layer in range(len(path[0].entries)):
                    keys = torch.cat([node.entries[layer][0] for node in path], dim=-2)
                    values = torch.cat([node.entries[layer][1] for node in path], dim=-2)
                    cache.update(keys[..., :matched, :], values[..., :matched, :], layer)
            disk_on = self.store is not None and self._bound == self._store_key
        loaded = self._from_disk(tokens, matched, cache) if disk_on else 0
        with self._lock:
            stats = self._stats
            stats.hits += bool(matched or loaded)
            stats.misses += not (matched or loaded)
            stats.tokens_reused += matched + loaded
            stats.memory_hits += bool(matched)
            stats.memory_tokens += matched
            stats.disk_hits += bool(loaded)
            stats.disk_tokens += loaded
            if loaded and self._bound == self._store_key:
                self._remember(tokens[: matched + loaded], cache)
        return Reused(matched, loaded)

    def insert(self, model: torch.nn.Module, tokens: Sequence[int], cache: DynamicCache) -> None:
        """Cache the entries of `tokens`, which `cache` holds in order from its first position: in
        memory, and written through to the disk tier (its new full blocks)."""
        if not tokens:
            return
        with self._lock:
            self._bind(model)
            self._remember(tokens, cache)
            disk_on = self.store is not None and self._bound == self._store_key
        if disk_on:
            self.store.save(tokens, cache.layers)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill the engine ran: `tokens` fed in `seconds`, which the disk tier's loads compete with."""
        if tokens >= _LEARNT_PREFILL_TOKENS:
            with self._lock:
                self._prefill_rate.observe(tokens, seconds)

    def _from_disk(self, tokens: Sequence[int], matched: int, cache: DynamicCache) -> int:
        """Append the disk's blocks of `tokens` beyond the `matched` in memory to `cache`, where that
        pays; how many tokens they added. On the engine's thread, without the lock: reads take time."""
        store = self.store
        size = store.block_tokens
        hashes = store.hashes(tokens)
        first = matched // size
        run = store.present(hashes, first)
        if not run or not self._disk_pays(run * store.shape.data_bytes, (first + run) * size - matched):
            return 0
        started = time.perf_counter()
        blocks = []
        for index in range(first, first + run):
            block = store.load(tokens, hashes, index)
            if block is None:
                break
            blocks.append(block)
        if not blocks:
            return 0
        skip = matched - first * size  # of the first block, the tokens memory gave
        device = self._store_key[2]  # a block is bytes on the CPU: onto the model's device, a copy
        for layer in range(store.shape.layers):
            keys = torch.cat([block[layer][0] for block in blocks], dim=-2)[..., skip:, :]
            values = torch.cat([block[layer][1] for block in blocks], dim=-2)[..., skip:, :]
            cache.update(keys.to(device), values.to(device), layer)
        elapsed = time.perf_counter() - started
        loaded = len(blocks) * size - skip
        with self._lock:
            self._disk_rate.observe(len(blocks) * store.shape.data_bytes, elapsed)
            self._stats.disk_load_s += elapsed
        return loaded

    def _disk_pays(self, load_bytes: int, tokens: int) -> bool:
        """Whether loading `load_bytes` of blocks is predicted faster than prefilling the `tokens`
        they add, by the rates measured on this machine: seconds per prefilled token (the engine
        reports its prefills) against seconds per loaded byte (reading, verifying and copying to the
        device). Optimistic for the disk until both are measured; a refused load is made anyway
        every `_RETRY_REFUSED` refusals, to measure the disk again."""
        with self._lock:
            prefill, load = self._prefill_rate.per_unit, self._disk_rate.per_unit
            if prefill is None or load is None or load * load_bytes < prefill * tokens:
                return True
            self._refused += 1
            self._stats.disk_loads_skipped += 1
            return self._refused % _RETRY_REFUSED == 0

    def _remember(self, tokens: Sequence[int], cache: DynamicCache) -> None:
        """The memory tier's insert, under the lock."""
        if self.max_bytes <= 0:
            return
        path, matched = self._walk(tokens)
        if matched == len(tokens):
            return
        node = path[-1] if path else self._root
        above = sum(len(n.tokens) for n in path[:-1])
        if path and matched < above + len(node.tokens):
            node = self._split(node, matched - above)
        span = slice(matched, len(tokens))
        entries = [(layer.keys[..., span, :].clone(), layer.values[..., span, :].clone()) for layer in cache.layers]
        child = _Node(tuple(tokens[span]), entries, node, last_used=time.monotonic())
        if not self._make_room(child.bytes, keep=node):
            return
        node.children[child.tokens[0]] = child
        self._stats.bytes += child.bytes
        self._stats.nodes += 1

    def _bind(self, model: torch.nn.Module) -> None:
        """Entries are only valid for the model that computed them: another model empties the cache."""
        key = _key(model)
        if key != self._bound:
            self._root = _Node((), [], None)
            self._stats.bytes = self._stats.nodes = 0
            self._bound = key

    def _walk(self, tokens: Sequence[int]) -> tuple[list[_Node], int]:
        """The nodes along the longest cached prefix of `tokens` (the last possibly matched in part)
        and the prefix's length."""
        path, matched, node = [], 0, self._root
        while matched < len(tokens) and (child := node.children.get(tokens[matched])) is not None:
            span = child.tokens
            common = 0
            while common < len(span) and matched + common < len(tokens) and span[common] == tokens[matched + common]:
                common += 1
            path.append(child)
            matched += common
            if common < len(span):
                break
            node = child
        return path, matched

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after its first `at` tokens; returns the upper part, which keeps its place."""
        upper = _Node(node.tokens[:at], [(k[..., :at, :].clone(), v[..., :at, :].clone()) for k, v in node.entries], node.parent,
                      {node.tokens[at]: node}, node.last_used)
        node.parent.children[node.tokens[0]] = upper
        node.tokens = node.tokens[at:]
        node.entries = [(k[..., at:, :].clone(), v[..., at:, :].clone()) for k, v in node.entries]
        node.parent = upper
        self._stats.nodes += 1  # the bytes are the same, in two nodes
        return upper

    def _make_room(self, needed: int, keep: _Node) -> bool:
        """Evict least recently used leaves (never `keep` or its ancestors) until `needed` bytes fit.

        The evictable leaves are found once and kept in a heap by last use, a parent pushed when its
        last child goes (as SGLang's radix cache evicts): one walk of the tree however many go.
        """
        if needed > self.max_bytes:
            return False
        if self._stats.bytes + needed <= self.max_bytes:
            return True
        protected = set()
        node = keep
        while node is not None:
            protected.add(id(node))
            node = node.parent
        # The count breaks ties in last use, so the heap never compares two nodes.
        order = itertools.count()
        leaves = [(n.last_used, next(order), n) for n in self._nodes() if not n.children and id(n) not in protected]
        heapq.heapify(leaves)
        while self._stats.bytes + needed > self.max_bytes:
            if not leaves:
                return False
            _, _, victim = heapq.heappop(leaves)
            parent = victim.parent
            del parent.children[victim.tokens[0]]
            self._stats.bytes -= victim.bytes
            self._stats.nodes -= 1
            self._stats.evictions += 1
            if not parent.children and id(parent) not in protected:
                heapq.heappush(leaves, (parent.last_used, next(order), parent))
        return True

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
