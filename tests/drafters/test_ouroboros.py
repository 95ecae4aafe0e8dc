"""The Ouroboros drafter and its phrase pool: lossless through the engine, and the paper's pool updates."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import CHARS, DEVICE, VOCAB, char_tokenizer, hf_greedy, on_cpu_only, tiny_model
from transformers import LlamaForCausalLM

from rag_speculate import (
    DraftContext,
    DraftTree,
    InvalidArgumentError,
    OuroborosDrafter,
    PhrasePool,
    PhrasePoolError,
    SpeculativeEngine,
)
from rag_speculate.decoding import probe
from rag_speculate.decoding.budget import CostModel
from rag_speculate.decoding.forward import TreeForward
from rag_speculate.decoding.sampling import SamplingParams
from rag_speculate.decoding.verify import Verification, accept
from rag_speculate.drafters.base import Target
from rag_speculate.drafters.ouroboros import OuroborosConfig
from rag_speculate.drafters.ouroboros.int8 import int8_draft_model

# The losslessness tests run through the CPU kernels and through the portable path alike.
pytestmark = pytest.mark.usefixtures("forward_path")

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick", "In 1905, Einstein published"]


def flat_cost(seconds: float = 1.0) -> CostModel:
    # Every forward costs the same: drafting is never skipped because of timing noise.
    return CostModel({1: seconds, 65: seconds}, learn=False)


def make_drafter(draft, tokenizer, pool=None, **options) -> OuroborosDrafter:
    drafter = OuroborosDrafter(draft, tokenizer, OuroborosConfig(**options), pool=pool)
    # A draft forward at a tenth of a target forward: chains stop below acceptance estimates of 0.1.
    drafter.draft.cost_model = flat_cost(0.1)
    return drafter


def make_engine(target, tokenizer, drafter) -> SpeculativeEngine:
    engine = SpeculativeEngine(target, tokenizer, drafter)
    engine.cost_model = flat_cost()
    return engine


def target_says(tree: DraftTree, choices: dict[int, int], default: int = 1) -> Verification:
    """The verification a target gives whose greedy choice after node i (-1: the root) is choices[i]."""
    logits = torch.zeros(len(tree) + 1, VOCAB)
    for row in range(len(tree) + 1):
        logits[row, choices.get(row - 1, default)] = 1.0
    return accept(tree, logits, SamplingParams(), None)


# --- lossless through the engine -------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "draft_overrides", "lookahead", "head"),
    [
        ("llama", {}, 0, None),
        ("qwen2", {}, 0, None),
        ("gpt2", {}, 0, None),
        ("gemma3", {}, 0, None),  # sliding-window layers in the draft cache
        # Embedding tables padded differently: the draft may argmax ids the target lacks, and the
        # target may emit ids the draft cannot read.
        ("llama", {"vocab_size": VOCAB + 24}, 0, None),
        ("llama", {"vocab_size": 80}, 0, None),
        # Lookahead decoding's window in every draft forward.
        ("qwen2", {}, 3, None),
        ("gemma3", {}, 3, None),
        ("llama", {"vocab_size": 80}, 3, None),
        # A draft head over a few ids: the target emits tokens the draft model cannot propose.
        ("qwen2", {}, 0, 8),
        ("llama", {"vocab_size": 80}, 3, 8),
    ],
)
def test_greedy_output_matches_generate(arch, draft_overrides, lookahead, head, tokenizer):
    target = tiny_model(arch, seed=0)
    draft = tiny_model(arch, seed=1, num_hidden_layers=1, **draft_overrides)
    drafter = make_drafter(draft, tokenizer, min_score=0.0, lookahead=lookahead, lookahead_ngram=3, head_vocabulary=head)
    engine = make_engine(target, tokenizer, drafter)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        reference = hf_greedy(target, ids, 40)
        for documents in (None, [reference]):
            result = engine.generate(ids, documents=documents, max_new_tokens=40)
            assert result.token_ids == reference
    assert len(drafter.pool) > 0
    assert drafter.last_propose_s > 0


def test_a_restricted_head_scores_the_lowest_ids_and_those_of_prompt_and_documents(tokenizer):
    target = tiny_model("llama", seed=0)
    drafter = make_drafter(tiny_model("llama", seed=0), tokenizer, head_vocabulary=4, K=0)
    engine = make_engine(target, tokenizer, drafter)
    prompt = tokenizer.encode(PROMPTS[0])
    reference = hf_greedy(target, prompt, 48)
    # The answer's tokens come with a document: the copy of the target can still propose them.
    result = engine.generate(prompt, documents=[reference], max_new_tokens=48)
    assert result.token_ids == reference
    head = set(range(4)) | set(tokenizer.all_special_ids) | set(prompt) | set(reference)
    assert sorted(drafter.draft._head_ids) == sorted(head)  # each id once
    assert result.stats.accepted_tokens["draft_model"] > 24
    # Without that document, it proposes only ids its head scores (the output stays the target's).
    result = engine.generate(prompt, max_new_tokens=48)
    assert result.token_ids == reference
    drafted = drafter.propose(prompt + reference[:10], 12)
    assert drafted.tokens and set(drafted.tokens) <= set(range(4)) | set(tokenizer.all_special_ids) | set(prompt)


def test_a_draft_model_equal_to_the_target_gets_long_drafts_accepted(tokenizer):
    target = tiny_model("llama", seed=0)
    drafter = make_drafter(tiny_model("llama", seed=0), tokenizer)
    engine = make_engine(target, tokenizer, drafter)
    ids = tokenizer.encode(PROMPTS[0])
    reference = hf_greedy(target, ids, 48)
    result = engine.generate(ids, max_new_tokens=48)
    assert result.token_ids == reference
    assert result.stats.tokens_per_forward > 2
    assert result.stats.accepted_tokens["draft_model"] > 24


@on_cpu_only  # int8 drafting is for CPU draft models
def test_an_int8_draft_model_keeps_the_output_identical(tokenizer):
    target = tiny_model("qwen2", seed=0)
    draft = int8_draft_model(tiny_model("qwen2", seed=0))
    assert not any(isinstance(m, torch.nn.Linear) for m in draft.modules())
    engine = make_engine(target, tokenizer, make_drafter(draft, tokenizer))
    ids = tokenizer.encode(PROMPTS[0])
    result = engine.generate(ids, max_new_tokens=40)
    assert result.token_ids == hf_greedy(target, ids, 40)
    # Quantized, the copy of the target still predicts it: its drafts get accepted.
    assert result.stats.accepted_tokens["draft_model"] > 10


class IgnoresCustomMasks(LlamaForCausalLM):
    """Stands for a draft model whose forward drops a 4D mask and attends causally."""

    def forward(self, *args, attention_mask=None, **kwargs):
        return super().forward(*args, attention_mask=None, **kwargs)


@pytest.mark.parametrize(("kind", "fed"), [pytest.param("int8", 1 + 6, marks=on_cpu_only), ("ignores masks", 1 + 3)])
def test_pool_phrases_are_checked_as_a_tree_where_the_draft_model_honours_the_mask(kind, fed, tokenizer):
    base = tiny_model("llama", seed=3)
    if kind == "int8":
        # int8 quantizes a forward's rows together, so its logits move with the rows beside them and
        # the target's exact check fails; the mask is honoured all the same.
        draft = int8_draft_model(base)
        assert probe.tree_attention(TreeForward(draft))
    else:
        draft = IgnoresCustomMasks(base.config).to(DEVICE).eval()
        draft.load_state_dict(base.state_dict())
    # Its own forward (the lean one honours masks whatever the model's forward does).
    drafter = make_drafter(
        draft, tokenizer, gamma=1, K=0, alternatives=0, min_score=0.0, learn_from_context=False, lean=False
    )
    drafter.attach(Target(tokenizer, VOCAB, DEVICE))
    ids = tokenizer.encode(PROMPTS[1])
    for phrase in ((ids[-1], 5, 6, 7), (ids[-1], 8, 9, 10)):
        drafter.pool.add(phrase)
    drafter.start(DraftContext(ids, [], VOCAB))
    drafter.propose(ids, budget=16)
    # One draft forward: the root and both phrases' tokens, or only the longest branch's.
    assert drafter.draft.draft_forward_sizes == {fed: 1}


def test_the_lookahead_window_puts_the_draft_models_own_ngrams_in_the_pool(tokenizer):
    draft = tiny_model("llama", seed=3)
    drafter = make_drafter(
        draft, tokenizer, K=0, alternatives=0, min_score=0.0, learn_from_context=False, lookahead=3, lookahead_ngram=3
    )
    drafter.attach(Target(tokenizer, VOCAB, DEVICE))
    ids = tokenizer.encode(PROMPTS[1])
    drafter.start(DraftContext(ids[:-1], [], VOCAB))
    # Two levels of guesses for the 3 tokens after the root and the 3 after those, shifted by one.
    levels = [[5, 6, 7], [8, 9, 10]]
    drafter._window.levels = [list(level) for level in levels]

    tokens, _, _ = drafter._draft_step([], ids[-1])

    def greedy_next(sequence: list[int]) -> int:
        return int(draft(torch.tensor([sequence], device=draft.device)).logits[0, -1].argmax())

    # Column i continues level 0 up to i, then its own guess below: its output is the draft model's
    # greedy token there, and the column with its output is a 3-gram of the draft model's text.
    outputs = [greedy_next(ids + levels[0][: i + 1] + [levels[1][i]]) for i in range(3)]
    assert sorted(drafter.pool) == sorted((levels[0][i], levels[1][i], outputs[i]) for i in range(3))
    # The oldest level goes, the outputs come in as the newest.
    assert drafter._window.levels == [levels[1], outputs]
    # The window's rows ride in the same draft forward and change nothing the draft model drafts.
    assert drafter.draft.draft_forward_sizes == {1 + 6: 1}
    assert tokens[0] == greedy_next(ids)


def first_chain(tokenizer, target_cost: CostModel | None = None, draft_cost: CostModel | None = None, **kwargs) -> DraftTree:
    """The first proposal for PROMPTS[1] of a fresh drafter whose random draft model drafts a chain
    alone (no pool, no suffixes, no alternatives); `draft_cost` pins its forward's cost."""
    ids = tokenizer.encode(PROMPTS[1])
    drafter = make_drafter(tiny_model("llama", seed=3), tokenizer, gamma=12, K=0, alternatives=0, learn_from_context=False, **kwargs)
    if draft_cost is not None:
        drafter.draft.cost_model = draft_cost
    drafter.attach(Target(tokenizer, VOCAB, DEVICE))
    drafter.start(DraftContext(ids, [], VOCAB, target_cost))
    return drafter.propose(ids, budget=16)


def test_drafts_stop_where_a_draft_forward_costs_more_than_it_is_expected_to_save(tokenizer):
    lengths = [len(first_chain(tokenizer, target_cost)) for target_cost in (flat_cost(0.1), flat_cost(1000.0))]
    # As dear as a target forward: only a token the target surely takes is worth a draft forward,
    # and a random draft model is never sure, so it stops after its first token. A ten-thousandth of
    # a target forward: it drafts on until its estimates fall below 1e-4 (a random model: a few tokens).
    assert lengths[0] == 1 and lengths[1] >= 4


def test_the_row_a_drafted_token_adds_to_the_targets_forward_counts_against_drafting_it(tokenizer):
    # A draft forward costs a ten-thousandth of a target forward either way; in the second curve the
    # target's second row costs as much as its first, so a drafted token costs a whole target forward.
    curves = (CostModel({1: 1.0, 65: 1.0}, learn=False), CostModel({1: 1.0, 2: 2.0, 65: 65.0}, learn=False))
    lengths = [len(first_chain(tokenizer, target_cost, flat_cost(1e-4))) for target_cost in curves]
    assert lengths[0] >= 4 and lengths[1] == 1


def test_a_draft_forward_runs_only_while_the_token_it_would_draft_is_expected_to_clear_the_floor(tokenizer):
    """The floor sits just below the chain's third score: the old rule (the score so far against the
    floor) ran a fourth draft forward; the fourth token is expected at that score times the typical
    estimate of a drafted token, below the floor, so the chain ends at three."""
    free = first_chain(tokenizer, draft_cost=flat_cost(), min_score=0.0)
    assert len(free) == 12 and all(score < 1 for score in free.scores[:3])
    assert len(first_chain(tokenizer, draft_cost=flat_cost(), min_score=free.scores[2] * 0.999)) == 3


def test_sampling_is_reproducible_with_a_seed(tokenizer):
    target = tiny_model("qwen2", seed=0)
    drafter = make_drafter(tiny_model("qwen2", seed=0), tokenizer)
    engine = make_engine(target, tokenizer, drafter)
    runs = [engine.generate(PROMPTS[1], max_new_tokens=32, temperature=0.8, top_p=0.9, seed=7) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert len(runs[0].token_ids) > 0
    assert engine.generate(PROMPTS[1], max_new_tokens=32, temperature=1.5, seed=8).stats.target_forwards > 0


def test_warm_start_reuses_the_pool_of_earlier_generations(tokenizer):
    target = tiny_model("llama", seed=0)
    drafter = make_drafter(tiny_model("llama", seed=0), tokenizer, learn_from_context=False)
    engine = make_engine(target, tokenizer, drafter)
    ids = tokenizer.encode(PROMPTS[0])
    reference = hf_greedy(target, ids, 48)
    results, forwards = [], []
    for _ in range(2):
        before = drafter.draft_forwards
        results.append(engine.generate(ids, max_new_tokens=48))
        forwards.append(drafter.draft_forwards - before)
        assert len(drafter.pool) > 0
    assert [r.token_ids for r in results] == [reference, reference]
    # The draft model now checks whole remembered phrases per forward, and suffixes get accepted.
    assert forwards[1] < forwards[0] / 2
    assert results[1].stats.accepted_tokens["pool"] >= results[0].stats.accepted_tokens["pool"]
    assert results[1].stats.target_forwards <= results[0].stats.target_forwards


def test_drafting_pauses_while_the_engine_verifies_none_of_it(tokenizer):
    target = tiny_model("llama", seed=0)
    drafter = make_drafter(tiny_model("llama", seed=0), tokenizer)
    engine = SpeculativeEngine(target, tokenizer, drafter)
    # Every extra token costs a whole forward: no draft can pay, the engine verifies none.
    engine.cost_model = CostModel({1: 1.0, 2: 2.0, 17: 17.0}, learn=False)
    ids = tokenizer.encode(PROMPTS[0])
    result = engine.generate(ids, max_new_tokens=48)
    assert result.token_ids == hf_greedy(target, ids, 48)
    assert sum(result.stats.drafted_tokens.values()) == 0
    # One draft, then probes after pauses of 1, 2, 4, ... proposals.
    assert drafter.draft_forwards <= 12 + 6


# --- the sentence draft ----------------------------------------------------------------------


def test_the_sentence_draft_is_the_draft_models_greedy_continuation_phrase_by_phrase(tokenizer):
    draft = tiny_model("llama", seed=3)
    drafter = make_drafter(
        draft, tokenizer, gamma=12, beta=8, K=0, alternatives=0, min_score=0.0, learn_from_context=False
    )
    drafter.attach(Target(tokenizer, VOCAB, DEVICE))
    ids = tokenizer.encode(PROMPTS[1])
    expected = hf_greedy(draft, ids, 12)

    drafter.start(DraftContext(ids, [], VOCAB))
    tree = drafter.propose(ids, budget=16)
    # An empty pool: plain greedy decoding, one token per forward.
    assert tree.tokens == expected and tree.parents == list(range(-1, 11))
    assert set(tree.sources) == {"draft_model"}
    assert drafter.draft_forwards == 12

    # Its own phrases are now in the pool: the same draft comes in whole phrases.
    drafter.start(DraftContext(ids, [], VOCAB))
    tree = drafter.propose(ids, budget=16)
    assert tree.tokens[:12] == expected
    assert drafter.draft_forwards - 12 <= 5


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_output_the_draft_cache_lacks_rides_with_the_first_draft_forward(arch, tokenizer):
    draft = tiny_model(arch, seed=3)
    drafter = make_drafter(draft, tokenizer, gamma=6, K=0, alternatives=0, min_score=0.0, learn_from_context=False)
    drafter.attach(Target(tokenizer, VOCAB, DEVICE))
    ids = tokenizer.encode(PROMPTS[1])
    expected = hf_greedy(draft, ids, 6)
    drafter.start(DraftContext(ids[:-5], [], VOCAB))
    forwards = []
    # The embedding runs once per forward, the model's own or the lean one.
    draft.get_input_embeddings().register_forward_hook(lambda *_: forwards.append(1))
    # The engine accepted 5 tokens the draft model has not seen (drafted by another drafter).
    tree = drafter.propose(ids, budget=6)
    assert tree.tokens == expected
    # No forward of its own for those tokens: they lead the first draft forward.
    assert len(forwards) == drafter.draft_forwards > 0


def test_scores_are_best_first_and_the_target_sees_chain_then_suffixes(tokenizer):
    drafter = make_drafter(
        tiny_model("llama", seed=3), tokenizer, gamma=4, beta=4, K=3, alternatives=0, min_score=0.0,
        learn_from_context=False,
    )
    drafter.attach(Target(tokenizer, VOCAB, DEVICE))
    ids = tokenizer.encode(PROMPTS[1])
    drafter.start(DraftContext(ids, [], VOCAB))
    chain = drafter.propose(ids, budget=16).tokens
    last = chain[-1]
    # So none of the draft's own phrases, refreshed by the next proposal, starts with `last`.
    assert last not in (ids[-1], *chain[:-1])
    for tail in ((13, 14, 15), (5, 6, 7), (5, 8, 9), (10, 11, 12)):
        drafter.pool.add((last, *tail))

    drafter.start(DraftContext(ids, [], VOCAB))
    tree = drafter.propose(ids, budget=16)
    n = len(chain)
    assert tree.tokens[:n] == chain and tree.sources == ["draft_model"] * n + ["pool"] * (len(tree) - n)
    assert all(a >= b for a, b in zip(tree.scores, tree.scores[1:]))
    # The three newest candidates, merged on their common first token, hang after the chain; the
    # first token two of them share ranks first.
    assert len(tree) == n + 8 and 13 not in tree.tokens[n:]
    assert [tree.tokens[i] for i in range(n, len(tree)) if tree.parents[i] == n - 1] == [5, 10]
    assert tree.truncated(n + 2, 100).tokens[n:] == [5, 10]


def test_the_draft_models_next_best_tokens_hang_beside_the_chain(tokenizer):
    draft = tiny_model("llama", seed=3)
    drafter = make_drafter(draft, tokenizer, gamma=4, K=0, min_score=0.0, learn_from_context=False)
    drafter.attach(Target(tokenizer, VOCAB, DEVICE))
    ids = tokenizer.encode(PROMPTS[1])
    drafter.start(DraftContext(ids, [], VOCAB))
    tree = drafter.propose(ids, budget=16)
    chain = [i for i, source in enumerate(tree.sources) if source == "draft_model"]
    assert [tree.tokens[i] for i in chain] == hf_greedy(draft, ids, 4)
    assert all(a >= b for a, b in zip(tree.scores, tree.scores[1:]))
    with torch.inference_mode():
        logits = draft(torch.tensor([ids + [tree.tokens[i] for i in chain]], device=draft.device)).logits[0, len(ids) - 1 :]
    beside = {}
    for i, source in enumerate(tree.sources):
        if source == "draft_alternative":
            beside.setdefault(tree.parents[i], []).append(tree.tokens[i])
    # Beside each chain token, under the same parent, the draft model's second choice there.
    assert beside == {([-1, *chain][j]): [logits[j].topk(2).indices[1].item()] for j in range(4)}

    # The target takes the alternative to the first token: the draft model delivered.
    alternative = next(i for i in range(len(tree)) if tree.parents[i] == -1 and tree.sources[i] == "draft_alternative")
    verification = target_says(tree, {-1: tree.tokens[alternative], alternative: 1})
    assert verification.accepted_tokens == [tree.tokens[alternative], 1]
    drafter.observe(verification)
    tokens = ids + verification.accepted_tokens
    tree = drafter.propose(tokens, budget=16)
    assert len(tree) > 0
    # The engine verified only an alternative (it outranked the chain token beside it), which the
    # target took: drafting goes on.
    alternative = next(i for i in range(len(tree)) if tree.parents[i] == -1 and tree.sources[i] == "draft_alternative")
    only = DraftTree([tree.tokens[alternative]], [-1], ["draft_alternative"], [tree.scores[alternative]])
    drafter.observe(target_says(only, {-1: only.tokens[0], 0: 2}))
    tokens = [*tokens, only.tokens[0], 2]
    tree = drafter.propose(tokens, budget=16)
    assert len(tree) > 0
    # It missed both: the target verified and rejected them, and drafting goes on, in full.
    first = [i for i in range(len(tree)) if tree.parents[i] == -1]
    miss = next(t for t in range(VOCAB) if t not in [tree.tokens[i] for i in first])
    drafter.observe(target_says(tree, {-1: miss}))
    tokens = [*tokens, miss]
    tree = drafter.propose(tokens, budget=16)
    assert tree.sources.count("draft_model") == 4
    # The engine verified none of it (no prefix paid): drafting pauses for one proposal.
    drafter.observe(target_says(DraftTree.empty(), {-1: 3}))
    tokens = [*tokens, 3]
    assert len(drafter.propose(tokens, budget=16)) == 0
    assert len(drafter.propose([*tokens, 4], budget=16)) > 0


# --- inspiration and refinement ------------------------------------------------------------


def test_candidate_inspiration_takes_the_targets_phrases_after_the_first_rejection(tokenizer):
    drafter = make_drafter(
        tiny_model("llama", seed=3), tokenizer, gamma=8, beta=4, K=0, alternatives=0, min_score=0.0,
        learn_from_context=False,
    )
    ids = tokenizer.encode(PROMPTS[1])
    drafter.start(DraftContext(ids, [], VOCAB))
    tree = drafter.propose(ids, budget=8)
    c = tree.tokens
    assert len(c) == 8
    x, y = (c[1] + 1) % VOCAB, (c[5] + 1) % VOCAB
    # The target takes c[0], wants x instead of c[1], agrees with c[2..4], wants y instead of
    # c[5], agrees with c[6..7] and then says 1.
    choices = {-1: c[0], 0: x, 1: c[2], 2: c[3], 3: c[4], 4: y, 5: c[6], 6: c[7], 7: 1}
    before = set(drafter.pool)
    verification = target_says(tree, choices)
    assert verification.accepted_tokens == [c[0], x]
    drafter.observe(verification)
    # Only the run of beta - 1 = 3 agreeing tokens after the rejection, plus the target's next one.
    assert set(drafter.pool) - before == {(c[2], c[3], c[4], y)}


def test_candidate_refinement_replaces_suffixes_with_the_targets_tokens(tokenizer):
    drafter = make_drafter(
        tiny_model("llama", seed=3), tokenizer, gamma=1, beta=4, K=3, alternatives=0, min_score=0.0,
        learn_from_context=False,
    )
    ids = tokenizer.encode(PROMPTS[1])
    drafter.start(DraftContext(ids, [], VOCAB))
    last = drafter.propose(ids, budget=16).tokens[0]
    assert last != ids[-1]  # so the pool below is not used for the sentence draft itself
    a, b, c = (last, 5, 6, 7), (last, 5, 8, 9), (last, 10, 11, 12)
    for phrase in (a, b, c):
        drafter.pool.add(phrase)
    drafter.start(DraftContext(ids, [], VOCAB))
    tree = drafter.propose(ids, budget=16)
    assert tree.tokens[0] == last and len(tree) == 1 + 8
    node = {path: i for i, path in enumerate(_paths(tree))}
    choices = {
        -1: last,
        node[(last,)]: 5,
        node[(last, 5)]: 8,  # b goes on, a's 6 is rejected
        node[(last, 5, 6)]: 40,
        node[(last, 5, 8)]: 9,
        node[(last, 5, 8, 9)]: 41,  # b agreed throughout
        node[(last, 10)]: 43,
        node[(last, 10, 11)]: 44,
    }
    verification = target_says(tree, choices)
    assert verification.accepted_tokens == [last, 5, 8, 9, 41]
    drafter.observe(verification)
    # a and c take the target's tokens at their positions; b, which the target followed, stays.
    assert set(drafter.pool.candidates(last)) == {(last, 5, 8, 9), (last, 5, 8, 40), (last, 5, 43, 44)}


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append((*(paths[parent] if parent != -1 else ()), token))
    return paths


# --- the pool --------------------------------------------------------------------------------


def test_pool_keeps_the_W_most_recently_used_phrases_per_first_token():
    pool = PhrasePool(W=2, beta=3)
    pool.add((1, 2, 3))
    pool.add((1, 4, 5))
    pool.add((1, 2, 3))  # re-insert refreshes: (1, 4, 5) is now the oldest
    pool.add((1, 6, 7))
    assert pool.candidates(1) == [(1, 6, 7), (1, 2, 3)]
    assert pool.candidates(1, k=1) == [(1, 6, 7)]
    pool.add((9, 9))
    assert len(pool) == 3 and pool.candidates(2) == []
    # A prefix of a stored phrase refreshes it; an extension supersedes it.
    pool.add((1, 2))
    assert pool.candidates(1) == [(1, 2, 3), (1, 6, 7)]
    pool.add((9, 9, 1))
    assert pool.candidates(9) == [(9, 9, 1)] and len(pool) == 3
    pool.replace((1, 6, 7), (1, 6, 8))
    assert pool.candidates(1) == [(1, 6, 8), (1, 2, 3)]
    pool.replace((4, 4, 4), (4, 5))  # an evicted old phrase: the new one is still added
    assert pool.candidates(4) == [(4, 5)] and len(pool) == 4


def test_pool_memory_is_bounded_by_W_per_token_whatever_the_input():
    pool = PhrasePool(W=3, beta=4)
    pool.fill_from([i % 5 for i in range(1000)] + list(range(5, 5000)))
    assert all(len(pool.candidates(t)) <= 3 for t in range(5000))
    assert len(pool) == sum(len(pool.candidates(t)) for t in range(5000))
    # Later phrases win: the corpus's last beta-gram is held.
    assert pool.candidates(4995) == [(4995, 4996, 4997, 4998)]
    strided = PhrasePool(W=3, beta=4)
    strided.fill_from(np.arange(20), stride=4)
    assert list(strided) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15), (16, 17, 18, 19)]


@pytest.mark.parametrize("phrase", [(1,), (1, 2, 3, 4), (1, -2), (1, 2.0)])
def test_pool_refuses_invalid_phrases(phrase):
    with pytest.raises(InvalidArgumentError):
        PhrasePool(W=2, beta=3).add(phrase)


def test_pool_save_load_round_trip(tmp_path, tokenizer):
    pool = PhrasePool(W=3, beta=4)
    pool.fill_from(tokenizer.encode("the quick brown fox jumps over the lazy dog, the quick red fox"))
    path = tmp_path / "pools" / "pool.json"
    pool.save(path, tokenizer)
    loaded = PhrasePool.load(path, tokenizer)
    assert (loaded.W, loaded.beta, len(loaded)) == (3, 4, len(pool))
    assert list(loaded) == list(pool)
    assert all(loaded.candidates(t) == pool.candidates(t) for t in range(VOCAB))
    assert [p.name for p in path.parent.iterdir()] == ["pool.json"]  # no temporary file left


def test_pool_load_errors_name_the_file_and_the_fix(tmp_path, tokenizer):
    pool = PhrasePool(W=3, beta=4)
    pool.fill_from(tokenizer.encode("the quick brown fox"))
    path = tmp_path / "pool.json"
    pool.save(path, tokenizer)
    data = json.loads(path.read_text())

    with pytest.raises(PhrasePoolError, match="another tokenizer") as error:
        PhrasePool.load(path, char_tokenizer(chars=CHARS[::-1]))
    assert str(path) in str(error.value) and "pool.save" in str(error.value)

    path.write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(PhrasePoolError, match="format version 99"):
        PhrasePool.load(path, tokenizer)

    text = json.dumps(data)
    path.write_text(text[: len(text) // 2])
    with pytest.raises(PhrasePoolError, match="truncated or corrupt") as error:
        PhrasePool.load(path, tokenizer)
    assert str(path) in str(error.value)

    path.write_text(json.dumps({**data, "phrases": data["phrases"][:-1]}))
    with pytest.raises(PhrasePoolError, match="checksum"):
        PhrasePool.load(path, tokenizer)

    path.write_text(json.dumps({"some": "json"}))
    with pytest.raises(PhrasePoolError, match="not a rag-speculate phrase pool"):
        PhrasePool.load(path, tokenizer)

    with pytest.raises(PhrasePoolError, match="does not exist"):
        PhrasePool.load(tmp_path / "missing.json", tokenizer)


# --- refused at engine construction ----------------------------------------------------------


def test_engine_refuses_a_draft_model_with_other_token_ids(tmp_path, tokenizer):
    target = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=1)
    with pytest.raises(InvalidArgumentError, match="tokenizer differs"):
        SpeculativeEngine(target, tokenizer, OuroborosDrafter(draft, char_tokenizer(chars=CHARS[::-1])))
    with pytest.raises(InvalidArgumentError, match="embeds 40 token ids but the tokenizer has 77"):
        SpeculativeEngine(target, tokenizer, OuroborosDrafter(tiny_model("llama", seed=1, vocab_size=40), tokenizer))

    other = char_tokenizer(chars=CHARS[::-1])
    PhrasePool().save(tmp_path / "pool.json", other)
    pool = PhrasePool.load(tmp_path / "pool.json", other)
    with pytest.raises(PhrasePoolError, match="another tokenizer"):
        SpeculativeEngine(target, tokenizer, OuroborosDrafter(draft, tokenizer, pool=pool))


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("gamma", 0),
        ("K", -1),
        ("draft_tree_budget", 1.5),
        ("alternatives", -1),
        ("min_score", 2.0),
        ("lookahead", -1),
        ("lookahead_ngram", 1),
        ("head_vocabulary", 0),
    ],
)
def test_drafter_refuses_invalid_arguments(argument, value, tokenizer):
    with pytest.raises(InvalidArgumentError, match=argument):
        OuroborosConfig(**{argument: value})


def test_drafter_refuses_lookahead_ngrams_longer_than_the_pools_phrases(tokenizer):
    with pytest.raises(InvalidArgumentError, match="lookahead_ngram must be at most the pool's beta=4"):
        OuroborosDrafter(tiny_model("llama"), tokenizer, OuroborosConfig(beta=4, lookahead=2, lookahead_ngram=5))
