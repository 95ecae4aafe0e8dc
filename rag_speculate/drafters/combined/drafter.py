"""One draft tree from several drafters, under one budget.

Every drafter proposes; equal paths merge into one node; the `budget` nodes with the best
acceptance estimates are kept (a node never ranks above its parent, so the kept nodes form a
tree). Each drafter then sees the verification of its own nodes only, as if it had drafted alone,
so the rates it learns stay its own.

Estimates are only as good as each drafter's calibration, and drafting time is not free: a
drafter that runs a model can cost a quarter of a target forward per proposal on a CPU. So the
combined drafter keeps, per drafter and across generations, how its own estimates (before any
rescaling) compare with what was accepted on the nodes it ranked itself (and rescales them;
that evidence fades only when its nodes are verified again, so a retrieval drafter whose drafts
a translation rejects stays distrusted), and how many tokens per second the steps yield with it
against without it (the tokens the other drafters' trees would have covered, over the time
without its drafting). Each generation judges a drafter afresh, once it has drafted in a few
steps, with earlier generations' averages weighing as a few steps (one rejected draft is no
verdict: a draft model that helps on average often misses its first); one that does not pay is
skipped, and tried again after 4, 8, ... 64 steps. A drafter
that paces itself (`Drafter.paces_itself`: Ouroboros pauses for 1, 2, 4, ... proposals after a
draft the engine verified none of and is back after any verified one) is not judged so: averages over a
translation miss the short stretches where the draft model predicts it. It is still retried on
that schedule where the per-step test below kept it off.

Within a step the drafters run cheapest first, and a dear one runs only when what the cheaper
ones found is expected to yield fewer tokens per second than its own usual yield would at its
cost: where the documents' trie has a long confident match, the draft model is not asked.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import NamedTuple

from ...decoding.tree import ROOT, DraftTree
from ...decoding.verify import Verification
from ...errors import InvalidArgumentError
from ..agreement import running_mean
from ..base import DraftContext, Drafter, Target
from .config import CombinedConfig
from .ledger import Ledger

Path = tuple[int, ...]


class _Proposal(NamedTuple):
    tree: DraftTree
    paths: list[Path]
    scores: list[float]  # its drafter's own estimates, what its calibration is counted against
    estimates: list[float]  # the scores rescaled by its drafter's calibration when it proposed


class CombinedDrafter(Drafter):
    name = "combined"

    def __init__(self, drafters: Sequence[Drafter], *, skip_unpaid: bool = True, config: CombinedConfig | None = None):
        """`skip_unpaid=False` keeps every drafter on every step, whatever its time costs."""
        drafters = list(drafters)
        if not drafters or not all(isinstance(d, Drafter) for d in drafters):
            raise InvalidArgumentError("CombinedDrafter needs a non-empty list of drafters")
        names = [d.name for d in drafters]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"drafter names must be distinct to credit their tokens, got {names}")
        self.drafters = drafters
        self.skip_unpaid = skip_unpaid
        self.config = config = config or CombinedConfig()
        self._ledgers = {
            d.name: Ledger(config, config.self_paced_calibration_prior if d.paces_itself else config.calibration_prior)
            for d in drafters
        }
        self._target_s = 0.0
        self._steps = 0
        self._proposals: dict[str, _Proposal] = {}
        self._ranked_by: dict[Path, str] = {}  # the drafter whose estimate ranked each merged path
        self._proposed_at = 0.0

    def attach(self, target: Target) -> None:
        for drafter in self.drafters:
            drafter.attach(target)

    def fork(self) -> CombinedDrafter:
        """Each drafter forked; what each has earned so far copied."""
        other = CombinedDrafter([d.fork() for d in self.drafters], skip_unpaid=self.skip_unpaid, config=self.config)
        other._ledgers = copy.deepcopy(self._ledgers)
        other._target_s, other._steps = self._target_s, self._steps
        return other

    def start(self, context: DraftContext) -> None:
        for drafter in self.drafters:
            drafter.start(context)
            # Whether a drafter pays depends on the text (a draft model predicts arithmetic, not a
            # translation), so it is judged afresh in each generation; its calibration carries
            # over, and its averages as a few steps' worth of evidence.
            ledger = self._ledgers[drafter.name]
            ledger.samples = min(ledger.samples, self.config.carried)
            ledger.trial, ledger.skipped_for, ledger.retry_after = 0, 0, self.config.first_retry

    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        self._proposals = {}
        total_s = sum(self._ledgers[d.name].propose_s for d in self.drafters)
        for drafter in sorted(self.drafters, key=lambda d: self._ledgers[d.name].propose_s):
            ledger = self._ledgers[drafter.name]
            # A retry always drafts: it is how a drafter skipped on stale evidence is measured again
            # (also one that paces itself: one slow proposal, a long catch-up, must not keep it off).
            retry = ledger.skipped_for >= ledger.retry_after
            if not retry and not self._should_ask(drafter, ledger, total_s):
                ledger.skipped_for += 1
                continue
            ledger.skipped_for = 0
            ledger.retry_after = min(2 * ledger.retry_after, self.config.last_retry) if retry else self.config.first_retry
            started = time.perf_counter()
            tree = drafter.propose(tokens, budget)
            ledger.propose_s = ledger.average(ledger.propose_s, time.perf_counter() - started)
            scores = _scores(tree)
            estimates = [min(1.0, score * ledger.calibration.rate) for score in scores]
            self._proposals[drafter.name] = _Proposal(tree, tree.paths(), scores, estimates)
        merged = self._merge(budget)
        self._proposed_at = time.perf_counter()
        return merged

    def _should_ask(self, drafter: Drafter, ledger: Ledger, total_s: float) -> bool:
        if not self.skip_unpaid:
            return True
        if self._judged(drafter, ledger) and not ledger.pays(self._target_s, total_s - ledger.propose_s):
            return False
        return self._worth_asking(drafter, ledger)

    def _worth_asking(self, drafter: Drafter, ledger: Ledger) -> bool:
        """Whether this step is expected to yield at least as many tokens per second with the drafter
        as with what the drafters asked so far found.

        Its tokens count only where theirs fail at the first token: retrieval drafts are all or
        nothing (a quoted sentence, or a wrong match), so their expected yield alone would hide
        how often the dear drafter is the one that delivers. Until its trial is over its yield is
        taken as at least one token, so one rejected draft does not keep it off the steps where
        the others found nothing; so always for a drafter that paces itself, whose pauses already
        spare the steps where it expects nothing.
        """
        if not self._proposals or self._target_s <= 0:
            return True
        own = ledger.own_tokens if self._judged(drafter, ledger) else max(ledger.own_tokens, 1.0)
        found = max(sum(p.estimates) for p in self._proposals.values())
        first = max(
            (score for p in self._proposals.values() for score, parent in zip(p.estimates, p.tree.parents) if parent == ROOT),
            default=0.0,
        )
        with_it = (1 + found + (1 - first) * own) / (self._target_s + ledger.propose_s)
        return with_it >= (1 - self.config.tolerance) * (1 + found) / self._target_s

    def _merge(self, budget: int) -> DraftTree:
        """The `budget` best nodes of all proposals, equal paths merged, best first."""
        best: dict[Path, tuple[float, str, str]] = {}  # path -> (estimate, source credited, drafter that ranked it)
        for name, (tree, paths, _, estimates) in self._proposals.items():
            for i, (path, score) in enumerate(zip(paths, estimates)):
                if path not in best or score > best[path][0]:
                    best[path] = (score, tree.source(i) or name, name)
        self._ranked_by = {path: name for path, (_, _, name) in best.items()}
        # Shorter paths first, so every node's parent is listed before it.
        paths = sorted(best, key=len)
        index = {path: i for i, path in enumerate(paths)}
        merged = DraftTree(
            [path[-1] for path in paths],
            [index[path[:-1]] if len(path) > 1 else ROOT for path in paths],
            [best[path][1] for path in paths],
            [best[path][0] for path in paths],
        )
        return merged.best_first().truncated(budget)

    def observe(self, verification: Verification) -> None:
        self._target_s = running_mean(self._target_s, time.perf_counter() - self._proposed_at, self._steps, self.config.memory)
        self._steps += 1
        verified = {path: i for i, path in enumerate(verification.tree.paths())}
        accepted = tuple(verification.accepted_tokens[:-1])
        coverage = {name: _covered(accepted, set(p.paths)) for name, p in self._proposals.items()}
        for name, (tree, paths, scores, _) in self._proposals.items():
            ledger = self._ledgers[name]
            projected, kept = _project(verification, tree, paths, verified, accepted)
            # Evidence fades per verification of the drafter's nodes, not per step: steps where none
            # of them was verified say nothing of its estimates, and fading on them let a drafter
            # whose drafts were just rejected back to a neutral calibration within ten steps.
            # Counted against the drafter's own scores: against the rescaled ones, a calibration
            # that got them right would drift back to 1 and undo itself. And only on the nodes its
            # own estimate ranked: a path another drafter ranked higher was chosen on that one's
            # evidence, mostly an easy token both predict, and counting it would inflate the
            # calibration of a drafter whose own choices are rarely accepted.
            ranked = [i for i in kept if self._ranked_by.get(paths[i]) == name]
            if ranked and tree.scores:
                agreed = sum(paths[i] == accepted[: len(paths[i])] for i in ranked)
                ledger.calibration.observe(agreed, sum(scores[i] for i in ranked))
            without = max((c for other, c in coverage.items() if other != name), default=0)
            ledger.with_tokens = ledger.average(ledger.with_tokens, len(accepted))
            ledger.own_tokens = ledger.average(ledger.own_tokens, len(projected.accepted_nodes))
            ledger.without_tokens = ledger.average(ledger.without_tokens, without)
            ledger.samples += 1
            ledger.trial += 1
            self._drafter(name).observe(projected)

    def _judged(self, drafter: Drafter, ledger: Ledger) -> bool:
        """Whether the drafter's averages so far decide if it is asked (rather than its trial or its own pacing)."""
        return not drafter.paces_itself and ledger.trial >= self.config.trial

    def _drafter(self, name: str) -> Drafter:
        return next(d for d in self.drafters if d.name == name)


def _project(verification: Verification, tree: DraftTree, paths: list[Path], verified: dict[Path, int], accepted: Path) -> tuple[Verification, list[int]]:
    """The verification as one drafter would have seen it alone, and which of its nodes were verified."""
    kept = [i for i, path in enumerate(paths) if path in verified]
    position = {old: new for new, old in enumerate(kept)}
    sub = tree.subset(kept)
    # Of duplicate siblings the first is the one verification follows (DraftTree.children).
    first = {}
    for i in kept:
        first.setdefault(paths[i], i)
    on_path = [position[i] for path, i in first.items() if path == accepted[: len(path)]]
    target_tokens = [verification.target_tokens[0]] + [verification.target_tokens[verified[paths[i]] + 1] for i in kept]
    # After this drafter's last accepted node the target emitted the next token of the full path.
    emitted = [sub.tokens[i] for i in on_path] + [verification.accepted_tokens[len(on_path)]]
    return Verification(sub, on_path, emitted, target_tokens), kept


def _scores(tree: DraftTree) -> list[float]:
    """A proposal's node scores as its drafter gave them (0.5 where it gave none)."""
    return [min(1.0, tree.scores[i]) if tree.scores else 0.5 for i in range(len(tree))]


def _covered(accepted: Path, paths: set[Path]) -> int:
    """How many accepted tokens a tree with these paths would have had accepted."""
    n = 0
    while n < len(accepted) and accepted[: n + 1] in paths:
        n += 1
    return n
