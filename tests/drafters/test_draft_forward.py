"""The draft model's lean forward: its logits agree with the model's own (int8 too), and its head
can be restricted to the ids a generation needs."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, VOCAB, tiny_model
from transformers import DynamicCache

from rag_speculate import OuroborosDrafter
from rag_speculate.decoding.kv_cache import cache_keyword
from rag_speculate.decoding.tree import DraftTree, tree_attention_mask, tree_position_ids
from rag_speculate.drafters.base import DraftContext, Target
from rag_speculate.drafters.ouroboros import OuroborosConfig
from rag_speculate.drafters.ouroboros.int8 import int8_draft_model
from rag_speculate.drafters.ouroboros.draft_forward import draft_forward


def _forwards(model, forward) -> list[torch.Tensor]:
    """Logits of a prefill, a one-token step and a tree-masked step on top of it, through `forward`."""
    cache = DynamicCache(config=model.config)
    tree = DraftTree([5, 6, 7, 8], [-1, 0, -1, 2])
    tree_inputs = {
        "attention_mask": tree_attention_mask(tree, 11, torch.float32, model.device),
        "position_ids": tree_position_ids(tree, 11, model.device),
    }
    return [
        forward(input_ids=torch.tensor([[(5 * i + 2) % VOCAB for i in range(10)]]), cache=cache),
        forward(input_ids=torch.tensor([[9]]), cache=cache),
        forward(input_ids=torch.tensor([[4, *tree.tokens]]), cache=cache, **tree_inputs),
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("int8", [False, True])
def test_logits_agree_with_the_models_own(arch, int8):
    model = tiny_model(arch, seed=1)
    if int8:
        model = int8_draft_model(model)
    lean, reason = draft_forward(model)
    assert lean is not None, reason
    with torch.inference_mode():
        want = _forwards(model, lambda cache, **inputs: model(**inputs, **{cache_keyword(model): cache}, use_cache=True).logits)
        got = _forwards(model, lean)
    for ours, theirs in zip(got, want):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("int8", [False, True])
def test_a_restricted_head_gives_those_columns_of_the_whole_heads_logits(int8):
    model = tiny_model("qwen2", seed=1)
    if int8:
        model = int8_draft_model(model)
    lean, _ = draft_forward(model)
    common, rare = torch.tensor([0, 3, 4, 17]), torch.tensor([2, VOCAB - 1])
    with torch.inference_mode():
        whole = _forwards(model, lean)
        lean.restrict_head(common, rare)
        restricted = _forwards(model, lean)
        lean.restrict_head()
        again = _forwards(model, lean)
    for ours, theirs, back in zip(restricted, whole, again):
        # Another product size: rounding differences only.
        torch.testing.assert_close(ours, theirs[..., torch.cat([common, rare])], rtol=0, atol=1e-5)
        torch.testing.assert_close(back, theirs, rtol=0, atol=0)


def test_a_restricted_heads_groups_are_built_once_while_named_again():
    lean, _ = draft_forward(int8_draft_model(tiny_model("qwen2", seed=1)))
    common = torch.tensor([0, 3, 4, 17])
    lean.restrict_head(common, torch.tensor([5]))
    built = dict(lean._head_groups)
    lean.restrict_head(common, torch.tensor([6, 7]))
    assert lean._head_groups[common.numpy().tobytes()] is built[common.numpy().tobytes()]
    assert len(lean._head_groups) == 2


def test_ouroboros_drafts_through_the_lean_forward_where_it_fits(tokenizer):
    draft = tiny_model("llama")
    drafter = OuroborosDrafter(draft, tokenizer, OuroborosConfig(min_score=0.0))
    assert drafter.draft.lean_forward_skipped == ""
    drafter.attach(Target(tokenizer, VOCAB, DEVICE))  # its tree-attention check runs the model's own forward as the reference
    own, embedded = [], []
    draft.register_forward_hook(lambda *_: own.append(1))
    draft.get_input_embeddings().register_forward_hook(lambda *_: embedded.append(1))
    ids = tokenizer.encode("the cat sat on the mat")
    drafter.start(DraftContext(ids, [], VOCAB))
    assert len(drafter.propose(ids, budget=4)) > 0
    assert own == [] and len(embedded) >= 2  # the prefill and the draft forwards, none through the model's own
    assert "not a Llama-family decoder" in OuroborosDrafter(tiny_model("gpt2"), tokenizer).draft.lean_forward_skipped
    assert OuroborosDrafter(tiny_model("llama"), tokenizer, OuroborosConfig(lean=False)).draft.lean_forward_skipped == "lean=False"
