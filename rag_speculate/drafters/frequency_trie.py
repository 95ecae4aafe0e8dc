"""The frequency trie the retrieval drafters draft from: count continuations, keep the most frequent nodes.

Each node counts how many of the continuations start with the path from the root to it, so a
node's count is the number of retrieved places that support drafting it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from ..decoding.tree import ROOT, DraftTree

# token -> [count, children]; lists rather than a class keep insertion cheap on the drafting path.
Trie = dict[int, list]


def frequency_trie(continuations: Iterable[Iterable[int]]) -> Trie:
    """Every prefix of every continuation, counted once per continuation that starts with it."""
    trie: Trie = {}
    for continuation in continuations:
        level = trie
        for token in continuation:
            node = level.setdefault(token, [0, {}])
            node[0] += 1
            level = node[1]
    return trie


def best_subtree(trie: Trie, budget: int, source: str, agreement: float = 1.0, reach: float = 1.0) -> DraftTree:
    """The `budget` nodes of `trie` most likely accepted, as a draft tree whose nodes all come from `source`.

    A node's score, the chance the target accepts it, is `reach` (the chance its root is reached)
    times the share of continuations agreeing with its path times `agreement ** depth` (how often
    the target follows such drafts per token). A child never outscores its parent, so popping the
    best frontier node lists parents before children and scores best first; ties keep insertion order.
    """
    total = sum(count for count, _ in trie.values())
    heap = [(-reach * count / total * agreement, order, token, ROOT, 1, children) for order, (token, (count, children)) in enumerate(trie.items())]
    heapq.heapify(heap)
    order = len(heap)
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    while heap and len(tokens) < budget:
        negative, _, token, parent, depth, children = heapq.heappop(heap)
        index = len(tokens)
        tokens.append(token)
        parents.append(parent)
        scores.append(-negative)
        for child, (count, grandchildren) in children.items():
            heapq.heappush(heap, (-reach * count / total * agreement ** (depth + 1), order, child, index, depth + 1, grandchildren))
            order += 1
    return DraftTree(tokens, parents, [source] * len(tokens), scores)
