"""Greedy output must be token-identical to `model.generate(do_sample=False)` in fp32, whatever the drafter."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, hf_greedy, tiny_model
from drafters_for_tests import RandomTreeDrafter

from rag_speculate import NGramTrieDrafter, SpeculativeEngine
from rag_speculate.decoding.budget import CostModel

# The losslessness tests run through the CPU kernels and through the portable path alike.
pytestmark = pytest.mark.usefixtures("forward_path")

ARCHS = ["llama", "qwen2", "mistral", "gemma3", "gpt2"]
PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick", "In 1905, Einstein published", "a"]


@pytest.mark.parametrize("arch", ARCHS)
def test_trie_drafter_matches_generate(arch, tokenizer):
    model = tiny_model(arch)
    engine = SpeculativeEngine(model, tokenizer)
    assert engine.traits.tree_attention
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        reference = hf_greedy(model, ids, 48)
        # The reference itself as a document makes long drafts get accepted (deep gathers);
        # an unrelated document makes most of them get rejected.
        for documents in ([reference], ["completely unrelated text about cats and hats"], None):
            result = engine.generate(ids, documents=documents, max_new_tokens=48)
            assert result.token_ids == reference
            assert result.stats.new_tokens == len(reference)
        assert engine.generate(ids, documents=[reference], max_new_tokens=48).stats.tokens_per_forward > 2


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [1, 5, 16, 40])
def test_adversarial_random_trees_match_generate(arch, budget, tokenizer):
    model = tiny_model(arch, seed=1)
    for i, prompt in enumerate(PROMPTS[:2]):
        ids = tokenizer.encode(prompt)
        reference = hf_greedy(model, ids, 40)
        drafter = RandomTreeDrafter(VOCAB, reference, seed=i)
        engine = SpeculativeEngine(model, tokenizer, drafter, draft_budget=budget)
        result = engine.generate(ids, max_new_tokens=40)
        assert result.token_ids == reference
        stats = result.stats
        if len(reference) > 10:
            assert stats.target_forwards < len(reference)  # the hidden true paths were found
        # Each forward emits its accepted drafts plus one token of its own, unless EOS cut the last one short.
        expected = stats.target_forwards + stats.accepted_tokens["random_tree"]
        assert stats.new_tokens in (expected, expected - 1)
        # Each decode forward is counted once, by the tokens it fed: its verified nodes + 1.
        assert sum(stats.forward_sizes.values()) == stats.target_forwards - 1
        assert max(stats.forward_sizes) <= budget + 1
        assert sum((q - 1) * n for q, n in stats.forward_sizes.items()) >= stats.accepted_tokens["random_tree"]


def test_engine_is_reusable_and_string_documents_are_tokenized_once(tokenizer):
    model = tiny_model("qwen2")
    engine = SpeculativeEngine(model, tokenizer, NGramTrieDrafter())
    ids = tokenizer.encode(PROMPTS[0])
    reference = hf_greedy(model, ids, 32)
    document = tokenizer.decode(reference)
    first = engine.generate(PROMPTS[0], documents=[document], max_new_tokens=32)
    second = engine.generate(PROMPTS[0], documents=[document], max_new_tokens=32)
    assert first.token_ids == second.token_ids == reference
    assert len(engine._inputs.documents) == 1


def test_eos_ends_at_the_same_token_as_generate(tokenizer):
    model = tiny_model("llama", seed=2)
    ids = tokenizer.encode(PROMPTS[1])
    unconstrained = hf_greedy(model, ids, 40)
    # Make a token the model emits mid-answer the EOS, so accepted paths run past it.
    eos = unconstrained[17]
    model.generation_config.eos_token_id = eos
    reference = hf_greedy(model, ids, 40)
    assert reference[-1] == eos and len(reference) < 40
    engine = SpeculativeEngine(model, tokenizer)
    result = engine.generate(ids, documents=[unconstrained], max_new_tokens=40)
    assert result.token_ids == reference
    assert result.finish_reason == "eos"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_max_new_tokens_is_exact(max_new_tokens, tokenizer):
    model = tiny_model("llama")
    ids = tokenizer.encode(PROMPTS[0])
    reference = hf_greedy(model, ids, max_new_tokens)
    engine = SpeculativeEngine(model, tokenizer)
    result = engine.generate(ids, documents=[hf_greedy(model, ids, 30)], max_new_tokens=max_new_tokens)
    assert result.token_ids == reference
    assert result.finish_reason == "length"


def test_sliding_window_beyond_window_falls_back_to_chains_losslessly(tokenizer, tmp_path, monkeypatch):
    # A window shorter than the generation: tree masks would have to encode the window too, so
    # the engine verifies chains with the model's own (sliding) masks instead. An empty cache: the
    # cost curve is timed here, and its probe forwards must respect the window as well.
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(tmp_path))
    model = tiny_model("gemma3", seed=3, sliding_window=8)
    ids = tokenizer.encode(PROMPTS[0])
    reference = hf_greedy(model, ids, 40)
    engine = SpeculativeEngine(model, tokenizer)
    engine._costs()  # timed through the window's chains, then pinned flat: drafts pay whatever the timing said
    engine.cost_model = CostModel({1: 1.0, engine.draft_budget + 1: 1.0}, learn=False)
    result = engine.generate(ids, documents=[reference], max_new_tokens=40)
    assert result.stats.verification == "chain"
    assert result.token_ids == reference
    assert result.stats.tokens_per_forward > 2


def test_model_without_4d_masks_falls_back_with_one_warning(tokenizer):
    from transformers import LlamaForCausalLM

    class RejectsCustomMasks(LlamaForCausalLM):
        """Stands for models (remote code, custom kernels) whose forward rejects a 4D mask."""

        def forward(self, *args, attention_mask=None, **kwargs):
            if attention_mask is not None and attention_mask.dim() == 4:
                raise ValueError("custom 4D attention masks are not supported")
            return super().forward(*args, attention_mask=attention_mask, **kwargs)

    base = tiny_model("llama")
    model = RejectsCustomMasks(base.config).eval()
    model.load_state_dict(base.state_dict())
    model.generation_config = base.generation_config
    ids = tokenizer.encode(PROMPTS[0])
    reference = hf_greedy(model, ids, 40)
    with pytest.warns(RuntimeWarning, match="longest draft branch") as caught:
        engine = SpeculativeEngine(model, tokenizer)
    # Ours only: a library's deprecation warnings are not the fallback's.
    assert sum(issubclass(w.category, RuntimeWarning) for w in caught) == 1
    result = engine.generate(ids, documents=[reference], max_new_tokens=40)
    assert result.stats.verification == "chain"
    assert result.token_ids == reference
    assert result.stats.tokens_per_forward > 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_generate(tokenizer):
    model = tiny_model("qwen2").to("cuda")
    ids = tokenizer.encode(PROMPTS[0])
    reference = hf_greedy(model, ids, 40)
    result = SpeculativeEngine(model, tokenizer).generate(ids, documents=[reference], max_new_tokens=40)
    assert result.token_ids == reference
