"""The draft model's lean forward (`decoding/lean_forward.py`), with an output head over fewer ids."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ...decoding.lean_forward import TORCH, Kernels, LeanForward, lean_forward
from .int8 import Int8Linear


class DraftForward(LeanForward):
    """The lean forward of a draft model, whose head can be restricted to the ids a generation needs."""

    def __init__(self, model: PreTrainedModel, kernels: Kernels = TORCH):
        super().__init__(model, kernels)
        self._lm_head = model.lm_head
        self._whole_head = self.head
        self._head_rows: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None = None
        self._head_groups: dict[bytes, Callable[[torch.Tensor], torch.Tensor]] = {}  # by their ids, in column order

    def restrict_head(self, *groups: torch.Tensor) -> None:
        """From now on, logits only for the token ids of `groups`, side by side (column j: token j of
        their concatenation); no groups: every id.

        A small draft model's output head is a large part of its weights (the 0.5B Qwen's is
        151,936 x 896) and mostly scores tokens an answer rarely uses; its drafts are only checked,
        so a head over fewer tokens costs accepted tokens where the target needs another one, never
        the output. Each group's product is built once and kept until a call with groups names other
        ids, since repacking many rows of the head is slow while a prompt's few hundred ids are cheap.
        The first call keeps a copy of the head's weights to build groups from."""
        if not groups:
            self.head = self._whole_head
            return
        if self._head_rows is None:
            self._head_rows = _row_products(self._lm_head)  # unpacked once
        built, products = self._head_groups, []
        self._head_groups = {}
        for ids in groups:
            key = ids.numpy().tobytes()
            self._head_groups[key] = built.get(key) or self._head_groups.get(key) or self._head_rows(ids)
            products.append(self._head_groups[key])
        self.head = products[0] if len(products) == 1 else lambda x: torch.cat([p(x) for p in products], dim=-1)


def draft_forward(model: PreTrainedModel) -> tuple[DraftForward | None, str]:
    """The lean forward of a draft model, or None and why not (its logits need only agree closely
    with the model's own: the target checks every draft)."""
    return lean_forward(model, exact=False, kind=DraftForward)


def _row_products(module: torch.nn.Module) -> Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """A maker of `module`'s product over chosen output rows alone: for `ids`, a copy of those rows'
    weights (int8 or fp32), each row with its own scale, so every logit is the one the whole product gives."""
    if isinstance(module, Int8Linear):
        weight, bias = module.weight_and_bias()
        ints, scales, zero_points = weight.int_repr(), weight.q_per_channel_scales(), weight.q_per_channel_zero_points()
        return lambda ids: Int8Linear.of(ints[ids], scales[ids], zero_points[ids], None if bias is None else bias[ids], module.reduce_range)
    if type(module) is torch.nn.Linear:
        return lambda ids: _dense_product(module.weight[ids], None if module.bias is None else module.bias[ids])
    return lambda ids: lambda x: module(x)[..., ids]


def _dense_product(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.linear(x, weight, bias)
