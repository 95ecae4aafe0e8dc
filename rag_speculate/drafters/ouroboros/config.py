"""Ouroboros's options and tuning constants, in one place."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InvalidArgumentError, check_int


@dataclass(frozen=True)
class OuroborosConfig:
    """What an `OuroborosDrafter` drafts and how it learns. The first group is the paper's (and
    ours beside it); the second the priors and memories of its estimates."""

    # The sentence draft stops once it holds this many tokens.
    gamma: int = 12
    # A new pool's size: phrases kept per first token (W) and tokens per phrase (beta).
    W: int = 20
    beta: int = 8
    # Newest pool phrases hung after the sentence draft as candidate suffixes.
    K: int = 3
    # Pool nodes one draft forward checks at most (cut further to those that pay for their cost).
    draft_tree_budget: int = 16
    # The draft model's next-best tokens hung beside each chain token: checked for free in the target's forward.
    alternatives: int = 1
    # The least acceptance estimate worth one more draft forward; None derives it from measured costs.
    min_score: float | None = None
    # Fill the pool from each generation's prompt and documents.
    learn_from_context: bool = True
    # Run a Llama-family draft model through its lean forward (the same logits, fewer calls).
    lean: bool = True
    # Columns of lookahead decoding's Jacobi window run in every draft forward (0: none), and
    # the n-gram length it harvests for the pool.
    lookahead: int = 0
    lookahead_ngram: int = 4
    # Through the lean forward, the head scores only this many lowest ids plus the special ones and
    # each generation's prompt and documents (None: every id): the head is a large share of a small model.
    head_vocabulary: int | None = 32768
    # Memory for the draft model's KV entries of prompts seen before (0: none; None: room for some
    # tens of thousands of tokens): its own prefill of a long RAG prompt is reused as the target's is.
    prompt_cache_bytes: int | None = None

    # How often the target takes a suffix candidate's next token, before any evidence.
    suffix_prior: float = 0.5
    # How often the draft model takes a pool phrase's next token, before any evidence.
    pool_prior: float = 0.75
    # Per proposal: the calibration of the draft model's probabilities follows the text being generated.
    calibration_memory: float = 0.95
    # Per drafted token: the typical estimate of a drafted token follows the text being generated.
    typical_memory: float = 0.9
    # Proposals skipped at most after the engine verified none of a draft.
    max_pause: int = 64
    # The score floor while the target's costs are unknown.
    fallback_min_score: float = 0.4

    def __post_init__(self) -> None:
        least = {"gamma": 1, "W": 1, "beta": 2, "K": 0, "draft_tree_budget": 0, "alternatives": 0, "lookahead": 0,
                 "lookahead_ngram": 2, "max_pause": 1}
        for name, low in least.items():
            check_int(getattr(self, name), name, low)
        if self.head_vocabulary is not None:
            check_int(self.head_vocabulary, "head_vocabulary", 1)
        if self.prompt_cache_bytes is not None:
            check_int(self.prompt_cache_bytes, "prompt_cache_bytes", 0)
        if self.min_score is not None and not 0 <= self.min_score <= 1:
            raise InvalidArgumentError(
                f"min_score must be in [0, 1] or None (from measured costs), got {self.min_score}", "min_score"
            )
