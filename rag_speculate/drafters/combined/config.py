"""The combined drafter's options and tuning constants, in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CombinedConfig:
    """The combined drafter's tuning constants."""

    # Weight of the past in the running averages, once they hold 1 / (1 - memory) samples.
    memory: float = 0.9
    # Expected tokens' weight of the neutral calibration 1.0: a retrieval drafter's scores come
    # from priors and need little weight to be corrected; a drafter that paces itself already
    # acts on its failures, and a light prior on top would cut its chains.
    calibration_prior: float = 1.0
    self_paced_calibration_prior: float = 4.0
    # Steps a drafter drafts in each generation before it is judged.
    trial: int = 3
    # Samples' weight the averages of earlier generations keep when a generation starts: with none,
    # a generation's first proposal stands for the drafter alone, and one miss keeps it off.
    carried: int = 3
    # Steps a drafter that does not pay is skipped before it is tried again, doubled after each
    # retry that still does not pay: a retry costs one proposal, missing a drafter that helps more.
    first_retry: int = 4
    last_retry: int = 64
    # Slower by at most this share still counts as paying, so a drafter whose time is negligible stays on.
    tolerance: float = 0.02
