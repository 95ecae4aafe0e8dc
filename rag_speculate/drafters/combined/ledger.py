"""What one drafter has earned inside a combined drafter: how its estimates compare with what was
accepted, and the tokens per second steps yield with it against without it."""

from __future__ import annotations

from ..agreement import DecayingRate, running_mean
from .config import CombinedConfig


class Ledger:
    """What one drafter has earned: calibration of its estimates, and its time against its tokens."""

    def __init__(self, config: CombinedConfig, calibration_prior: float) -> None:
        self.config = config
        # Accepted over expected tokens on the nodes it ranked itself, neutral (1.0) at first.
        self.calibration = DecayingRate(1.0, calibration_prior, config.memory)
        self.propose_s = 0.0
        self.with_tokens = self.without_tokens = 0.0
        self.own_tokens = 0.0  # accepted tokens from its own nodes, per step it drafted
        self.samples = 0  # the weight of the averages above, in steps
        self.trial = 0  # steps it drafted in this generation
        self.skipped_for = 0
        self.retry_after = config.first_retry

    def average(self, old: float, new: float) -> float:
        """`running_mean` over the steps this drafter has drafted in."""
        return running_mean(old, new, self.samples, self.config.memory)

    def pays(self, target_s: float, others_s: float) -> bool:
        """Whether steps with this drafter yield at least about as many tokens per second as without it.

        The tolerance keeps a drafter whose time is negligible (a trie lookup) even while it has
        not helped yet: skipping it would save nothing, and its help often starts later in the
        answer (a summary quotes its article after a paraphrased start).
        """
        with_speed = (1 + self.with_tokens) / (target_s + others_s + self.propose_s)
        return with_speed >= (1 - self.config.tolerance) * (1 + self.without_tokens) / (target_s + others_s)
