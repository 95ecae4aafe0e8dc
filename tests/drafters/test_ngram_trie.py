"""The n-gram trie drafter against the paper's construction, built naively by hand."""

from __future__ import annotations

import random

import pytest

from rag_speculate import DraftContext, DraftTree, NGramTrieDrafter
from rag_speculate.decoding.tree import tree_attention_mask, tree_position_ids


def paper_trie(tokens: list[int], n: int, max_prefix: int) -> dict:
    """Algorithm 1 of the paper, literally: every window, every sub-prefix + suffix, counted."""
    root: dict = {}
    for i in range(len(tokens) - max_prefix + 1):
        window = tokens[i : i + n]
        prefix, suffix = window[:max_prefix], window[max_prefix:]
        for j in range(max_prefix):
            node = root
            for t in prefix[j:] + suffix:
                child = node.setdefault(t, [0, {}])
                child[0] += 1
                node = child[1]
    return root


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    out = set()
    for i in range(len(tree)):
        path, node = [], i
        while node != -1:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        out.add(tuple(reversed(path)))
    return out


def subtree_paths(node: dict, prefix=()) -> dict[tuple[int, ...], int]:
    out = {}
    for t, (count, children) in node.items():
        out[prefix + (t,)] = count
        out.update(subtree_paths(children, prefix + (t,)))
    return out


@pytest.mark.parametrize(
    "alphabet, vocab_size, n, max_prefix",
    [
        (range(12), 12, 8, 3),
        # Ids at both ends of a large vocabulary, and more tokens to a query than fit one 64-bit key of
        # ids side by side: the index's keys tell every n-gram apart all the same.
        ((0, 1, 65_535, 65_536, 199_998, 199_999), 200_000, 9, 5),
    ],
)
def test_draft_is_the_paper_tries_subtree_for_the_longest_matching_query(alphabet, vocab_size, n, max_prefix):
    rng = random.Random(0)
    doc = [rng.choice(alphabet) for _ in range(400)]
    drafter = NGramTrieDrafter(n=n, max_prefix=max_prefix, learn_from_output=False)
    drafter.start(DraftContext(prompt_ids=[], document_ids=[doc], vocab_size=vocab_size))
    reference = paper_trie(doc, n, max_prefix)
    for _ in range(30):
        query = doc[rng.randrange(len(doc) - max_prefix) :][:max_prefix]
        node = reference
        for t in query:
            node = node[t][1]
        want = subtree_paths(node)
        tree = drafter.propose([vocab_size + 1, *query], budget=10_000)
        assert paths(tree) == set(want)


def test_budget_keeps_the_connected_nodes_most_likely_accepted():
    doc = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7]
    drafter = NGramTrieDrafter(n=5, max_prefix=2, learn_from_output=False)
    drafter.start(DraftContext([], [doc], 10))
    tree = drafter.propose([0, 1, 2], budget=3)
    # After "1 2": "3" 3 of 4 times, "5" once; after "1 2 3": "4" twice, "7" once; then "1" twice.
    # With a 2-token match's prior agreement a = 0.7 per token: 3 scores 3/4 a, 4 2/4 a^2, and
    # then 5 (1/4 a = 0.175) beats the deeper 1 (2/4 a^3 = 0.17).
    assert tree.tokens == [3, 4, 5]
    assert tree.parents == [-1, 0, -1]


def test_backs_off_to_shorter_queries_and_stops_at_document_boundaries():
    drafter = NGramTrieDrafter(n=6, max_prefix=3, learn_from_output=False)
    drafter.start(DraftContext(prompt_ids=[9, 9], document_ids=[[5, 6, 7], [8, 1, 2]], vocab_size=10))
    # No "0 5 6" or "5 6"... "6" is followed by 7 only, and 7 ends its document.
    assert drafter.propose([0, 0, 6], 8).tokens == [7]
    assert drafter.propose([0, 0, 7], 8).tokens == []
    assert len(drafter.propose([4, 4, 4], 8)) == 0


def test_output_is_indexed_as_it_grows():
    drafter = NGramTrieDrafter(n=6, max_prefix=2)
    prompt = [1, 2]
    drafter.start(DraftContext(prompt_ids=prompt, document_ids=[], vocab_size=10))
    generated = [5, 6, 7, 8, 5]
    tree = drafter.propose(prompt + generated, budget=4)
    assert tree.tokens == [6, 7, 8, 5]


def test_tree_mask_and_positions():
    import torch

    tree = DraftTree([10, 11, 12, 13], [-1, 0, -1, 2])
    mask = tree_attention_mask(tree, past_length=3, dtype=torch.float32, device=torch.device("cpu"))[0, 0]
    visible = (mask == 0).int().tolist()
    assert visible == [
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 1, 1],
    ]
    assert mask.min() == torch.finfo(torch.float32).min
    assert tree_position_ids(tree, 3, torch.device("cpu")).tolist() == [[3, 4, 5, 4, 5]]
    assert tree.longest_branch().tokens == [10, 11]
    assert tree.truncated(max_nodes=3, max_depth=1).tokens == [10, 12]
