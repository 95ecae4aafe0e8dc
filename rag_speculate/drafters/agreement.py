"""How often the target agrees with a drafter: one decaying rate, and the retrieval drafters' use of
it; and one running average, for what drafting costs and yields.

Every acceptance estimate the drafters learn is the same quantity, (hits + prior * weight) /
(trials + weight) with old evidence fading, so drafting that starts failing is dropped within a
few steps and drafting that was dropped is tried again once the evidence against it has faded.
"""

from __future__ import annotations

from ..decoding.tree import ROOT
from ..decoding.verify import Verification

# Prior agreement rate by the length of the context match a draft came from (capped at 4), for
# documents retrieved for this very request: optimistic enough to try drafts from 2+ token
# matches, not from a single common token. A drafter whose matches are weaker evidence passes its own.
DOCUMENT_MATCH_PRIORS = {1: 0.55, 2: 0.7, 3: 0.8, 4: 0.9}


def running_mean(old: float, new: float, samples: int, memory: float) -> float:
    """An average that is the mean of the first samples, then exponential, keeping `memory` of the old:
    fast to settle, then following what changes."""
    return old + (new - old) * max(1 / (samples + 1), 1 - memory)


class DecayingRate:
    """hits over trials, starting from `prior` with the weight of `weight` trials; each `decay`
    keeps `memory` of the evidence so far, so the rate follows the text being generated."""

    def __init__(self, prior: float, weight: float = 4.0, memory: float = 0.95):
        self._prior_hits = prior * weight
        self._weight = weight
        self._memory = memory
        self.hits = 0.0
        self.trials = 0.0

    @property
    def rate(self) -> float:
        return (self.hits + self._prior_hits) / (self.trials + self._weight)

    def decay(self) -> None:
        self.hits *= self._memory
        self.trials *= self._memory

    def add(self, hits: float, trials: float) -> None:
        self.hits += hits
        self.trials += trials

    def observe(self, hits: float, trials: float) -> None:
        """One step's evidence, after the old has faded by one step."""
        self.decay()
        self.add(hits, trials)


def agreement_trials(verification: Verification) -> tuple[int, int]:
    """(agreed, trials) of one verification: each accepted draft token agreed; the walk's end was
    a disagreement only if the draft offered a continuation there."""
    accepted = verification.accepted_nodes
    last = accepted[-1] if accepted else ROOT
    rejected = any(parent == last for parent in verification.tree.parents)
    return len(accepted), len(accepted) + rejected


class MatchAgreement:
    """Agreement rates of a retrieval drafter, one per context-match length; `rate` before a
    proposal, `observe` with its verification. `priors` maps match lengths 1..n to prior rates;
    longer matches share the last."""

    def __init__(self, priors: dict[int, float] = DOCUMENT_MATCH_PRIORS) -> None:
        self._priors = priors
        self._rates: dict[int, DecayingRate] = {}
        self._pending: int | None = None

    def rate(self, match_length: int) -> float:
        key = min(match_length, max(self._priors))
        if key not in self._rates:
            self._rates[key] = DecayingRate(self._priors[key])
        # Evidence fades with every step, drafted or not, so a match length whose drafts stopped
        # paying is tried again later in the generation.
        self._rates[key].decay()
        self._pending = key
        return self._rates[key].rate

    def observe(self, verification: Verification) -> None:
        if self._pending is not None and len(verification.tree):
            self._rates[self._pending].observe(*agreement_trials(verification))
        self._pending = None
