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
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..files.durable import atomic_write_bytes

# Tokens fed (draft nodes + 1 per row, over a batch's rows); powers of two cover the curve's shape.
PROBE_SIZES = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257)
_COST_MEMORY = 0.8  # weight of the old estimate when a verification forward is timed
_MEASURE_ROUNDS = 3  # passes over the sizes when a curve is timed


class CostModel:
    """Seconds per target forward as a function of the tokens it is fed (over all the rows of a
    batch), interpolated between timed sizes; saved and loaded as JSON, so a machine times a model once."""

    def __init__(self, seconds: dict[int, float], *, learn: bool = True):
        self._sizes = sorted(seconds)
        self._seconds = [seconds[q] for q in self._sizes]
        self._never_falling(0)
        # learn=False pins the curve, so drafting choices do not depend on timing noise (tests).
        self.learn = learn

    @classmethod
    def measure(cls, forward: Callable[[int], None], max_q: int, rounds: int = _MEASURE_ROUNDS) -> CostModel:
        """Each size's least time over `rounds` passes through all of them: whatever else runs on the
        machine can only slow a timing, and a curve saved once steers every later engine (a size
        timed too dear is never fed again, so never corrected)."""
        sizes = [q for q in PROBE_SIZES if q < max_q] + [max_q]
        forward(1)  # the first call pays one-off allocations
        seconds = dict.fromkeys(sizes, float("inf"))
        for _ in range(rounds):
            for q in sizes:
                started = time.perf_counter()
                forward(q)
                seconds[q] = min(seconds[q], time.perf_counter() - started)
        return cls(seconds)

    def save(self, path: Path) -> None:
        atomic_write_bytes(path, json.dumps({"seconds": self.table()}).encode())

    @classmethod
    def load(cls, path: Path) -> CostModel | None:
        """The curve saved at `path`, or None where there is none or it is not one (then it is timed again)."""
        try:
            table = json.loads(path.read_bytes())["seconds"]
            seconds = {int(q): float(s) for q, s in table.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if not seconds or any(q < 1 or not 0 < s < 1e4 for q, s in seconds.items()):
            return None
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
        # Anchored where the observation weighs most: a size the engine stopped feeding (one token,
        # once it drafts every step) must not keep a stale higher cost that makes feeding more look cheaper.
        self._never_falling(max(shares, key=shares.__getitem__))

    def _never_falling(self, anchor: int) -> None:
        """Make the curve non-decreasing around the timed size `anchor`: smaller sizes cost at most
        what it costs, larger ones at least. A forward over more tokens never costs less; a noisy
        timing that says so makes a padded row look free (`batch_width` would pad an undrafted row)."""
        seconds = self._seconds
        for j in range(anchor - 1, -1, -1):
            seconds[j] = min(seconds[j], seconds[j + 1])
        for j in range(anchor + 1, len(seconds)):
            seconds[j] = max(seconds[j], seconds[j - 1])


def best_prefix(scores: list[float], cost: CostModel) -> int:
    """Number k of best-first nodes maximising (1 + expected accepted) / cost(k + 1); 0 = don't draft."""
    best_k, best_speed, expected = 0, 1 / cost(1), 1.0
    for k, score in enumerate(scores, start=1):
        expected += score
        speed = expected / cost(k + 1)
        if speed > best_speed:
            best_k, best_speed = k, speed
    return best_k


def batch_width(scores: Sequence[list[float]], cost: CostModel, budget: int, least: int = 1) -> int:
    """Tokens q fed to each row of one batched forward (its last accepted token and up to q - 1 of
    its draft's best-first nodes; the rest padding), maximising the batch's expected tokens per
    second, the sum over rows of (1 + expected accepted) / cost(rows * q); at least `least` (a
    draft without scores is verified whole). One row: `best_prefix` + 1. With more rows every extra
    token is paid rows times over, so drafts shrink, to q = 1 (no drafting) where they do not pay:
    never slower than the same batch without drafting, as far as the measured costs tell.

        >>> batch_width([[0.9, 0.8], [0.1]], CostModel({1: 1.0, 6: 2.0}), 16)
        3
    """
    rows, best_q, best_speed = len(scores), 1, 0.0
    for q in range(1, budget + 2):
        speed = sum(1 + sum(s[: q - 1]) for s in scores) / cost(rows * q)
        if speed > best_speed:
            best_q, best_speed = q, speed
    return max(best_q, least)
