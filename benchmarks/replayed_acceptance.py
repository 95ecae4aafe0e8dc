"""A drafter that replays how much of its drafts a real model accepted, for models at random weights.

A model's forward costs the same whatever its weights, but its agreement with a drafter does not:
at random weights the trie's drafts over real documents are never accepted. To run the engine's
whole loop at the 1.5B and 7B shapes, whose real weights a GPU machine may not have, this drafter
is handed the target's own greedy continuation of each prompt (computed once, by plain decoding)
and proposes, each step, the next k true tokens followed by wrong ones, so that the target accepts
exactly k; k is drawn, with a fixed seed, from the acceptance the real Qwen2.5-Coder-1.5B measured
on the CPU per category (`benchmarks/acceptance.py`).

That benchmark stores each item's mean decode tokens per target forward, not which draft tokens
were accepted step by step, so the replay is of a distribution: k is the run of successes, each
with probability r, cut at the draft budget (a truncated geometric), with r chosen so that the mean
of k is the category's measured mean less one. Each node's score is r ** depth, the chance the
replay accepts it, so the engine's budget keeps as much of the draft as its measured cost curve
says pays, as it does a real drafter's.
"""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rag_speculate.decoding.tree import DraftTree
from rag_speculate.decoding.verify import Verification
from rag_speculate.drafters.base import DraftContext, Drafter

ACCEPTANCE = Path(__file__).resolve().parent / "results" / "acceptance_fp32.json"


def measured_acceptance(budget: int, path: Path = ACCEPTANCE) -> dict[str, float]:
    """{category: mean decode tokens per target forward over its items} at draft budget `budget`, as
    `benchmarks/acceptance.py` wrote them to `path`."""
    runs = [run for run in json.loads(path.read_text())["runs"] if run["budget"] == budget]
    if not runs:
        raise ValueError(f"{path} has no runs at draft budget {budget}")
    categories = sorted({run["category"] for run in runs})
    return {c: statistics.mean(r["tokens_per_forward"] for r in runs if r["category"] == c) for c in categories}


def continue_probability(accepted: float, budget: int) -> float:
    """r such that a run of successes each of probability r, cut at `budget`, has mean `accepted`
    (sum of r ** j for j = 1 .. budget), found by bisection."""
    if not 0 <= accepted < budget:
        raise ValueError(f"a mean of {accepted} accepted tokens a step is outside [0, {budget})")
    low, high = 0.0, 1.0
    for _ in range(60):
        r = (low + high) / 2
        low, high = (r, high) if sum(r**j for j in range(1, budget + 1)) < accepted else (low, r)
    return (low + high) / 2


@dataclass(frozen=True)
class Plan:
    """One prompt's replay: the target's greedy continuation of it, the chance `r` each next draft
    token is accepted, the seed of its draws and the category it is counted under."""

    continuation: list[int]
    r: float
    seed: int
    category: str


class ReplayedAcceptanceDrafter(Drafter):
    """Drafts for the prompts of `plans` (keyed by their token ids) so that each step the target
    accepts a replayed number of tokens; `tally` (shared by its forks) counts per category the steps,
    the tokens the replay drew, those of them the engine verified (its budget may cut a draft) and
    those the target accepted."""

    name = "replayed"

    def __init__(self, plans: dict[tuple[int, ...], Plan], tally: Counter | None = None):
        self.plans, self.tally = plans, Counter() if tally is None else tally
        self._plan: Plan | None = None
        self._prompt = self._vocab = 0
        self._rng = random.Random(0)
        self._planned = 0

    def start(self, context: DraftContext) -> None:
        plan = self.plans.get(tuple(context.prompt_ids))
        if plan is None:
            raise ValueError("a prompt the replay has no continuation for")
        self._plan, self._prompt, self._vocab = plan, len(context.prompt_ids), context.vocab_size
        self._rng = random.Random(plan.seed)

    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        plan = self._plan
        position = len(tokens) - self._prompt  # new tokens so far: the continuation's next is at this index
        ahead = plan.continuation[position : position + budget]
        k = 0
        while k < len(ahead) and self._rng.random() < plan.r:
            k += 1
        self._planned = k
        if not ahead:
            return DraftTree.empty()
        # The first wrong token stops the target; those after it only fill the draft.
        wrong = [(ahead[k] + 1) % self._vocab] * (len(ahead) - k) if k < len(ahead) else []
        draft = ahead[:k] + wrong
        tree = DraftTree.chain(draft)
        return DraftTree(tree.tokens, tree.parents, scores=[plan.r**depth for depth in range(1, len(draft) + 1)])

    def observe(self, verification: Verification) -> None:
        # The engine may verify less of the draft than the replay meant to be accepted: both are counted.
        category = self._plan.category
        self.tally[category, "steps"] += 1
        self.tally[category, "drawn"] += self._planned
        self.tally[category, "planned"] += min(self._planned, len(verification.tree))
        self.tally[category, "accepted"] += len(verification.accepted_nodes)
