"""Verifying a draft tree with ONE forward of an unmodified Hugging Face model, losslessly.

Tree mode feeds [root, *draft] with an additive 4D mask and depth-based position ids through the
model's public forward, then keeps only the accepted path's KV entries (gathered in place, never
recomputed). Chain mode is the fallback for models whose forward cannot take a custom 4D mask (or
sliding-window layers whose window the sequence outgrows): it verifies the longest branch with the
model's own causal mask.

Acceptance walks down from the root: at each node the target picks a token (argmax, or a sample
of its warped distribution); if a child carries that token we descend, otherwise that token is
the bonus and we stop. Every emitted token is therefore exactly the target's own choice.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from .fast_kernels import FastKernels
from .sampling import SamplingParams, sample_token
from .tree import ROOT, DraftTree, tree_attention_mask, tree_position_ids


@dataclass(frozen=True)
class Verification:
    """What one verification step found; drafters learn from it."""

    tree: DraftTree
    accepted_nodes: list[int]
    # The accepted draft tokens followed by the target's own next token (the bonus).
    accepted_tokens: list[int]
    # The target's greedy choice after the root (index 0) and after each draft node (index i + 1),
    # including nodes that were rejected: drafters use them to refine their candidates.
    target_tokens: list[int]


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Verification:
    """Walk the tree, following a child only when it carries the target's own choice."""
    target_tokens = logits.argmax(dim=-1).tolist()
    children = tree.children()
    node, path = ROOT, []
    while True:
        row = node + 1
        choice = target_tokens[row] if params.greedy else sample_token(logits[row], params, generator)
        child = children.get(node, {}).get(choice)
        if child is None:
            return Verification(tree, path, [tree.tokens[i] for i in path] + [choice], target_tokens)
        path.append(child)
        node = child


def keep_cache_entries(cache: DynamicCache, new_entries: int, keep: list[int]) -> None:
    """Of the last `new_entries` cache slots, keep those at offsets `keep` (ascending), in that order."""
    contiguous = keep == list(range(len(keep)))
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            continue
        start = layer.keys.shape[-2] - new_entries
        if not contiguous:
            index = torch.tensor(keep, device=layer.keys.device) + start
            end = start + len(keep)
            layer.keys[:, :, start:end] = layer.keys.index_select(2, index)
            layer.values[:, :, start:end] = layer.values.index_select(2, index)
        # crop(0) still matters for sliding-window layers: it trims them back to their window.
        layer.crop(-(new_entries - len(keep)))


def make_cache(model: PreTrainedModel) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            # Sliding layers otherwise forget the oldest entries as soon as draft tokens arrive,
            # before we know which drafts survive.
            layer.activate_past_recording()
    return cache


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which `model`'s forward takes its KV cache: `cache` from transformers 5.24
    on, which deprecates `past_key_values` (to be removed in 5.40); `past_key_values` in earlier
    releases and in models written for them. Read off the first forward in the model's class
    hierarchy that names either, so a subclass whose forward takes only `**kwargs` gets its base's."""
    for cls in type(model).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is None:
            continue
        parameters = inspect.signature(forward).parameters
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
    return "past_key_values"


def sliding_window(cache: DynamicCache) -> int | None:
    windows = [layer.sliding_window for layer in cache.layers if getattr(layer, "is_sliding", False)]
    return min(windows) if windows else None


# transformers' own switch: SDPA reads grouped key/value heads even where a mask is given.
_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextlib.contextmanager
def _shared_kv_heads(device: torch.device):
    """On CPU, let transformers' SDPA attention read a tree's keys and values once per group of heads.

    Given a mask, transformers copies every layer's cached keys and values once per query head
    sharing them (`repeat_kv`: 2 x 3 MB per layer of the 1.5B Qwen at 500 tokens) before calling
    torch's SDPA, whose CPU kernel takes the mask and the grouped heads directly (`enable_gqa`) with
    bit-identical results (tests/test_verify.py). Plain decoding and transformers' own verification
    pass no mask and never copy; with the copies, a 5-token tree forward of that model took about
    20 ms more (docs/benchmarks.md §1.3). Scoped to the forward:
    on GPUs a mask with grouped heads would leave the fused kernels.
    """
    if device.type != "cpu" or _FORCE_GQA in os.environ:
        yield
        return
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        os.environ.pop(_FORCE_GQA, None)


class Verifier:
    """Runs prefill and verification forwards of one model, in tree or chain mode."""

    def __init__(self, model: PreTrainedModel, *, fast_kernels: bool = False, forward: Callable[..., torch.Tensor] | None = None):
        """`forward` runs in place of the model's own (given the same arguments, the KV cache as
        `cache`, it returns the logits): a draft model's `LeanForward`. The target always runs its own."""
        self.model = model
        self.fast_kernels = fast_kernels
        self._forward = forward
        self.device = model.device
        self.mask_dtype = next(model.parameters()).dtype
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_keyword = cache_keyword(model)

    @torch.inference_mode()
    def prefill(self, cache: DynamicCache, input_ids: list[int]) -> torch.Tensor:
        """Logits after the last input token (only that row: a full RAG prompt's logits would take GBs)."""
        ids = torch.tensor([input_ids], device=self.device)
        return self._logits(cache, input_ids=ids, **self._last_rows(1))[0, -1]

    def _last_rows(self, rows: int | None) -> dict:
        # Logits of rows nobody reads cost a vocabulary-sized product each (151k x 896 for a 0.5B Qwen).
        return {"logits_to_keep": rows} if rows and self._keeps_logits else {}

    @torch.inference_mode()
    def forward_tree(self, cache: DynamicCache, root: int, tree: DraftTree, last_rows: int | None = None) -> torch.Tensor:
        """Logits for [root, *tree.tokens] in one forward; row i + 1 follows draft node i.

        `last_rows`: only the logits of the last that many of those rows are returned.
        """
        past = cache.get_seq_length()
        ids = torch.tensor([[root, *tree.tokens]], device=self.device)
        with _shared_kv_heads(self.device):
            logits = self._logits(
                cache,
                input_ids=ids,
                attention_mask=tree_attention_mask(tree, past, self.mask_dtype, self.device),
                position_ids=tree_position_ids(tree, past, self.device),
                **self._last_rows(last_rows),
            )[0]
        return logits[-last_rows:] if last_rows else logits

    @torch.inference_mode()
    def forward_chain(self, cache: DynamicCache, root: int, tree: DraftTree, last_rows: int | None = None) -> torch.Tensor:
        """Logits for [root, *chain] with the model's own causal mask; `tree` must be a single chain."""
        ids = torch.tensor([[root, *tree.tokens]], device=self.device)
        logits = self._logits(cache, input_ids=ids, **self._last_rows(last_rows))[0]
        return logits[-last_rows:] if last_rows else logits

    def _logits(self, cache: DynamicCache, **inputs) -> torch.Tensor:
        with FastKernels() if self.fast_kernels else contextlib.nullcontext():
            if self._forward is not None:
                return self._forward(cache=cache, **inputs)
            return self.model(**inputs, **{self._cache_keyword: cache}, use_cache=True).logits

    @torch.inference_mode()
    def step(
        self,
        cache: DynamicCache,
        root: int,
        tree: DraftTree,
        params: SamplingParams,
        generator: torch.Generator | None,
        tree_mode: bool,
    ) -> Verification:
        """Verify `tree` after `root`, leave the cache holding root + accepted path, return the result."""
        if not tree_mode:
            tree = tree.longest_branch()
        # Without a draft, plain decoding's own forward (no custom mask to build and apply) is the cheapest.
        chain = not tree_mode or not tree.tokens
        logits = (self.forward_chain if chain else self.forward_tree)(cache, root, tree)
        result = accept(tree, logits, params, generator)
        keep_cache_entries(cache, len(tree) + 1, [0] + [i + 1 for i in result.accepted_nodes])
        return result

    @torch.inference_mode()
    def timed_forward(self, tree_mode: bool, context: int = 32) -> Callable[[int], None]:
        """A function that runs one verification-shaped forward over q tokens, for cost probing."""
        vocab = self.model.get_input_embeddings().num_embeddings
        cache = make_cache(self.model)
        self.prefill(cache, [(7 * i + 3) % vocab for i in range(context)])
        @torch.inference_mode()
        def run(q: int) -> None:
            # The forward `step` would run for q tokens.
            forward = self.forward_tree if tree_mode and q > 1 else self.forward_chain
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
        activation scales quantizes all of a forward's rows together, and its logits move far past
        the exact tolerance with the rows beside them): there the mask and the gather need only
        bring the logits nearer plain decoding's than ignoring them would.
        """
        vocab = self.model.get_input_embeddings().num_embeddings
        a, b, c, e, *distractors = [(7 * i + 3) % vocab for i in range(1, 9)]
        # c is drafted after several siblings it must not see.
        tree = DraftTree([*distractors, c], [ROOT] * (len(distractors) + 1))
        try:
            # Through the same kernels and forward: in bf16 torch's kernels round several rows
            # differently, by up to 2% of the largest logit on the 135M SmolLM2.
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
        logits = self.forward_tree(cache, root, tree).float()
        if gather:
            keep_cache_entries(cache, len(tree) + 1, [0, len(tree)])
        return logits[-1], self.prefill(cache, [then]).float()
