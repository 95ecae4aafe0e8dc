"""How deep Ouroboros drafts, and when it pauses: `DepthLimit`."""

from __future__ import annotations


class DepthLimit:
    """How deep to draft: the engine verifies only the best-first prefix of a draft that pays for its
    target forward, so drafting deeper than it verifies wastes draft forwards.

    After a chain verified whole, one token deeper is allowed (a probe); after a cut, the depth the
    engine kept. When the engine verified none of a chain (no prefix paid for its place in the
    target's forward) and the target took none of its alternatives, drafting pauses for 1, 2, 4,
    ... proposals (at most `max_pause`), then probes in full. A draft the target verified and
    rejected does not pause drafting: the calibration already lowers the next estimates, and a
    cheap draft forward still pays where the draft model is right a fraction of the time.
    """

    def __init__(self, most: int, max_pause: int):
        self.most = most
        self.depth = most
        self.max_pause = max_pause
        self._pause = 0
        self._next_pause = 1

    def allowed(self) -> int:
        """Tokens to draft at this proposal at most; 0 while paused."""
        if self._pause:
            self._pause -= 1
            return 0
        return self.depth

    def observe(self, proposed: int, verified: int, agreed: int) -> None:
        if verified == agreed == 0:
            self._pause, self._next_pause = self._next_pause, min(2 * self._next_pause, self.max_pause)
        else:
            self._next_pause = 1
        if agreed == 0:
            # A short draft after a miss or a pause may never pay to verify: the next one drafts in full.
            self.depth = self.most
        else:
            # At least one: the engine may have verified only an alternative, which outranked the
            # chain token beside it, and a depth of 0 would end drafting for the generation.
            self.depth = min(verified + 1, self.most) if verified == proposed else max(verified, 1)
