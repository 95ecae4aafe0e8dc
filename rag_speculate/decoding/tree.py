"""The draft tree: what a drafter proposes and what the target verifies in one forward.

Node 0 of the flattened verification input is the root: the last accepted token, not yet in the
KV cache. Draft node `i` sits at flattened position `i + 1`; its parent is `parents[i]`, with -1
meaning the root. Parents always come before their children, so one left-to-right pass computes
depths and ancestor sets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import RagSpeculateError

ROOT = -1


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]
    parents: list[int]
    # Which drafter proposed each node, so acceptance can be credited per source.
    sources: list[str] = field(default_factory=list)
    # The drafter's estimate that the target accepts each node (its whole path): the engine lists
    # the nodes best first by it and verifies only as many as pay for their cost.
    scores: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise RagSpeculateError(
                f"draft tree has {len(self.tokens)} tokens but {len(self.parents)} parents"
            )
        for name in ("sources", "scores"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.tokens):
                raise RagSpeculateError(f"draft tree {name} must have one entry per token")
        for i, p in enumerate(self.parents):
            if not ROOT <= p < i:
                raise RagSpeculateError(f"draft node {i} has parent {p}; parents must precede children")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def empty(cls) -> DraftTree:
        return cls([], [])

    @classmethod
    def chain(cls, tokens: list[int], source: str = "") -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), [source] * len(tokens) if source else [])

    def source(self, i: int) -> str:
        return self.sources[i] if self.sources else ""

    def depths(self) -> list[int]:
        """Depth of each node; the root's children have depth 1."""
        return fed_depths(self.fed_parents(), len(self) + 1)[1:].tolist()

    def fed_parents(self) -> list[int]:
        """Each token's parent among [root, *tokens] as a forward feeds them: the root's is ROOT (the
        cached entries alone), draft node i's the place of its parent, the root's being 0."""
        return [ROOT, *(p + 1 for p in self.parents)]

    def children(self) -> dict[int, dict[int, int]]:
        """parent -> {token: child}; the first of duplicate siblings wins, later ones can never be accepted."""
        out: dict[int, dict[int, int]] = {}
        for i, (tok, p) in enumerate(zip(self.tokens, self.parents)):
            out.setdefault(p, {}).setdefault(tok, i)
        return out

    def truncated(self, max_nodes: int, max_depth: int | None = None) -> DraftTree:
        """The nodes among the first `max_nodes` whose depth is at most `max_depth` (a valid subtree)."""
        max_depth = max_nodes if max_depth is None else max_depth
        if len(self) <= max_nodes and (not self.tokens or max(self.depths()) <= max_depth):
            return self
        keep: dict[int, int] = {ROOT: ROOT}
        for i, (d, p) in enumerate(zip(self.depths(), self.parents)):
            if i >= max_nodes:
                break
            if d <= max_depth and p in keep:
                keep[i] = len(keep) - 1
        return self.subset([i for i in keep if i != ROOT])

    def best_first(self) -> DraftTree:
        """The same tree, nodes listed by descending score (the order `truncated` and the engine's
        budget read). A node's score is capped at its parent's, so every prefix of the list is a
        tree; ties keep the given order, which lists parents first."""
        if not self.scores:
            return self
        capped: list[float] = []
        for score, p in zip(self.scores, self.parents):
            capped.append(score if p == ROOT else min(score, capped[p]))
        order = sorted(range(len(self)), key=lambda i: (-capped[i], i))
        return dataclasses.replace(self, scores=capped).subset(order)

    def subset(self, nodes: list[int]) -> DraftTree:
        """The given nodes, in that order; each one's parent must be among them, earlier (or the root)."""
        position = {ROOT: ROOT} | {old: new for new, old in enumerate(nodes)}
        return DraftTree(
            [self.tokens[i] for i in nodes],
            [position[self.parents[i]] for i in nodes],
            [self.sources[i] for i in nodes] if self.sources else [],
            [self.scores[i] for i in nodes] if self.scores else [],
        )

    def graft(self, other: DraftTree, at: int = ROOT) -> DraftTree:
        """`other` hung below node `at` (ROOT: beside this tree's own top nodes), after this tree's
        nodes, so between equal siblings this tree's win. Sources and scores are kept where both
        trees have them."""
        if not other.tokens:
            return self
        if not self.tokens and at == ROOT:
            return other
        offset = len(self)
        parents = self.parents + [at if p == ROOT else p + offset for p in other.parents]

        def joined(mine: list, theirs: list) -> list:
            return mine + theirs if mine and theirs else []

        return DraftTree(self.tokens + other.tokens, parents, joined(self.sources, other.sources), joined(self.scores, other.scores))

    def paths(self) -> list[tuple[int, ...]]:
        """Each node's tokens from the root down to it: equal paths are the same draft, whatever tree holds them."""
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(self.tokens, self.parents):
            paths.append((*(paths[parent] if parent != ROOT else ()), token))
        return paths

    def longest_branch(self) -> DraftTree:
        """The deepest root-to-leaf path, for models that can only verify a single chain."""
        if not self.tokens:
            return self
        depths = self.depths()
        node = int(np.argmax(depths))
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        path.reverse()
        return self.subset(path)


def fed_visibility(parents: Sequence[int] | None, count: int) -> np.ndarray:
    """`[count, count]`: whom each of `count` fed tokens sees among them: itself and its ancestors.
    `parents`: each one's parent among the fed (ROOT: the cached entries alone); None: a chain, each
    after the one before."""
    if parents is None:
        return np.tril(np.ones((count, count), dtype=bool))
    visible = np.eye(count, dtype=bool)
    for i, p in enumerate(parents):
        if p != ROOT:
            visible[i] |= visible[p]
    return visible


def fed_depths(parents: Sequence[int] | None, count: int) -> np.ndarray:
    """Depth of each of `count` fed tokens below the cached entries, those with no parent among the
    fed at 0 (`parents` as `fed_visibility` takes them): their positions, less the cache's length."""
    if parents is None:
        return np.arange(count)
    depths = np.zeros(count, dtype=np.int64)
    for i, p in enumerate(parents):
        depths[i] = 0 if p == ROOT else depths[p] + 1
    return depths


def additive_mask(visible: np.ndarray, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive float mask `[..., q, past + k]` over the keys: every query sees the first `past` (the
    cache), and of the `k` after them those `visible` `[..., q, k]` marks.

    Additive float, never boolean: eager attention adds the mask to the scores, so a boolean mask
    would silently let every token see every other one.
    """
    # Built on the model's device: only the visibility matrix crosses from the host, not the past's columns.
    shape = (*visible.shape[:-1], past + visible.shape[-1])
    mask = torch.full(shape, torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[..., :past] = 0
    mask[..., past:].masked_fill_(torch.from_numpy(visible).to(device, non_blocking=True), 0)
    return mask


def capacity_mask(lengths: torch.Tensor, visible: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """`additive_mask` for rows of a preallocated cache, built on the device from small inputs so that a
    CUDA graph can replay it: `[rows, 1, q, capacity]`, row b's queries seeing its first `lengths[b]`
    entries and, of the q after them, those `visible[b]` `[q, q]` marks; any column past `capacity`
    is dropped."""
    rows, q = visible.shape[:2]
    # Each column's place among the row's fed tokens (negative: a cached entry).
    offset = torch.arange(capacity, device=lengths.device)[None] - lengths[:, None]
    fed = visible.gather(2, offset.clamp(0, q - 1)[:, None].expand(rows, q, capacity)) & ((offset >= 0) & (offset < q))[:, None]
    mask = torch.full((rows, q, capacity), torch.finfo(dtype).min, dtype=dtype, device=lengths.device)
    return mask.masked_fill_(fed | (offset < 0)[:, None], 0)[:, None]


def tree_attention_mask(tree: DraftTree, past_length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive 4D mask (1, 1, q, past + q): every query sees the whole cache, itself and its ancestors."""
    return additive_mask(fed_visibility(tree.fed_parents(), len(tree) + 1), past_length, dtype, device)[None, None]


def tree_position_ids(tree: DraftTree, past_length: int, device: torch.device) -> torch.Tensor:
    """Position of each flattened node: cached length + depth, so every branch reads as a normal continuation."""
    return (torch.from_numpy(fed_depths(tree.fed_parents(), len(tree) + 1)).to(device) + past_length)[None]
