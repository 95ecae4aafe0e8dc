"""The frequency trie the retrieval drafters draft from: count continuations, keep the most frequent nodes.

Each node counts how many of the continuations start with the path from the root to it, so a
node's count is the number of retrieved places that support drafting it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from ..tree import ROOT, DraftTree

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


def best_subtree(trie: Trie, budget: int, source: str, agreement: float = 1.0) -> DraftTree:
    """The `budget` most frequent nodes of `trie` as a draft tree whose nodes all come from `source`.

    A node's score, the chance the target accepts it, is the share of continuations agreeing
    with its path times `agreement ** depth` (how often the target follows such drafts per token).
    """
    # A child is never more frequent than its parent, so popping the most frequent frontier
    # node yields the top-`budget` nodes as a connected tree; `order` breaks ties by insertion.
    heap = [(-count, order, token, ROOT, children) for order, (token, (count, children)) in enumerate(trie.items())]
    heapq.heapify(heap)
    total = sum(count for count, _ in trie.values())
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    order = len(heap)
    while heap and len(tokens) < budget:
        negative_count, _, token, parent, children = heapq.heappop(heap)
        index = len(tokens)
        tokens.append(token)
        parents.append(parent)
        depths.append(1 if parent == ROOT else depths[parent] + 1)
        scores.append(-negative_count / total * agreement ** depths[-1])
        for child_token, (count, grandchildren) in children.items():
            heapq.heappush(heap, (-count, order, child_token, index, grandchildren))
            order += 1
    return DraftTree(tokens, parents, [source] * len(tokens), scores)
