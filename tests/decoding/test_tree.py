"""Property tests of the draft tree's operations: every tree the engine or a drafter builds stays a tree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_speculate import DraftTree, RagSpeculateError
from rag_speculate.decoding.tree import ROOT, tree_attention_mask, tree_position_ids

settings.register_profile("tree", max_examples=200, deadline=None)
settings.load_profile("tree")


@st.composite
def trees(draw, max_nodes: int = 24, scored: bool | None = None) -> DraftTree:
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(ROOT, i - 1)) for i in range(n)]
    # Few distinct tokens, so equal siblings and equal paths occur.
    tokens = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    has_scores = draw(st.booleans()) if scored is None else scored
    sources = draw(st.lists(st.sampled_from(["a", "b"]), min_size=n, max_size=n)) if draw(st.booleans()) else []
    scores = draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)) if has_scores else []
    return DraftTree(tokens, parents, sources, scores)


def node_set(tree: DraftTree) -> list[tuple]:
    """Each node as (path, source, score): what survives any reordering."""
    return sorted((path, tree.source(i), tree.scores[i] if tree.scores else None) for i, path in enumerate(tree.paths()))


@given(trees())
def test_paths_follow_parents(tree):
    paths, depths = tree.paths(), tree.depths()
    for i, (path, parent) in enumerate(zip(paths, tree.parents)):
        assert len(path) == depths[i]
        assert path[-1] == tree.tokens[i]
        assert path[:-1] == (paths[parent] if parent != ROOT else ())


@given(trees(scored=True))
def test_best_first_lists_parents_first_by_descending_capped_score(tree):
    ordered = tree.best_first()
    assert len(ordered) == len(tree)
    assert ordered.scores == sorted(ordered.scores, reverse=True)
    for i, parent in enumerate(ordered.parents):
        assert parent < i
        assert parent == ROOT or ordered.scores[i] <= ordered.scores[parent]
    # The same nodes, paths and sources kept, each score capped at its parent's (capped) score.
    capped: list[float] = []
    for score, parent in zip(tree.scores, tree.parents):
        capped.append(score if parent == ROOT else min(score, capped[parent]))
    capped_tree = DraftTree(tree.tokens, tree.parents, tree.sources, capped)
    assert node_set(ordered) == node_set(capped_tree)
    # Ordering an ordered tree changes nothing.
    assert ordered.best_first() == ordered


@given(trees(scored=False))
def test_best_first_without_scores_keeps_the_tree(tree):
    assert tree.best_first() is tree


@given(trees(), st.integers(0, 30), st.integers(0, 30))
def test_truncated_keeps_a_prefix_closed_subtree_within_both_limits(tree, max_nodes, max_depth):
    cut = tree.truncated(max_nodes, max_depth)
    assert len(cut) <= max_nodes
    assert all(d <= max_depth for d in cut.depths())
    # Exactly the first max_nodes nodes whose whole path lies within them and within the depth.
    depths, kept = tree.depths(), set()
    for i in range(min(max_nodes, len(tree))):
        if depths[i] <= max_depth and (tree.parents[i] == ROOT or tree.parents[i] in kept):
            kept.add(i)
    assert node_set(cut) == node_set(tree.subset(sorted(kept)))


@given(trees())
def test_subset_of_a_prefix_closed_set_keeps_every_path(tree):
    keep = [i for i, p in enumerate(tree.parents) if p == ROOT or p % 2 == 0]
    keep = [i for i in keep if all(a in keep or a == ROOT for a in _ancestors(tree, i))]
    sub = tree.subset(keep)
    assert sub.paths() == [tree.paths()[i] for i in keep]
    assert [sub.source(j) for j in range(len(sub))] == [tree.source(i) for i in keep]


@given(trees(max_nodes=12), trees(max_nodes=12), st.data())
def test_graft_hangs_the_other_tree_below_a_node(tree, other, data):
    at = data.draw(st.integers(ROOT, len(tree) - 1))
    grown = tree.graft(other, at)
    prefix = tree.paths()[at] if at != ROOT else ()
    assert grown.paths() == tree.paths() + [prefix + p for p in other.paths()]
    if tree.sources and other.sources:
        assert grown.sources == tree.sources + other.sources
    if tree.scores and other.scores:
        assert grown.scores == tree.scores + other.scores


@given(trees())
def test_longest_branch_is_one_of_the_deepest_paths(tree):
    branch = tree.longest_branch()
    assert branch.parents == list(range(-1, len(branch) - 1))
    assert len(branch) == max(tree.depths(), default=0)
    if tree.tokens:
        assert tuple(branch.tokens) in tree.paths()


@given(trees())
def test_children_let_the_first_of_equal_siblings_win(tree):
    children = tree.children()
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        first = next(j for j in range(len(tree)) if tree.parents[j] == parent and tree.tokens[j] == token)
        assert children[parent][token] == first


@given(trees(max_nodes=10), st.integers(0, 5))
def test_each_query_sees_the_cache_itself_and_its_ancestors_at_its_depth(tree, past):
    mask = tree_attention_mask(tree, past, torch.float32, torch.device("cpu"))[0, 0]
    positions = tree_position_ids(tree, past, torch.device("cpu"))[0].tolist()
    assert positions == [past] + [past + d for d in tree.depths()]
    for row in range(len(tree) + 1):
        seen = {col for col in range(len(tree) + 1) if mask[row, past + col] == 0}
        node = row - 1
        assert seen == {0, row} | {a + 1 for a in _ancestors(tree, node) if a != ROOT}
        assert bool((mask[row, :past] == 0).all())


def test_a_tree_refuses_parents_after_children_and_mismatched_lists():
    with pytest.raises(RagSpeculateError, match="parents must precede children"):
        DraftTree([1, 2], [1, ROOT])
    with pytest.raises(RagSpeculateError, match="2 tokens but 1 parents"):
        DraftTree([1, 2], [ROOT])
    with pytest.raises(RagSpeculateError, match="scores must have one entry per token"):
        DraftTree([1, 2], [ROOT, 0], scores=[0.5])


def _ancestors(tree: DraftTree, node: int) -> list[int]:
    out = []
    while node != ROOT:
        node = tree.parents[node]
        out.append(node)
    return out
