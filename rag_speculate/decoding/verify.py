"""Which of a verified draft the target accepts, losslessly.

One forward of the unmodified model (forward.py for one sequence, batch.py for several) gives the
logits of [root, *draft]; the cache then keeps only the accepted path's KV entries (gathered in
place, never recomputed).

Acceptance walks down from the root: at each node the target picks a token (argmax, or a sample
of its warped distribution); if a child carries that token we descend, otherwise that token is
the bonus and we stop. Every emitted token is therefore exactly the target's own choice.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling import SamplingParams, sample_token
from .tree import ROOT, DraftTree


@dataclass(frozen=True)
class Verification:
    """What one verification step found; drafters learn from it."""

    tree: DraftTree
    accepted_nodes: list[int]
    # The accepted draft tokens followed by the target's own next token (the bonus).
    accepted_tokens: list[int]
    # The target's greedy choice after the root (index 0) and after each draft node (index i + 1),
    # including nodes that were rejected: drafters use them to refine their candidates.
    target_tokens: list[int]


def greedy_choices(logits: Sequence[torch.Tensor]) -> list[list[int]]:
    """Each of several forwards' rows' argmax, read to the host at once: on a GPU every read waits for
    the device, so a step reads its rows' choices once, not once a row."""
    flat = torch.cat([rows.argmax(dim=-1) for rows in logits]).tolist()
    ends = list(itertools.accumulate(len(rows) for rows in logits))
    return [flat[end - len(rows) : end] for rows, end in zip(logits, ends)]


def accept(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    target_tokens: list[int] | None = None,
) -> Verification:  # fmt: skip
    """Walk the tree, following a child only when it carries the target's own choice (`target_tokens`:
    the rows' argmax, where `greedy_choices` read them already)."""
    target_tokens = logits.argmax(dim=-1).tolist() if target_tokens is None else target_tokens
    children = tree.children()
    node, path = ROOT, []
    while True:
        row = node + 1
        choice = target_tokens[row] if params.greedy else sample_token(logits[row], params, generator)
        child = children.get(node, {}).get(choice)
        if child is None:
            return Verification(tree, path, [tree.tokens[i] for i in path] + [choice], target_tokens)
        path.append(child)
        node = child
