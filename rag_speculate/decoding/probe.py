"""What a model's forwards can do, checked on real forwards over small probe inputs.

Each check answers with a reason, "" where the model can: a model that rejects or ignores a custom
mask, whose cache forgets entries, or whose rows move each other's logits is caught here, once, rather
than producing silently different text. The engine asks them when it is built (`engine/traits.py`);
a draft model's own forward asks `tree_attention` with `exact=False`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from .batch import BatchCache, BatchForward, Fed
from .forward import TreeForward
from .kv_cache import keep_cache_entries, make_cache, window_holds
from .static import StaticStep
from .tree import ROOT, DraftTree


def probe_ids(vocab: int, n: int, start: int = 0) -> list[int]:
    """`n` token ids spread over the vocabulary: any will do, as long as they are not all one id."""
    return [(7 * i + 3) % vocab for i in range(start, start + n)]


def cache_layout(model: PreTrainedModel) -> str:
    """Why `model`'s KV cache cannot be held in rows of plain key and value tensors, cut at any
    position (a batch's rows, the prompt cache's prefixes): a sliding window forgets entries, and
    layers of another kind cannot be written or cut by position."""
    for layer in make_cache(model).layers:
        if getattr(layer, "is_sliding", False):
            return "it has sliding-window layers, whose entries depend on what the window forgot"
        if type(layer).__name__ != "DynamicLayer":
            return f"its cache layers are {type(layer).__name__}, not plain key and value tensors"
    return ""


@torch.inference_mode()
def tree_attention(forward: TreeForward, *, exact: bool = True) -> str:
    """Why a draft tree under a custom 4D mask, and the cache gathered to the accepted path, do not
    give plain decoding's logits. `exact=False` is for a model that only drafts and whose logits
    depend on the other rows of its forward (int8 with dynamic activation scales quantizes all of a
    forward's rows together): there the mask and the gather need only bring the logits nearer plain
    decoding's than ignoring them would."""
    a, b, c, e, *distractors = probe_ids(forward.model.get_input_embeddings().num_embeddings, 8, start=1)
    # c is drafted after several siblings it must not see.
    tree = DraftTree([*distractors, c], [ROOT] * (len(distractors) + 1))
    try:
        # Through the same kernels and forward: in bf16 torch's kernels round several rows differently.
        ids = torch.tensor([[a, b, c, e]], device=forward.device)
        reference = forward.logits(make_cache(forward.model), input_ids=ids)[0].float()
        logits, after = _tree_then_step(forward, a, b, tree, e, gather=True)
        if not exact:
            # What ignoring them would give: c seeing its siblings; the cache keeping them all.
            ignored = _tree_then_step(forward, a, b, DraftTree.chain(tree.tokens), e, gather=False)
    except Exception as exc:  # noqa: BLE001 - any failure means this model cannot do tree attention
        return f"{type(exc).__name__}: {exc}"
    scale = reference.abs().max().item() + 1e-6
    for i, (name, got, want) in enumerate((("tree mask", logits, reference[2]), ("cache gather", after, reference[3]))):
        error = (got - want).abs().max().item()
        if error > 0.02 * scale and (exact or error >= (got - ignored[i]).abs().max().item()):
            return f"the {name} changed the logits"
    return ""


def _tree_then_step(
    forward: TreeForward, first: int, root: int, tree: DraftTree, then: int, *, gather: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of `tree`'s last node after [first, root], then of `then` after the path to it
    (the cache gathered to it, or keeping the whole tree)."""
    cache = make_cache(forward.model)
    forward.prefill(cache, [first])
    logits = forward.tree(cache, root, tree).float()
    if gather:
        keep_cache_entries(cache, len(tree) + 1, [0, len(tree)])
    return logits[-1], forward.prefill(cache, [then]).float()


@torch.inference_mode()
def rows_together(batched: BatchForward, single: TreeForward) -> str:
    """Why the model's forward does not take the rows of a BatchCache: two rows of other lengths fed
    together must each get the logits its own forward on a cache of its own gives it, as a model
    that ignores the mask or the positions would not."""
    vocab = batched.model.get_input_embeddings().num_embeddings
    prompts = [probe_ids(vocab, 5, start=1), probe_ids(vocab, 2, start=9)]
    fed = [[9 % vocab, 4 % vocab], [6 % vocab]]
    try:
        cache = BatchCache(batched.model)
        rows = [cache.add_row() for _ in prompts]
        batched(cache, [Fed(r, p) for r, p in zip(rows, prompts)])
        for row, prompt in zip(rows, prompts):
            cache.advance(row, len(prompt))
        together = batched(cache, [Fed(r, tokens, DraftTree.chain(tokens[1:]).fed_parents()) for r, tokens in zip(rows, fed)])
        alone = []
        for prompt, tokens in zip(prompts, fed):
            own = make_cache(single.model)
            single.prefill(own, prompt)
            alone.append(single.chain(own, tokens[0], DraftTree.chain(tokens[1:])))
    except Exception as exc:  # noqa: BLE001 - any failure means this model's forward takes no rows
        return f"a batched forward failed: {type(exc).__name__}: {exc}"
    for got, want in zip(together, alone):
        want = want.float()
        if (got.float() - want).abs().max().item() > 0.02 * (want.abs().max().item() + 1e-6):
            return "a batched forward's logits differ from each row's own"
    return ""


# Cached entries a timed forward attends to: a verification's cost barely moves with it on a CPU.
_TIMED_CONTEXT = 32


@torch.inference_mode()
def timed_tree(forward: TreeForward, tree_mode: bool) -> Callable[[int], None]:
    """A function that runs one verification-shaped forward over q tokens on a cache of its own, as
    a sequence verifying alone does, for a cost curve (`budget.CostModel.measure`)."""
    cache = make_cache(forward.model)
    forward.prefill(cache, probe_ids(forward.model.get_input_embeddings().num_embeddings, _TIMED_CONTEXT))

    @torch.inference_mode()
    def run(q: int) -> None:
        # As the engine verifies: chains where a sliding window would outgrow its past.
        verify = forward.tree if tree_mode and q > 1 and window_holds(cache, _TIMED_CONTEXT + q) else forward.chain
        verify(cache, 1, DraftTree.chain([1] * (q - 1)))
        _synchronize(forward.device)
        keep_cache_entries(cache, q, [])

    return run


@torch.inference_mode()
def timed_rows(batched: BatchForward) -> Callable[[int], None]:
    """`timed_tree` for a batch's forward: q tokens of one row of a BatchCache of its own, through
    the forward that verifies every running sequence's draft."""
    cache = BatchCache(batched.model)
    row = cache.add_row()
    batched(cache, [Fed(row, probe_ids(batched.model.get_input_embeddings().num_embeddings, _TIMED_CONTEXT))], last_only=True)
    cache.advance(row, _TIMED_CONTEXT)

    @torch.inference_mode()
    def run(q: int) -> None:
        # Nothing kept: the next forward writes over the same entries.
        batched(cache, [Fed(row, [1] * q, DraftTree.chain([1] * (q - 1)).fed_parents())])
        _synchronize(batched.device)

    return run


def timed_static(step: StaticStep) -> Callable[[int], None]:
    """`timed_rows` for the fixed-shape step (and its CUDA graphs, where they replay it): q tokens in
    the bucket a step feeding them runs, one row of q where a row takes them, else as few rows as hold
    them, over padding (a step's cost does not move with the entries its rows hold: it reads them whole)."""

    def run(q: int) -> None:
        rows = -(-q // step.tokens)
        step.padding(step.shape(rows, -(-q // rows)))
        _synchronize(step.cache.device)

    return run


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rows_interact(model: PreTrainedModel) -> str:
    """Why a row of `model`'s forward depends on the rows beside it, so that a verification or a
    batch can round it otherwise than generate's one-token step ("" where none is known)."""
    config = getattr(model.config, "quantization_config", None)
    read = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    if config is not None and read("load_in_8bit", False) and (read("llm_int8_threshold", 6.0) or 0.0) > 0:
        return (f"bitsandbytes' LLM.int8 (llm_int8_threshold={read('llm_int8_threshold', 6.0)}) keeps a column in "
                "16 bits when any row of the forward exceeds the threshold there")  # fmt: skip
    return ""
