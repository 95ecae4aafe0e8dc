"""The prompt cache: exact prefixes only, outputs unchanged cold, warm, in part and after eviction,
a byte budget never exceeded, and safe under threads."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from conftest import hf_greedy, tiny_model

from rag_speculate import InvalidArgumentError, NGramTrieDrafter, SpeculativeEngine
from rag_speculate.decoding.kv_cache import make_cache
from rag_speculate.decoding.prompt_cache import PromptCache, kv_bytes_per_token
from rag_speculate.drafters import Drafter

pytestmark = pytest.mark.usefixtures("forward_path")
ARCHS = ["llama", "qwen2", "mistral", "gpt2"]
PROMPT = "the quick brown fox jumps over the lazy dog. the quick"
OTHER = "the quick brown fox sleeps under a tall oak tree, as foxes"


class _Prefills:
    """The tokens each generation's first forward (its prefill) feeds the model: seen by its
    embedding, which the model's own forward and its lean forward both call."""

    def __init__(self, model):
        self.fed: list[int] = []
        self._first = True
        model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self._first:
            self.fed.append(args[0].shape[1])
        self._first = False

    def next_generation(self):
        self._first = True


def _generate(engine, prefills, ids, n, **kwargs):
    prefills.next_generation()
    result = engine.generate(ids, max_new_tokens=n, **kwargs)
    return result, prefills.fed[-1]


@pytest.mark.parametrize("arch", ARCHS)
def test_outputs_are_generates_cold_warm_in_part_and_after_eviction(arch, tokenizer):
    model = tiny_model(arch)
    engine = SpeculativeEngine(model, tokenizer)
    engine.generate([1, 2, 3], max_new_tokens=2)  # times the cost curve before the hook counts
    engine.prompt_cache.clear()
    prefills = _Prefills(model)
    ids, other = tokenizer.encode(PROMPT), tokenizer.encode(OTHER)
    reference = hf_greedy(model, ids, 24)

    cold, fed = _generate(engine, prefills, ids, 24, documents=[reference])
    assert cold.token_ids == reference and cold.stats.cached_prompt_tokens == 0 and fed == len(ids)

    warm, fed = _generate(engine, prefills, ids, 24, documents=[reference])
    assert warm.token_ids == reference
    # Everything but the last prompt token came from the cache, and only that one was prefilled.
    assert warm.stats.cached_prompt_tokens == len(ids) - 1 and fed == 1

    shared = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)
    part, fed = _generate(engine, prefills, other, 24)
    assert part.token_ids == hf_greedy(model, other, 24)
    assert part.stats.cached_prompt_tokens == shared and fed == len(other) - shared

    # The next turn: the prompt, the answer and more; the answer's entries came from decoding.
    turn = ids + reference + tokenizer.encode(" and then?")
    follow, fed = _generate(engine, prefills, turn, 16)
    assert follow.token_ids == hf_greedy(model, turn, 16)
    assert follow.stats.cached_prompt_tokens >= len(ids) + len(reference) - 1

    # Room for one prompt and its answer: each new one evicts the last, outputs stay the same.
    small = SpeculativeEngine(model, tokenizer, prompt_cache_bytes=100 * kv_bytes_per_token(model))
    for prompt in (ids, other, ids):
        assert small.generate(prompt, max_new_tokens=12).token_ids == hf_greedy(model, prompt, 12)
    assert small.prompt_cache.stats().evictions > 0
    assert small.prompt_cache.stats().bytes <= small.prompt_cache.max_bytes


def test_sampling_with_a_seed_draws_the_same_tokens_warm_as_cold(tokenizer):
    engine = SpeculativeEngine(tiny_model("qwen2"), tokenizer)
    ids = tokenizer.encode(PROMPT)
    cold = engine.generate(ids, max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    warm = engine.generate(ids, max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    assert cold.stats.cached_prompt_tokens == 0 and warm.stats.cached_prompt_tokens == len(ids) - 1
    assert warm.token_ids == cold.token_ids


def _filled_cache(model, tokens):
    cache = make_cache(model)
    with torch.inference_mode():
        model(torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    return cache


def test_the_budget_is_never_exceeded_and_the_accounting_is_exact():
    model = tiny_model("llama")
    per_token = kv_bytes_per_token(model)
    cache = PromptCache(max_bytes=50 * per_token)
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(5, 40, (1,), generator=generator))
        tokens = [3, 4, 5] + torch.randint(2, 12, (n,), generator=generator).tolist()  # shared prefixes, splits
        cache.insert(model, tokens, _filled_cache(model, tokens))
        stats = cache.stats()
        assert stats.bytes <= cache.max_bytes
        assert stats.bytes == sum(node.bytes for node in cache._nodes())
        assert stats.nodes == len(cache._nodes())
    assert cache.stats().evictions > 0
    # A sequence larger than the whole budget is not cached at all.
    tokens = list(range(2, 62))
    before = cache.stats().bytes
    cache.insert(model, tokens, _filled_cache(model, tokens))
    assert cache.stats().bytes == before



def _held(cache, model, tokens):
    return cache.fetch(model, tokens, make_cache(model)).memory


def test_eviction_takes_the_least_recently_used_leaf():
    model = tiny_model("llama")
    cache = PromptCache(max_bytes=10 * kv_bytes_per_token(model))
    a, b, c, d = [2, 3, 4], [5, 6, 7], [8, 9, 10], [11, 12, 13]
    for tokens in (a, b, c):
        cache.insert(model, tokens, _filled_cache(model, tokens))
    assert _held(cache, model, a) == 3  # a is used again: b is now the least recently used
    cache.insert(model, d, _filled_cache(model, d))
    assert cache.stats().evictions == 1
    assert [_held(cache, model, t) for t in (a, b, c, d)] == [3, 0, 3, 3]


def test_a_parent_is_evictable_once_its_last_child_goes():
    model = tiny_model("llama")
    cache = PromptCache(max_bytes=10 * kv_bytes_per_token(model))
    parent, child, recent, new = [2, 3, 4, 5], [2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14]
    for tokens in (parent, child, recent):
        cache.insert(model, tokens, _filled_cache(model, tokens))
    # Room for `new` takes the child, then its parent, now a leaf used before `recent`.
    cache.insert(model, new, _filled_cache(model, new))
    assert cache.stats().evictions == 2 and cache.stats().nodes == 2
    assert [_held(cache, model, t) for t in (child, recent, new)] == [0, 3, 4]


def test_entries_come_back_exactly_as_computed_and_only_for_that_model():
    model = tiny_model("llama")
    tokens = [5, 6, 7, 8, 9, 10]
    full = _filled_cache(model, tokens)
    cache = PromptCache(max_bytes=1 << 20)
    cache.insert(model, tokens[:4], _filled_cache(model, tokens[:4]))
    cache.insert(model, tokens, full)  # a child below the first node
    loaded = make_cache(model)
    assert cache.fetch(model, tokens[:5], loaded).tokens == 5
    for got, want in zip(loaded.layers, full.layers):
        assert torch.equal(got.keys, want.keys[..., :5, :]) and torch.equal(got.values, want.values[..., :5, :])
    # Another model object (even of the same shape) never reads these entries.
    assert cache.fetch(tiny_model("llama"), tokens, make_cache(model)).tokens == 0
    assert cache.stats().bytes == 0


def test_threads_share_one_cache_without_losing_or_double_counting(tokenizer):
    model = tiny_model("llama")
    cache = PromptCache(max_bytes=60 * kv_bytes_per_token(model))
    prompts = [[2 + (i * 7 + j) % 9 for j in range(8 + i % 5)] for i in range(8)]
    filled = [_filled_cache(model, p) for p in prompts]
    errors = []

    def work(i):
        try:
            for round_ in range(20):
                p = prompts[(i + round_) % len(prompts)]
                cache.insert(model, p, filled[(i + round_) % len(prompts)])
                cache.fetch(model, p, make_cache(model))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = cache.stats()
    assert stats.bytes == sum(node.bytes for node in cache._nodes()) <= cache.max_bytes


def test_engines_on_several_threads_give_the_sequential_outputs(tokenizer):
    model = tiny_model("qwen2")
    engine = SpeculativeEngine(model, tokenizer, NGramTrieDrafter())
    prompts = [tokenizer.encode(p) for p in (PROMPT, OTHER, PROMPT + " again", OTHER[:20])]
    expected = [hf_greedy(model, p, 16) for p in prompts]
    results: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: results.update({i: engine.generate(prompts[i % 4], max_new_tokens=16).token_ids}))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(8)] == [expected[i % 4] for i in range(8)]


def test_an_aborted_generation_inserts_nothing(tokenizer):
    class Exploding(Drafter):
        name = "exploding"

        def propose(self, tokens, budget):
            raise RuntimeError("drafter exploded")

    engine = SpeculativeEngine(tiny_model("llama"), tokenizer, Exploding())
    with pytest.raises(RuntimeError, match="drafter exploded"):
        engine.generate(PROMPT, max_new_tokens=8)
    assert engine.prompt_cache.stats().bytes == 0 and engine.prompt_cache.stats().nodes == 0


def test_sliding_window_models_turn_the_cache_off_with_one_log_line(tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="rag_speculate.decoding.prompt_cache"):
        engine = SpeculativeEngine(tiny_model("gemma3"), tokenizer)
    assert engine.prompt_cache.max_bytes == 0
    assert [r.message for r in caplog.records if "prompt cache off" in r.message] == [
        "prompt cache off for Gemma3ForCausalLM: it has sliding-window layers, whose entries depend on what the window forgot"
    ]
    assert engine.generate(PROMPT, max_new_tokens=4).stats.cached_prompt_tokens == 0
    assert engine.generate(PROMPT, max_new_tokens=4).stats.cached_prompt_tokens == 0


@pytest.mark.parametrize("value", [-1, 1.5, True, "1GB"])
def test_a_bad_budget_is_refused_by_name(value, tokenizer):
    with pytest.raises(InvalidArgumentError, match="prompt_cache_bytes"):
        SpeculativeEngine(tiny_model("llama"), tokenizer, prompt_cache_bytes=value)


def test_zero_turns_it_off_and_stats_and_clear_report(tokenizer):
    engine = SpeculativeEngine(tiny_model("llama"), tokenizer, prompt_cache_bytes=0)
    for _ in range(2):
        assert engine.generate(PROMPT, max_new_tokens=4).stats.cached_prompt_tokens == 0
    on = SpeculativeEngine(tiny_model("llama"), tokenizer)
    on.generate(PROMPT, max_new_tokens=4)
    on.generate(PROMPT, max_new_tokens=4)
    stats = on.prompt_cache.stats()
    assert (stats.hits, stats.misses, stats.tokens_reused) == (1, 1, len(tokenizer.encode(PROMPT)) - 1)
    assert stats.bytes > 0 and stats.nodes >= 1
    on.prompt_cache.clear()
    assert on.prompt_cache.stats().bytes == 0
    assert on.generate(PROMPT, max_new_tokens=4).stats.cached_prompt_tokens == 0


def test_a_draft_model_reuses_its_own_prefill(tokenizer):
    from rag_speculate import OuroborosDrafter

    draft = tiny_model("llama", seed=3)
    drafter = OuroborosDrafter(draft, tokenizer)
    model = tiny_model("llama")
    engine = SpeculativeEngine(model, tokenizer, drafter)
    ids = tokenizer.encode(PROMPT)
    first = engine.generate(ids, max_new_tokens=12)
    assert drafter.draft.prompt_cache.stats().tokens_reused == 0
    second = engine.generate(ids, max_new_tokens=12)
    assert second.token_ids == first.token_ids == hf_greedy(model, ids, 12)
    assert drafter.draft.prompt_cache.stats().tokens_reused == len(ids) - 1
