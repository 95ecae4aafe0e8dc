"""The combined drafter: one tree from several drafters, lossless, credited per source, skipping what does not pay."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from conftest import VOCAB, hf_greedy, tiny_model
from drafters_for_tests import RandomTreeDrafter

from rag_speculate import (
    CombinedDrafter,
    Datastore,
    DraftContext,
    Drafter,
    DraftTree,
    InvalidArgumentError,
    NGramTrieDrafter,
    RESTDrafter,
    SpeculativeEngine,
    Verification,
)
from rag_speculate.decoding.budget import CostModel

# The losslessness tests run through the CPU kernels and through the portable path alike.
pytestmark = pytest.mark.usefixtures("forward_path")


class FixedDrafter(Drafter):
    """Proposes the same tree every step, and records what it is told."""

    def __init__(self, name: str, tree: DraftTree, delay_s: float = 0.0):
        self.name, self.tree, self.delay_s = name, tree, delay_s
        self.seen: list[Verification] = []
        self.proposals = 0

    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        self.proposals += 1
        time.sleep(self.delay_s)
        return self.tree

    def observe(self, verification: Verification) -> None:
        self.seen.append(verification)


def paths_of(tree: DraftTree) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append((*(paths[parent] if parent != -1 else ()), token))
    return paths


def flat_cost_engine(model, tokenizer, drafter) -> SpeculativeEngine:
    engine = SpeculativeEngine(model, tokenizer, drafter)
    engine.cost_model = CostModel({1: 1.0, 65: 1.0}, learn=False)
    return engine


def test_equal_paths_merge_and_the_best_estimates_win():
    a = FixedDrafter("a", DraftTree([5, 6, 7], [-1, 0, 1], ["a"] * 3, [0.9, 0.8, 0.3]))
    b = FixedDrafter("b", DraftTree([5, 9, 8], [-1, 0, -1], ["b"] * 3, [0.5, 0.7, 0.6]))
    combined = CombinedDrafter([a, b])
    tree = combined.propose([1, 2], budget=4)
    assert dict(zip(paths_of(tree), tree.scores)) == pytest.approx({(5,): 0.9, (5, 6): 0.8, (5, 9): 0.7, (8,): 0.6})
    assert tree.scores == sorted(tree.scores, reverse=True)
    assert tree.sources == ["a", "a", "b", "b"]


def test_a_child_never_ranks_above_its_parent():
    a = FixedDrafter("a", DraftTree([5, 6], [-1, 0], ["a"] * 2, [0.2, 0.2]))
    b = FixedDrafter("b", DraftTree([5, 6, 7], [-1, 0, 1], ["b"] * 3, [0.1, 0.9, 0.9]))
    tree = CombinedDrafter([a, b]).propose([1], budget=3)
    assert tree.tokens == [5, 6, 7] and tree.parents == [-1, 0, 1]
    for prefix in range(1, 4):
        assert len(tree.truncated(prefix, 99)) == prefix


def test_each_drafter_sees_the_verification_of_its_own_nodes():
    a = FixedDrafter("a", DraftTree([5, 6], [-1, 0], ["a"] * 2, [0.9, 0.8]))
    b = FixedDrafter("b", DraftTree([7, 5, 6, 4], [-1, -1, 1, 2], ["b"] * 4, [0.1, 0.5, 0.4, 0.3]))
    combined = CombinedDrafter([a, b])
    merged = combined.propose([1], budget=8)
    # The target accepts 5, 6 and then says 3; it would have said 2 after 7 and 9 after 4.
    targets_by_path = {(): 5, (5,): 6, (5, 6): 3, (7,): 2, (5, 6, 4): 9}
    paths = paths_of(merged)
    target_tokens = [targets_by_path[()]] + [targets_by_path[p] for p in paths]
    accepted = [paths.index((5,)), paths.index((5, 6))]
    combined.observe(Verification(merged, accepted, [5, 6, 3], target_tokens))
    (seen_a,), (seen_b,) = a.seen, b.seen
    assert seen_a.tree.tokens == [5, 6] and seen_a.accepted_nodes == [0, 1] and seen_a.accepted_tokens == [5, 6, 3]
    assert seen_a.target_tokens == [5, 6, 3]
    assert seen_b.tree.tokens == [7, 5, 6, 4] and seen_b.accepted_nodes == [1, 2] and seen_b.accepted_tokens == [5, 6, 3]
    assert seen_b.target_tokens == [5, 2, 6, 3, 9]


def test_a_slow_drafter_that_adds_nothing_is_skipped_and_retried():
    good = FixedDrafter("good", DraftTree([5], [-1], ["good"], [0.9]))
    slow = FixedDrafter("slow", DraftTree([8], [-1], ["slow"], [0.9]), delay_s=0.01)
    combined = CombinedDrafter([good, slow])

    def steps_asked(steps: int) -> list[int]:
        asked = []
        for step in range(steps):
            before = slow.proposals
            tree = combined.propose([1], budget=4)
            time.sleep(0.002)  # the target's forward
            combined.observe(Verification(tree, [tree.tokens.index(5)], [5, 3], [5] + [3] * len(tree)))
            if slow.proposals > before:
                asked.append(step)
        return asked

    # Measured once, then skipped for 4, 8, 16 steps with a retry after each.
    assert steps_asked(40) == [0, 5, 14, 31]
    assert good.proposals == 40
    # A new generation starts the retries afresh (its cost, five target steps, is still known).
    combined.start(DraftContext([1], [], VOCAB))
    assert steps_asked(8) == [4]


@pytest.mark.parametrize("paces_itself", [False, True])
def test_a_dear_drafter_is_asked_only_when_the_cheaper_ones_found_little(paces_itself):
    strong = DraftTree([1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 3, 4], ["trie"] * 6, [0.95] * 6)
    trie = FixedDrafter("trie", strong)
    model = FixedDrafter("model", DraftTree([7, 8], [-1, 0], ["model"] * 2, [0.9, 0.8]), delay_s=0.02)
    model.paces_itself = paces_itself
    combined = CombinedDrafter([trie, model])
    asked = []
    for step in range(10):
        trie.tree = DraftTree.empty() if step % 2 == 0 else strong
        before = model.proposals
        tree = combined.propose([1], budget=16)
        asked.append(model.proposals > before)
        time.sleep(0.03)  # the target's forward
        combined.observe(accepting(tree, [7, 8, 0] if step % 2 == 0 else [1, 2, 3, 4, 5, 6, 0]))
    # Only where the trie found nothing; there it pays (3 tokens per 0.05 s against 1 per 0.03 s),
    # so it is never skipped as unpaid.
    assert asked == [step % 2 == 0 for step in range(10)]


def test_one_rejected_draft_does_not_keep_a_dear_drafter_off():
    trie = FixedDrafter("trie", DraftTree.empty())
    model = FixedDrafter("model", DraftTree([7, 8], [-1, 0], ["model"] * 2, [0.9, 0.8]), delay_s=0.005)
    combined = CombinedDrafter([trie, model])
    for step in range(12):
        tree = combined.propose([1], budget=16)
        time.sleep(0.03)  # the target's forward
        # Its first draft is rejected; then it has 2 tokens accepted every other step.
        combined.observe(accepting(tree, [7, 8, 0] if step % 2 else [0]))
    # 1 token per 0.035 s on average against 1 per 0.03 s without it: it pays, so it is always asked.
    assert model.proposals == 12


def test_a_drafter_that_paces_itself_is_not_judged_on_its_averages():
    trie = FixedDrafter("trie", DraftTree.empty())
    model = FixedDrafter("model", DraftTree([7, 8], [-1, 0], ["model"] * 2, [0.9, 0.8]), delay_s=0.01)
    model.paces_itself = True  # its pauses are its own (it proposes on every step here)
    combined = CombinedDrafter([trie, model])
    for step in range(16):
        tree = combined.propose([1], budget=16)
        time.sleep(0.03)  # the target's forward
        # Rejected for 8 steps (1 token per 0.04 s against 1 per 0.03 s without it), then right.
        combined.observe(accepting(tree, [7, 8, 0] if step >= 8 else [0]))
    # Judged on its averages it would be skipped after its trial and miss most of the second half.
    assert model.proposals == 16


def test_a_drafter_that_paces_itself_is_retried_after_one_slow_proposal():
    trie = FixedDrafter("trie", DraftTree.empty())
    model = FixedDrafter("model", DraftTree([7, 8], [-1, 0], ["model"] * 2, [0.9, 0.8]), delay_s=0.1)
    model.paces_itself = True
    combined = CombinedDrafter([trie, model])
    for step in range(12):
        tree = combined.propose([1], budget=16)
        model.delay_s = 0.002  # the first proposal caught up on a long context; the next ones are quick
        time.sleep(0.03)  # the target's forward
        combined.observe(accepting(tree, [7, 8, 0]))
    # 3 tokens per 0.13 s looks worse than 1 per 0.03 s, but a retry measures it again.
    assert model.proposals > 2


def test_one_bad_first_proposal_does_not_outweigh_earlier_generations():
    trie = FixedDrafter("trie", DraftTree.empty())
    chain = DraftTree([7, 8, 9, 6], [-1, 0, 1, 2], ["model"] * 4, [0.9] * 4)
    model = FixedDrafter("model", chain, delay_s=0.01)
    model.paces_itself = True
    combined = CombinedDrafter([trie, model])

    def generation(steps: int, first_delay_s: float) -> int:
        combined.start(DraftContext([1], [], VOCAB))
        before = model.proposals
        for step in range(steps):
            model.delay_s = first_delay_s if step == 0 else 0.01
            tree = combined.propose([1], budget=16)
            time.sleep(0.03)  # the target's forward
            # The first proposal of the second generation is slow and rejected, like a long chain wrong at its start.
            combined.observe(accepting(tree, [0] if step == 0 and first_delay_s > 0.01 else [7, 8, 9, 6, 0]))
        return model.proposals - before

    assert generation(10, 0.01) == 10
    # Alone, that proposal would say 1 token per 0.13 s against 1 per 0.03 s without it; with ten
    # steps of 5 tokens per 0.04 s behind it, it is asked again at once.
    assert generation(6, 0.1) == 6


def test_rejected_retrieval_drafts_are_trusted_less_until_verified_again():
    good = FixedDrafter("good", DraftTree([5], [-1], ["good"], [0.95]))
    junk = FixedDrafter("junk", DraftTree([8], [-1], ["junk"], [0.9]))
    model = FixedDrafter("model", DraftTree([9], [-1], ["model"], [0.9]))
    model.paces_itself = True
    combined = CombinedDrafter([good, junk, model], skip_unpaid=False)

    def proposed() -> tuple[DraftTree, dict[str, float]]:
        tree = combined.propose([1], budget=4)
        return tree, dict(zip(tree.sources, tree.scores))

    for _ in range(3):
        tree, _ = proposed()
        combined.observe(accepting(tree, [5, 0]))  # the good drafter's token is accepted, the others' rejected
    _, after = proposed()
    # A retrieval drafter's scores are corrected within a few rejections; a drafter that paces
    # itself, whose own probabilities score its drafts, less.
    assert after["junk"] < 0.4 and after["model"] > 0.55
    for _ in range(20):
        proposed()
        combined.observe(accepting(DraftTree([5], [-1], ["good"], [0.95]), [5, 0]))
    # Steps that verified none of its nodes say nothing of its estimates.
    _, later = proposed()
    assert later["junk"] == pytest.approx(after["junk"]) and later["model"] == pytest.approx(after["model"])


def test_calibrated_estimates_settle_at_the_acceptance_rate():
    half = FixedDrafter("half", DraftTree([5], [-1], ["half"], [0.8]))
    combined = CombinedDrafter([half], skip_unpaid=False)
    for step in range(60):
        tree = combined.propose([1], budget=4)
        combined.observe(accepting(tree, [5 if step % 2 else 7, 0]))  # its token is accepted every other step
    estimate = combined.propose([1], budget=4).scores[0]
    # Counted against its rescaled estimates instead, the rescaling undid itself and settled near 0.63.
    assert estimate == pytest.approx(0.5, abs=0.06)


def test_a_drafter_earns_no_trust_on_nodes_another_drafter_ranked():
    # REST beside a draft model: it often proposes the draft model's token too, at a low prior.
    # Credited with those acceptances, its calibration rose to 2 on math answers while the nodes its
    # own estimates ranked were almost never accepted, and those were then verified at inflated estimates.
    model = FixedDrafter("model", DraftTree([5], [-1], ["model"], [0.9]))
    echo = FixedDrafter("echo", DraftTree([5], [-1], ["echo"], [0.2]))
    combined = CombinedDrafter([model, echo], skip_unpaid=False)
    for _ in range(10):
        tree = combined.propose([1], budget=4)
        combined.observe(accepting(tree, [5, 0]))
    echo.tree = DraftTree([7], [-1], ["echo"], [0.2])
    tree = combined.propose([1], budget=4)
    assert dict(zip(tree.sources, tree.scores))["echo"] == pytest.approx(0.2)


def accepting(tree: DraftTree, says: list[int]) -> Verification:
    """The verification by a target whose choices along the way are `says`."""
    children, node, path = tree.children(), -1, []
    while (child := children.get(node, {}).get(says[len(path)])) is not None:
        path.append(child)
        node = child
    bonus = says[len(path)]
    return Verification(tree, path, [tree.tokens[i] for i in path] + [bonus], [bonus] * (len(tree) + 1))


def test_a_cheap_drafter_is_kept_while_it_has_not_helped_yet():
    cheap = FixedDrafter("cheap", DraftTree([8], [-1], ["cheap"], [0.9]))
    combined = CombinedDrafter([cheap])
    for _ in range(8):
        tree = combined.propose([1], budget=4)
        time.sleep(0.25)  # a forward >1000 times the drafter's time (a trie lookup next to a CPU forward)
        combined.observe(Verification(tree, [], [3], [3, 3]))
    assert cheap.proposals == 8


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_combined_drafters_match_generate(arch, tokenizer):
    model = tiny_model(arch, seed=1)
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog. the quick")
    reference = hf_greedy(model, ids, 48)
    store = Datastore.build([reference[10:], tokenizer.encode("unrelated words about hats")], vocab_size=VOCAB)
    # A tiny model's forward takes about as long as drafting: keep every drafter, to test them all.
    drafters = [NGramTrieDrafter(), RESTDrafter(store), RandomTreeDrafter(VOCAB, reference, seed=3)]
    engine = flat_cost_engine(model, tokenizer, CombinedDrafter(drafters, skip_unpaid=False))
    for documents in ([reference[:20]], None):
        result = engine.generate(ids, documents=documents, max_new_tokens=48)
        assert result.token_ids == reference
        assert set(result.stats.accepted_tokens) <= {"ngram_trie", "rest", "random_tree"}
        # Every forward emits one token of the target's own; an accepted EOS leaves its bonus unused.
        stats = result.stats
        assert stats.new_tokens - stats.target_forwards <= sum(stats.accepted_tokens.values()) <= stats.new_tokens - 1
    assert result.stats.accepted_tokens["rest"] > 0


def test_combined_sampling_is_reproducible(tokenizer):
    model = tiny_model("llama", seed=3)
    engine = flat_cost_engine(model, tokenizer, [NGramTrieDrafter(), RandomTreeDrafter(VOCAB, seed=1)])
    assert isinstance(engine.drafter, CombinedDrafter)  # a list of drafters is combined
    ids = tokenizer.encode("a b a b a b")
    runs = [engine.generate(ids, max_new_tokens=24, temperature=0.8, seed=7).token_ids for _ in range(2)]
    assert runs[0] == runs[1]


def test_bad_drafter_lists_are_refused(tokenizer):
    with pytest.raises(InvalidArgumentError, match="non-empty list"):
        CombinedDrafter([])
    with pytest.raises(InvalidArgumentError, match="distinct"):
        CombinedDrafter([NGramTrieDrafter(), NGramTrieDrafter()])
    with pytest.raises(InvalidArgumentError, match="drafter must be a Drafter"):
        SpeculativeEngine(tiny_model("llama"), tokenizer, "ngram_trie")


def test_start_reaches_every_drafter():
    a, b = FixedDrafter("a", DraftTree.empty()), FixedDrafter("b", DraftTree.empty())
    started = []
    a.start = b.start = started.append
    CombinedDrafter([a, b]).start(DraftContext([1], [], VOCAB))
    assert len(started) == 2
