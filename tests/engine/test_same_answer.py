"""Same request, same answer, in bf16 too: what the prompt cache holds, where it cut a prompt, and
which rows a forward verified beside a token never change that token's logits or the answer
(through the CPU kernels, which compute every row as if alone)."""

from __future__ import annotations

import gzip
import json
from importlib.resources import files

import pytest
import torch
from conftest import tiny_model

from rag_speculate import SpeculativeEngine
from rag_speculate.decoding.forward import TreeForward
from rag_speculate.decoding.kv_cache import make_cache
from rag_speculate.decoding.tree import DraftTree
from rag_speculate.engine.traits import kernel_context



def _kernels(model: torch.nn.Module):
    context, _ = kernel_context(model)
    if context is None:
        pytest.skip(f"the CPU kernels do not serve {next(model.parameters()).dtype} here")
    return context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_last_prompt_tokens_logits_do_not_depend_on_where_the_prompt_was_cut(arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    forward = TreeForward(model, context=_kernels(model))
    ids = [(7 * i + 3) % 90 + 2 for i in range(120)]
    cold = forward.prefill(make_cache(model), ids)
    for cut in (1, 48, 70, 119):  # a cache hit leaves the rest of the prompt to prefill
        cache = make_cache(model)
        forward.prefill(cache, ids[:cut])
        assert torch.equal(forward.prefill(cache, ids[cut:]), cold), cut
    # The last token fed alone after the rest, as decoding feeds it, and as a tree's root with a draft beside it.
    cache = make_cache(model)
    forward.prefill(cache, ids[:-1])
    assert torch.equal(forward.tree(cache, ids[-1], DraftTree([5, 9, 11], [-1, -1, 1]))[0], cold)


@pytest.fixture(scope="module")
def smollm_bf16():
    engine = SpeculativeEngine.from_pretrained("smollm2-135m-instruct", dtype=torch.bfloat16, device="cpu")
    _kernels(engine.model)
    return engine


def _nq_prompts(n: int) -> list[list[dict]]:
    """Natural Questions prompts as a RAG pipeline sends them: a system line, the gold passage, the question."""
    path = files("rag_speculate.retrieval") / "data" / "nq_open_oracle.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as rows:
        items = [json.loads(next(rows)) for _ in range(n)]
    return [
        [{"role": "system", "content": "Answer the question using the passage."},
         {"role": "user", "content": f"{item['ctxs'][0]['text']}\n\nQuestion: {item['question']}"}]
        for item in items
    ]  # fmt: skip


def test_a_question_asked_again_gets_the_same_answer_from_the_prompt_cache(smollm_bf16):
    """The packaged SmolLM2 in bf16: each question asked of an engine without a cache, then twice of
    one with the default cache (the second time from the cache), then as a follow-up turn."""
    cold = SpeculativeEngine(smollm_bf16.model, smollm_bf16.tokenizer, prompt_cache_bytes=0)
    warm = SpeculativeEngine(smollm_bf16.model, smollm_bf16.tokenizer)
    for messages in _nq_prompts(4):
        expected = cold.generate(messages, chat=True, max_new_tokens=16).token_ids
        assert warm.generate(messages, chat=True, max_new_tokens=16).token_ids == expected
        again = warm.generate(messages, chat=True, max_new_tokens=16)
        assert again.stats.cached_prompt_tokens > 0 and again.token_ids == expected
        follow_up = [*messages, {"role": "assistant", "content": again.text}, {"role": "user", "content": "Why?"}]
        warm_follow_up = warm.generate(follow_up, chat=True, max_new_tokens=8)
        assert warm_follow_up.stats.cached_prompt_tokens > len(cold.encode_prompt(messages, chat=True)) // 2
        assert warm_follow_up.token_ids == cold.generate(follow_up, chat=True, max_new_tokens=8).token_ids
