"""How many draft nodes to verify: as many as pay for their cost, measured on this device.

A forward over q tokens costs c(q). On a GPU c is flat for small q, so drafting more is nearly
free; on a CPU it is not, and less so in bf16 than in fp32. The engine therefore keeps the best-first prefix of the drafter's tree that maximises
expected tokens per second, (1 + sum of acceptance estimates) / c(q), and verifies nothing at all
when no prefix beats plain decoding. The costs are timed once at start and then follow the real
verification forwards. A node's acceptance estimate comes from its drafter: for the retrieval
drafters, the share of retrieved continuations that agree with its path times r**depth, where r,
how often the target follows such a draft one more token, is counted from real verifications,
separately for each length of the context match behind the draft (longer matches are stronger
evidence, and start from a more confident prior).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import numpy as np

# q = draft nodes + 1 (the last accepted token is always fed); powers of two cover the curve's shape.
PROBE_SIZES = (1, 2, 3, 5, 9, 17, 33, 65)
_COST_MEMORY = 0.8  # weight of the old estimate when a verification forward is timed


class CostModel:
    """Seconds per target forward as a function of q, interpolated between timed sizes."""

    def __init__(self, seconds: dict[int, float], *, learn: bool = True):
        self._sizes = sorted(seconds)
        self._seconds = [seconds[q] for q in self._sizes]
        # learn=False pins the curve, so drafting choices do not depend on timing noise (tests).
        self.learn = learn

    @classmethod
    def measure(cls, forward: Callable[[int], None], max_q: int) -> CostModel:
        sizes = [q for q in PROBE_SIZES if q < max_q] + [max_q]
        forward(1)  # the first call pays one-off allocations
        seconds = {}
        for q in sizes:
            started = time.perf_counter()
            forward(q)
            seconds[q] = time.perf_counter() - started
        return cls(seconds)

    def table(self) -> dict[int, float]:
        """Seconds by timed size, as now (it keeps learning): `CostModel(table, learn=False)` pins a copy."""
        return dict(zip(self._sizes, self._seconds))

    def __call__(self, q: int) -> float:
        sizes, seconds = self._sizes, self._seconds
        if len(sizes) == 1:
            return seconds[0] * q / sizes[0]
        if q >= sizes[-1]:
            slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
            return max(seconds[-1] + slope * (q - sizes[-1]), seconds[-1])
        return float(np.interp(q, sizes, seconds))

    def observe(self, q: int, seconds: float) -> None:
        """Move the timed sizes that predicted c(q) toward the observed time, each by its share.

        Observations never become sizes of their own: the engine verifies a few sizes over and over,
        and a size learnt alone drifts away from its neighbours (noise, a longer context), so the
        sizes beside it stop looking worth verifying and are never timed again.
        """
        if not self.learn:
            return
        sizes, ratio = self._sizes, seconds / self(q)
        i = bisect.bisect_left(sizes, q)
        if i == len(sizes) or sizes[i] == q or i == 0:
            shares = {min(i, len(sizes) - 1): 1.0}
        else:
            below, above = sizes[i - 1], sizes[i]
            shares = {i - 1: (above - q) / (above - below), i: (q - below) / (above - below)}
        for j, share in shares.items():
            self._seconds[j] *= 1 + (1 - _COST_MEMORY) * share * (ratio - 1)


def best_prefix(scores: list[float], cost: CostModel) -> int:
    """Number k of best-first nodes maximising (1 + expected accepted) / cost(k + 1); 0 = don't draft."""
    best_k, best_speed, expected = 0, 1 / cost(1), 1.0
    for k, score in enumerate(scores, start=1):
        expected += score
        speed = expected / cost(k + 1)
        if speed > best_speed:
            best_k, best_speed = k, speed
    return best_k
