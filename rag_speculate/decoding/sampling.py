"""Turning target logits into tokens: greedy, or sampled from the warped distribution.

The warps follow transformers' order and semantics (temperature, then top-k, then top-p keeping
at least one token) so that `temperature/top_k/top_p` mean here what they mean in `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to the last dimension; removed tokens get -inf."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - params.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from a single position's logits."""
    if params.greedy:
        return int(logits.argmax())
    probs = warp_logits(logits, params).softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
