"""What a generation returns: the text, the new token ids, why it ended, and what acceleration did."""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    # Prefill included: plain decoding needs exactly `new_tokens` of them.
    target_forwards: int = 0
    # Tokens fed to each decode forward (the draft nodes verified + 1) -> how many forwards: on a
    # CPU a forward's cost grows with them, so this with the cost curve explains decode_s.
    forward_sizes: Counter = field(default_factory=Counter)
    drafted_tokens: Counter = field(default_factory=Counter)
    accepted_tokens: Counter = field(default_factory=Counter)
    time_to_first_token_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # The drafters' preparation before the prefill (indexing documents, a draft model's own
    # prefill), then their proposing and learning during decode (part of decode_s).
    draft_setup_s: float = 0.0
    drafting_s: float = 0.0
    # "tree": one forward verifies the whole draft tree; "chain": only its longest branch.
    verification: str = "tree"

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding: the part speculation accelerates."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out["forward_sizes"] = dict(self.forward_sizes)
        out["drafted_tokens"] = dict(self.drafted_tokens)
        out["accepted_tokens"] = dict(self.accepted_tokens)
        out["tokens_per_forward"] = self.tokens_per_forward
        out["decode_tokens_per_s"] = self.decode_tokens_per_s
        return out


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop" or "length"
    stats: GenerationStats


class GenerationStream(Iterator[str]):
    """Text deltas as tokens are accepted; `result` once the iteration has finished."""

    def __init__(self, steps: Generator[str, None, GenerationResult]):
        self._steps = steps
        self._result: GenerationResult | None = None

    def __next__(self) -> str:
        if self._result is not None:
            raise StopIteration
        try:
            return next(self._steps)
        except StopIteration as finished:
            self._result = finished.value
            raise

    def close(self) -> None:
        """Stop generating early (frees the engine for the next caller)."""
        self._steps.close()

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished: iterate it to the end first")
        return self._result
