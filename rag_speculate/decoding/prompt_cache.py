"""A prompt cache: the KV entries of token prefixes seen before, reused across requests.

One radix tree over token ids. Each node holds the keys and values of every layer for its span of
tokens, given all the tokens on the path above it: a request reuses the longest cached prefix of
its prompt and prefills only the rest, and a finished generation inserts its prompt and output so
the next turn of a conversation (or the next question over the same documents) starts warm.

Invariants:
- a node's entries were computed after exactly the tokens on its path (exact prefixes only: the
  model's output stays its own), for the one model, dtype, attention and device the cache is bound to;
- `bytes` is the sum of every node's tensor bytes and never exceeds `max_bytes`: a node is added only
  once room is made for it, by evicting least recently used leaves (a parent becomes a leaf when its
  last child goes); entries being copied out are never evicted, since copying happens under the lock;
- nodes own their tensors (cloned, never views of a generation's cache), so the accounting is exact.

    cache = PromptCache(max_bytes=1 << 30)
    reused = cache.load(model, prompt_ids[:-1], kv)  # kv: a fresh DynamicCache, now holding `reused` entries
    ...                                               # prefill prompt_ids[reused:], decode
    cache.insert(model, tokens, kv)                   # kv holds the entries of tokens, in order
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .kv_cache import make_cache
from .request import check_int

logger = logging.getLogger(__name__)

# Tokens of KV the default budget has room for: several long RAG prompts and their conversations.
DEFAULT_TOKENS = 32768

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
    hits: int = 0  # requests that reused at least one token
    misses: int = 0
    tokens_reused: int = 0
    evictions: int = 0  # nodes evicted
    bytes: int = 0
    max_bytes: int = 0
    nodes: int = 0


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes one token's keys and values take in every layer of `model`'s cache."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * element


def unsupported(cache: DynamicCache) -> str:
    """Why a cache of this kind cannot be sliced into prefixes ("" when it can): a sliding window
    forgets entries, and layers without plain key and value tensors cannot be cut by position."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            return "it has sliding-window layers, whose entries depend on what the window forgot"
        if type(layer).__name__ != "DynamicLayer":
            return f"its cache layers are {type(layer).__name__}, not plain key and value tensors"
    return ""


class PromptCache:
    """A radix tree of cached prompt prefixes under a byte budget; safe to share between threads."""

    def __init__(self, max_bytes: int):
        self.max_bytes = check_int(max_bytes, "prompt_cache_bytes", 0)
        self._root = _Node((), [], None)
        self._bound: tuple | None = None
        self._lock = threading.Lock()
        self._stats = PromptCacheStats(max_bytes=max_bytes)

    @classmethod
    def for_model(cls, model: torch.nn.Module, max_bytes: int | None = None) -> PromptCache:
        """A cache for `model`'s entries: `max_bytes`, or None for room for `DEFAULT_TOKENS` tokens;
        off (0 bytes, with one log line) for a model whose cache cannot be cut into prefixes."""
        reason = unsupported(make_cache(model))
        if reason:
            logger.info("prompt cache off for %s: %s", type(model).__name__, reason)
            return cls(0)
        return cls(DEFAULT_TOKENS * kv_bytes_per_token(model) if max_bytes is None else max_bytes)

    def stats(self) -> PromptCacheStats:
        with self._lock:
            return PromptCacheStats(**vars(self._stats))

    def clear(self) -> None:
        with self._lock:
            self._root = _Node((), [], None)
            self._stats.bytes = self._stats.nodes = 0

    def load(self, model: torch.nn.Module, tokens: Sequence[int], cache: DynamicCache) -> int:
        """Copy the entries of the longest cached prefix of `tokens` into the empty `cache`; how many."""
        with self._lock:
            self._bind(model)
            path, matched = self._walk(tokens)
            if matched == 0:
                self._stats.misses += 1
                return 0
            now = time.monotonic()
            for node in path:
                node.last_used = now
            for layer in range(len(path[0].entries)):
                keys = torch.cat([node.entries[layer][0] for node in path], dim=-2)
                values = torch.cat([node.entries[layer][1] for node in path], dim=-2)
                cache.update(keys[..., :matched, :], values[..., :matched, :], layer)
            self._stats.hits += 1
            self._stats.tokens_reused += matched
            return matched

    def insert(self, model: torch.nn.Module, tokens: Sequence[int], cache: DynamicCache) -> None:
        """Cache the entries of `tokens`, which `cache` holds in order from its first position."""
        if self.max_bytes <= 0 or not tokens:
            return
        with self._lock:
            self._bind(model)
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
        parameter = next(model.parameters())
        key = (id(model), parameter.dtype, parameter.device, getattr(model.config, "_attn_implementation", None))
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
        """Evict least recently used leaves (never `keep` or its ancestors) until `needed` bytes fit."""
        if needed > self.max_bytes:
            return False
        protected = set()
        node = keep
        while node is not None:
            protected.add(id(node))
            node = node.parent
        while self._stats.bytes + needed > self.max_bytes:
            leaves = [n for n in self._nodes() if not n.children and id(n) not in protected]
            if not leaves:
                return False
            victim = min(leaves, key=lambda n: n.last_used)
            del victim.parent.children[victim.tokens[0]]
            self._stats.bytes -= victim.bytes
            self._stats.nodes -= 1
            self._stats.evictions += 1
        return True

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
