"""A model's forwards over a draft tree, through its public forward on its KV cache: `TreeForward`.

Tree mode feeds [root, *draft] with an additive 4D mask and depth-based position ids; chain mode
feeds a single branch under the model's own causal mask, for models whose forward cannot take a
custom mask. The target's verification (verify.py) and the draft model's drafting both run here.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from transformers import DynamicCache, PreTrainedModel

from .kv_cache import cache_keyword
from .tree import DraftTree, tree_attention_mask, tree_position_ids

# transformers' own switch: SDPA reads grouped key/value heads even where a mask is given.
_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextlib.contextmanager
def shared_kv_heads(device: torch.device):
    """On CPU, let transformers' SDPA attention read a tree's keys and values once per group of heads.

    Given a mask, transformers copies every layer's cached keys and values once per query head
    sharing them (`repeat_kv`) before calling torch's SDPA, whose CPU kernel takes the mask and the
    grouped heads directly (`enable_gqa`) with bit-identical results (tests/test_verify.py). Plain
    decoding passes no mask and never copies. Scoped to the forward: on GPUs a mask with grouped
    heads would leave the fused kernels.
    """
    if device.type != "cpu" or _FORCE_GQA in os.environ:
        yield
        return
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        os.environ.pop(_FORCE_GQA, None)


class ModelForward:
    """What every forward of one model needs, read once: its device, its masks' dtype, whether it
    can return the last rows' logits alone, and its KV cache's keyword. `context`: what every
    forward runs inside (the CPU kernels' mode, where the engine uses them: it hands the context
    in, so nothing here loads the kernel layer). `forward` runs in place of the model's own, given
    the same arguments and the KV cache as `cache`, returning the logits: its lean forward
    (`lean_forward.py`), which for a target gives the model's own logits bit for bit."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
        forward: Callable[..., torch.Tensor] | None = None,
    ):
        self.model = model
        self.context = context
        self.device = model.device
        self.mask_dtype = next(model.parameters()).dtype
        self._forward = forward
        self._keeps_logits = forward is not None or "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_keyword = cache_keyword(model)

    def logits(self, cache, **inputs) -> torch.Tensor:
        """The model's logits for `inputs` (its forward's arguments) on `cache`, as every forward here runs."""
        with self.context():
            if self._forward is not None:
                return self._forward(cache=cache, **inputs)
            return self.model(**inputs, **{self._cache_keyword: cache}, use_cache=True).logits


class TreeForward(ModelForward):
    """Prefill and draft-tree forwards of one model on its KV cache, returning logits."""

    @torch.inference_mode()
    def prefill(self, cache: DynamicCache, input_ids: list[int]) -> torch.Tensor:
        """Logits after the last input token (only that row: a full RAG prompt's logits would take GBs)."""
        ids = torch.tensor([input_ids], device=self.device)
        return self.logits(cache, input_ids=ids, **self._last_rows(1))[0, -1]

    def _last_rows(self, rows: int | None) -> dict:
        # Logits of rows nobody reads cost a vocabulary-sized product each.
        return {"logits_to_keep": rows} if rows and self._keeps_logits else {}

    @torch.inference_mode()
    def tree(self, cache: DynamicCache, root: int, tree: DraftTree, last_rows: int | None = None) -> torch.Tensor:
        """Logits for [root, *tree.tokens] in one forward; row i + 1 follows draft node i.

        `last_rows`: only the logits of the last that many of those rows are returned.
        """
        past = cache.get_seq_length()
        ids = torch.tensor([[root, *tree.tokens]], device=self.device)
        with shared_kv_heads(self.device):
            logits = self.logits(
                cache,
                input_ids=ids,
                attention_mask=tree_attention_mask(tree, past, self.mask_dtype, self.device),
                position_ids=tree_position_ids(tree, past, self.device),
                **self._last_rows(last_rows),
            )[0]
        return logits[-last_rows:] if last_rows else logits

    @torch.inference_mode()
    def chain(self, cache: DynamicCache, root: int, tree: DraftTree, last_rows: int | None = None) -> torch.Tensor:
        """Logits for [root, *chain] with the model's own causal mask; `tree` must be a single chain."""
        ids = torch.tensor([[root, *tree.tokens]], device=self.device)
        logits = self.logits(cache, input_ids=ids, **self._last_rows(last_rows))[0]
        return logits[-last_rows:] if last_rows else logits
