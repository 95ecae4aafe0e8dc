"""The verifier's tree forward: what it asks of transformers' attention, and that it changes no logits."""

from __future__ import annotations

import inspect
import os

import torch
from conftest import VOCAB, tiny_model
from transformers.integrations import sdpa_attention

from rag_speculate.decoding.forward import TreeForward
from rag_speculate.decoding.kv_cache import cache_keyword, make_cache
from rag_speculate.decoding.tree import DraftTree
from rag_speculate.decoding.verify import greedy_choices

TREE = DraftTree([11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 3, -1])


def _tree_logits(verifier: TreeForward) -> torch.Tensor:
    cache = make_cache(verifier.model)
    verifier.prefill(cache, [(7 * i + 3) % VOCAB for i in range(40)])
    return verifier.tree(cache, 5, TREE)


def test_tree_forward_reads_grouped_heads_without_copies_and_the_same_logits(monkeypatch):
    model = tiny_model("qwen2")  # 4 query heads share 2 key/value heads
    assert model.config._attn_implementation == "sdpa"
    verifier = TreeForward(model)
    copied = _tree_logits_with_copies(monkeypatch, verifier)

    def no_copies(*args, **kwargs):
        raise AssertionError("the tree forward copied keys and values per query head")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", no_copies)
    assert torch.equal(_tree_logits(verifier), copied)
    assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ  # switched on for the forward only


def _tree_logits_with_copies(monkeypatch, verifier: TreeForward) -> torch.Tensor:
    """transformers' own path with a mask (the one without the switch), for reference."""
    calls = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", lambda mask, key, value: mask is None)
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: calls.append(1) or repeat_kv(*a))
    logits = _tree_logits(verifier)
    monkeypatch.undo()
    assert calls
    return logits


def test_a_users_own_switch_is_left_as_it_was(monkeypatch):
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "0")
    _tree_logits(TreeForward(tiny_model("qwen2")))
    assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "0"


def test_the_cache_goes_under_the_keyword_the_models_forward_names():
    """transformers 5.24 renamed forward's `past_key_values` to `cache`: a model written for either
    gets its cache under its own name (an unknown keyword would land in `**kwargs`, cache unused)."""
    from transformers import LlamaForCausalLM

    class OldStyle(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class PassesThrough(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    installed = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
    assert cache_keyword(OldStyle()) == "past_key_values"
    assert cache_keyword(tiny_model("llama")) == installed
    assert cache_keyword(PassesThrough(tiny_model("llama").config)) == installed
    # Through the verifier, the cache fills: a keyword the model ignored would leave it empty.
    model = tiny_model("qwen2")
    cache = make_cache(model)
    TreeForward(model).prefill(cache, [3, 4, 5])
    assert cache.get_seq_length() == 3


def test_greedy_choices_read_every_rows_argmax_at_once():
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(rows, 50, generator=generator) for rows in (1, 4, 17)]
    assert greedy_choices(logits) == [rows.argmax(dim=-1).tolist() for rows in logits]
