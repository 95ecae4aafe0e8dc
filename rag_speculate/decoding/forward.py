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

from .kv_cache import cache_keyword, keep_cache_entries, make_cache, window_holds
from .tree import ROOT, DraftTree, tree_attention_mask, tree_position_ids

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

    def _logits(self, cache, **inputs) -> torch.Tensor:
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
        return self._logits(cache, input_ids=ids, **self._last_rows(1))[0, -1]

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
            logits = self._logits(
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
        logits = self._logits(cache, input_ids=ids, **self._last_rows(last_rows))[0]
        return logits[-last_rows:] if last_rows else logits

    @torch.inference_mode()
    def timed(self, tree_mode: bool, context: int = 32) -> Callable[[int], None]:
        """A function that runs one verification-shaped forward over q tokens, for cost probing."""
        vocab = self.model.get_input_embeddings().num_embeddings
        cache = make_cache(self.model)
        self.prefill(cache, [(7 * i + 3) % vocab for i in range(context)])

        @torch.inference_mode()
        def run(q: int) -> None:
            # As the engine verifies: chains where a sliding window would outgrow its past.
            forward = self.tree if tree_mode and q > 1 and window_holds(cache, context + q) else self.chain
            forward(cache, 1, DraftTree.chain([1] * (q - 1)))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            keep_cache_entries(cache, q, [])

        return run

    @torch.inference_mode()
    def supports_tree_attention(self, *, exact: bool = True) -> tuple[bool, str]:
        """Check on real forwards that a custom 4D mask and the cache gather give plain decoding's logits.

        A model that rejects or ignores the mask (custom attention, remote code) is caught here
        rather than producing silently different text. `exact=False` is for a model that only
        drafts and whose logits depend on the other rows of its forward (int8 with dynamic
        activation scales quantizes all of a forward's rows together): there the mask and the
        gather need only bring the logits nearer plain decoding's than ignoring them would.
        """
        vocab = self.model.get_input_embeddings().num_embeddings
        a, b, c, e, *distractors = [(7 * i + 3) % vocab for i in range(1, 9)]
        # c is drafted after several siblings it must not see.
        tree = DraftTree([*distractors, c], [ROOT] * (len(distractors) + 1))
        try:
            # Through the same kernels and forward: in bf16 torch's kernels round several rows differently.
            ids = torch.tensor([[a, b, c, e]], device=self.device)
            reference = self._logits(make_cache(self.model), input_ids=ids)[0].float()
            logits, after = self._tree_then_step(a, b, tree, e, gather=True)
            if not exact:
                # What ignoring them would give: c seeing its siblings; the cache keeping them all.
                ignored = self._tree_then_step(a, b, DraftTree.chain(tree.tokens), e, gather=False)
        except Exception as exc:  # noqa: BLE001 - any failure means this model cannot do tree attention
            return False, f"{type(exc).__name__}: {exc}"
        scale = reference.abs().max().item() + 1e-6
        checks = (("tree mask", logits, reference[2]), ("cache gather", after, reference[3]))
        for i, (name, got, want) in enumerate(checks):
            error = (got - want).abs().max().item()
            if error > 0.02 * scale and (exact or error >= (got - ignored[i]).abs().max().item()):
                return False, f"the {name} changed the logits"
        return True, ""

    def _tree_then_step(
        self, first: int, root: int, tree: DraftTree, then: int, *, gather: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of `tree`'s last node after [first, root], then of `then` after the path to it
        (the cache gathered to it, or keeping the whole tree)."""
        cache = make_cache(self.model)
        self.prefill(cache, [first])
        logits = self.tree(cache, root, tree).float()
        if gather:
            keep_cache_entries(cache, len(tree) + 1, [0, len(tree)])
        return logits[-1], self.prefill(cache, [then]).float()
