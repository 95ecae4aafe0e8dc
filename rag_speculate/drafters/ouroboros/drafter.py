"""Ouroboros (Zhao et al., 2024): a small draft model, sped up and extended by a phrase pool.

A proposal has the paper's two parts, and one of ours:

- Sentence draft. The draft model extends the context phrase by phrase: in ONE draft forward it
  checks the pool's phrases that start with the last token (merged by common prefixes, tree
  attention), keeps the longest one it agrees with plus its own next token, and rolls its KV
  cache back to those tokens (draft_model.py). With an empty pool this is plain greedy decoding
  of the draft model, one token per forward. It stops once the draft holds `gamma` tokens.
- Longer draft. The `K` newest pool phrases starting with the sentence draft's last token hang
  after it as candidate suffixes, so the target verifies draft and suffixes in its one forward.
- Beyond the paper, the draft model's next-best token at each chain position hangs beside the
  chain token there (`alternatives`): its probability is already computed, it costs no draft
  forward, and where the draft model hesitates the target's one forward checks both.

After the target's verification (`observe`):

- Candidate inspiration: where the draft, after its first rejected token, still agrees with the
  target for `beta - 1` tokens in a row, the target's `beta` tokens there become a phrase.
- Candidate refinement: each suffix candidate is replaced by the target's tokens at its positions.

Node scores estimate the target's acceptance: on the draft chain, the running product of the draft
model's own probability for each token, scaled by a calibration counted from verifications (as
transformers' assisted generation stops at a confidence threshold, the chain stops where this
estimate no longer pays); suffix nodes multiply the chain end's score by their share of the
candidates and a separate suffix rate per token; an alternative's is the chance the target
reaches its position times its own calibrated probability. The pool persists across generations
(the paper's warm start) and can be saved with `PhrasePool.save`.

Simplified from the paper, for hardware where every token fed to a forward costs:

- Lookahead decoding's Jacobi window, which the paper runs inside each draft forward to harvest
  n-grams for the pool, is off by default (`lookahead=0`): its rows make every draft forward
  dearer. Without it the pool learns from the draft model's own sentence drafts, the accepted
  output, the prompt and documents, inspiration and refinement.
- A draft forward checks only the pool nodes that pay for their cost: up to `draft_tree_budget`
  best-first, cut by `budget.best_prefix` with the draft model's timed cost curve and the rate at
  which it has agreed with pool phrases (the paper checks all W candidates).
- The sentence draft also stops when its next token's expected acceptance falls below the score
  floor: what drafting one more token costs, a draft forward plus the row it adds to the
  target's forward, over a target forward (`DraftContext.target_cost`), since a token accepted with
  probability s saves s target steps; `min_score` pins it. The next token's estimate is unknown
  until its draft forward has run, so the chain's score so far is weighed by the typical estimate
  of a drafted token (a running average). It also stops at the depth the engine verified last
  time, and pauses after drafts the engine verified none of (pacing.py). The paper always drafts `gamma`.
- The draft model drafts greedily, also when the target samples (verification stays exact).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...decoding.budget import CostModel, best_prefix
from ...decoding.tree import ROOT, DraftTree
from ...decoding.verify import Verification
from ...devices import same_device
from ...errors import InvalidArgumentError
from ...fingerprint import tokenizer_fingerprint
from ..agreement import DecayingRate, agreement_trials
from ..base import DraftContext, Drafter, Target
from ..frequency_trie import best_subtree, frequency_trie
from .config import OuroborosConfig
from .draft_model import Alternative, DraftModel
from .lookahead import JacobiWindow
from .pacing import DepthLimit
from .phrase_pool import Phrase, PhrasePool, PhrasePoolError

DRAFT_SOURCE = "draft_model"
ALTERNATIVE_SOURCE = "draft_alternative"
POOL_SOURCE = "pool"


class OuroborosDrafter(Drafter):
    """Drafts with `draft_model`, which must share the target's tokenizer; see the module docstring
    and `OuroborosConfig` for the options. `pool`: a phrase pool to start from (one saved by an
    earlier run); None builds one of the config's `W` and `beta`."""

    name = "ouroboros"
    paces_itself = True  # DepthLimit

    def __init__(
        self,
        draft_model: PreTrainedModel,
        draft_tokenizer: PreTrainedTokenizerBase,
        config: OuroborosConfig | None = None,
        *,
        pool: PhrasePool | None = None,
    ):
        self.config = config = config or OuroborosConfig()
        self.pool = pool if pool is not None else PhrasePool(config.W, config.beta)
        if config.lookahead and config.lookahead_ngram > self.pool.beta:
            raise InvalidArgumentError(
                f"lookahead_ngram must be at most the pool's beta={self.pool.beta} (its longest phrase), "
                f"got {config.lookahead_ngram}"
            )
        self.draft = DraftModel(
            draft_model, draft_tokenizer, lean=config.lean, head_vocabulary=config.head_vocabulary,
            tree_budget=config.draft_tree_budget, prompt_cache_bytes=config.prompt_cache_bytes,
        )  # fmt: skip
        self._floor = self._score_floor(None)
        # Seconds the last `propose` spent, so a caller can judge whether the draft model pays for itself.
        self.last_propose_s = 0.0
        # The rates describe the model pair, not one request, so they outlive generations.
        self._calibration = DecayingRate(1.0, memory=config.calibration_memory)
        self._alternative_calibration = DecayingRate(1.0, memory=config.calibration_memory)
        self._typical_estimate = 1.0  # of a drafted token's acceptance, what the next one is expected to get
        self._suffix_rate = DecayingRate(config.suffix_prior)
        self._pool_rate = DecayingRate(config.pool_prior)
        self._reset()

    @property
    def draft_forwards(self) -> int:
        return sum(self.draft.draft_forward_sizes.values())

    def _reset(self) -> None:
        self.draft.reset()
        self._learned = 0  # tokens of the context whose beta-gram ending there the pool has seen
        # The last proposal: its chain, the scores and the alternatives beside it, and the pool
        # phrases hung after it, for `observe`.
        self._chain_length = 0
        self._chain_scores: list[float] = []
        self._chain_confidence: list[float] = []
        self._chain_alternatives: list[list[Alternative]] = []
        self._suffixes: list[Phrase] = []
        # Per generation: the engine also cuts drafts to the tokens a generation has left.
        self._depth = DepthLimit(self.config.gamma, self.config.max_pause)
        self._window = JacobiWindow(self.config.lookahead, self.config.lookahead_ngram)

    def attach(self, target: Target) -> None:
        tokenizer, device = target.tokenizer, target.device
        fingerprint = tokenizer_fingerprint(tokenizer)
        if tokenizer_fingerprint(self.draft.tokenizer) != fingerprint:
            raise InvalidArgumentError(
                "the draft model's tokenizer differs from the target's (vocabulary or special tokens), so its "
                "token ids mean other text; pick a draft model of the target's family that shares its tokenizer"
            )
        if self.pool.fingerprint not in (None, fingerprint):
            raise PhrasePoolError(
                "the phrase pool was saved with another tokenizer, so its token ids mean other text; "
                "pass a new PhrasePool or one saved with the target's tokenizer"
            )
        if not same_device(self.draft.device, device):
            raise InvalidArgumentError(
                f"the draft model is on {self.draft.device} but the target on {device}: its drafts are fed to the "
                f"target's forward, so load it there (draft_model.to({str(device)!r}); an int8 draft model runs on the CPU only)"
            )
        if self.draft.embedded < len(tokenizer):
            raise InvalidArgumentError(
                f"the draft model embeds {self.draft.embedded} token ids but the tokenizer has {len(tokenizer)}: "
                "it was built for another tokenizer; pick a draft model of the target's family"
            )
        self.draft.attach(target.vocab_size, target.forward_context(self.draft.model))
        self._target = target

    def fork(self) -> OuroborosDrafter:
        """The same draft model's weights and the same phrase pool (both only read or grown, and
        every generation runs on the engine's one thread); a cache of its own; the rates learnt so
        far copied."""
        other = OuroborosDrafter(self.draft.model, self.draft.tokenizer, self.config, pool=self.pool)
        for name in ("_calibration", "_alternative_calibration", "_suffix_rate", "_pool_rate"):
            setattr(other, name, copy.deepcopy(getattr(self, name)))
        other._typical_estimate = self._typical_estimate
        other.attach(self._target)
        return other

    def start(self, context: DraftContext) -> None:
        """Fresh draft cache, holding the prompt; the pool and the learnt rates are kept (warm start)."""
        self._reset()
        if self.config.learn_from_context:
            for ids in (*context.document_ids, context.prompt_ids):
                self.pool.fill_from(ids)
        self._learned = len(context.prompt_ids)
        self.draft.restrict_head(context.prompt_ids, *context.document_ids)
        # Timed and prefilled here, so `last_propose_s` times drafting alone.
        self._floor = self._score_floor(context.target_cost)
        if context.prompt_ids:
            self.draft.prefill(context.prompt_ids)

    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        started = time.perf_counter()
        try:
            return self._propose(tokens, budget)
        finally:
            self.last_propose_s = time.perf_counter() - started

    def _propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        self._learn_output(tokens)
        self._chain_length, self._suffixes = 0, []
        # Old evidence fades with every step, drafted or not, so a pair whose drafts stopped
        # paying is tried again later.
        self._suffix_rate.decay()
        self._calibration.decay()
        if budget < 1:
            return DraftTree.empty()
        length = min(self.config.gamma, budget, self._depth.allowed())
        if length < 1:
            return DraftTree.empty()
        chain = self._sentence_draft(self.draft.rollback(tokens[:-1]), tokens[-1], length)[:budget]
        self._chain_length = len(chain)
        self._chain_scores = self._chain_scores[: len(chain)]
        self._chain_alternatives = self._chain_alternatives[: len(chain)]
        if budget > len(chain) and chain[-1] not in self.draft.eos:
            self._suffixes = self.draft.usable(self.pool.candidates(chain[-1], self.config.K))
        return self._longer_draft(chain, budget)

    # --- the sentence draft -------------------------------------------------------------------

    def _estimate(self, calibration: DecayingRate, probability: float) -> float:
        """The target's acceptance of a draft token, from the draft model's probability for it."""
        return min(1.0, probability * calibration.rate)

    def _sentence_draft(self, pending: list[int], root: int, length: int) -> list[int]:
        """Greedy draft-model tokens after `root`, phrase by phrase, until `length` or the score floor.

        The chain's score is the running product of its tokens' calibrated estimates; the draft
        stops once that times the typical estimate of a drafted token falls below the score floor
        (the next draft forward would cost more than the target time it is expected to save); the
        first forward always runs (whether to draft at all is `DepthLimit`'s). `pending`, context
        the draft cache lacks, is fed with the first draft forward: a forward over a few more
        tokens costs little more than over one, a forward of its own a whole one.
        """
        first, draft, score = root, [], 1.0
        self._chain_scores, self._chain_confidence, self._chain_alternatives = [], [], []
        memory = self.config.typical_memory
        while len(draft) < length and (not draft or score * self._typical_estimate >= self._floor):
            step_tokens, confidence, alternatives = self._draft_step(pending, root)
            pending = []
            for c in confidence:
                estimate = self._estimate(self._calibration, c)
                self._typical_estimate += (estimate - self._typical_estimate) * (1 - memory)
                score *= estimate
                self._chain_scores.append(score)
            self._chain_confidence.extend(confidence)
            self._chain_alternatives.extend(alternatives)
            draft.extend(step_tokens)
            root = step_tokens[-1]
            if any(t in self.draft.eos for t in step_tokens):
                # Whatever follows the end of the text is never accepted.
                draft = draft[: next(i for i, t in enumerate(draft) if t in self.draft.eos) + 1]
                break
        # The draft's own phrases: when it is rejected and drafted again, they are checked whole.
        self.pool.fill_from([first, *draft])
        return draft

    def _draft_step(self, pending: list[int], root: int) -> tuple[list[int], list[float], list[list[Alternative]]]:
        """One draft forward over the pool's phrases after `root` (and the lookahead window); the
        pool and its rate learn from what the draft model agreed with."""
        phrases = self.draft.usable(self.pool.candidates(root))
        tree = self._pool_tree(phrases)
        tree_mode = self.draft.fits_tree(len(pending) + self.config.draft_tree_budget + self._window.rows + 2)
        if tree_mode:
            comb = self._window.tree(self.draft.feedable([*pending, root]))
        else:
            tree, comb = tree.longest_branch(), DraftTree.empty()
        pool_nodes = len(tree)
        step = self.draft.step(pending, root, tree.graft(comb), tree_mode, self.config.alternatives)
        if pool_nodes:
            # The window's nodes follow the pool's and share none of their paths: a path into the
            # window is the pool's phrases rejected at the root.
            into_window = step.walk.accepted_nodes[:1] and step.walk.accepted_nodes[0] >= pool_nodes
            self._pool_rate.observe(*((0, 1) if into_window else agreement_trials(step.walk)))
        if comb.tokens:
            outputs = [step.walk.target_tokens[pool_nodes + row + 1] for row in self._window.last_level_rows()]
            for phrase in self.draft.usable(self._window.advance(outputs)):
                self.pool.add(phrase)
        self._refresh_best(phrases, step.tokens[:-1])
        return step.tokens, step.confidence, step.alternatives

    def _pool_tree(self, phrases: list[Phrase]) -> DraftTree:
        """The phrases' continuations as one tree, cut to the best-first nodes that pay for their cost."""
        self._pool_rate.decay()
        if not phrases or self.config.draft_tree_budget < 1:
            return DraftTree.empty()
        tree = _phrase_tree([p[1:] for p in phrases], self.config.draft_tree_budget, self._pool_rate.rate, POOL_SOURCE)
        return tree.truncated(best_prefix(tree.scores, self.draft.costs()), self.pool.beta)

    def _refresh_best(self, phrases: list[Phrase], accepted: list[int]) -> None:
        """A hit refreshes the newest phrase the draft model followed furthest, as LRU asks."""
        if not accepted:
            return
        for phrase in phrases:
            if list(phrase[1 : 1 + len(accepted)]) == accepted:
                self.pool.add(phrase)
                return

    def _score_floor(self, target_cost: CostModel | None) -> float:
        """The least acceptance estimate worth one more draft forward: what one more drafted token
        costs over a target forward (a token accepted with probability s saves s target steps).

        The token costs its draft forward and, once verified, a row of the target's forward. The
        row is the cost curve's average over 1-9 tokens rather than its first step: the learned
        cost at 1 token mostly keeps its startup timing at a short context (the engine seldom runs
        a forward without a draft), while the sizes drafts use follow the real, longer context.
        """
        if self.config.min_score is not None:
            return self.config.min_score
        if target_cost is None:
            return self.config.fallback_min_score
        row = max(0.0, target_cost(9) - target_cost(1)) / 8
        return min(1.0, (self.draft.costs()(1) + row) / target_cost(1))

    # --- the target's draft -------------------------------------------------------------------

    def _longer_draft(self, chain: list[int], budget: int) -> DraftTree:
        """The chain, the suffix candidates hung after its last token, and the draft model's
        next-best tokens beside each chain token, the `budget` best by score, best first.

        An alternative costs no draft forward, only its place in the target's: where the draft
        model hesitates between two tokens, the target's forward checks both.
        """
        tails = [p[1:] for p in self._suffixes]
        suffix = _phrase_tree(tails, budget - len(chain), self._suffix_rate.rate, POOL_SOURCE, self._chain_scores[-1])
        chain_tree = DraftTree(chain, list(range(-1, len(chain) - 1)), [DRAFT_SOURCE] * len(chain), self._chain_scores)
        tree = chain_tree.graft(suffix, len(chain) - 1)
        reach = [1.0, *self._chain_scores]  # the estimate that the target reaches each chain position
        for j, options in enumerate(self._chain_alternatives):
            for token, p in options:
                score = reach[j] * self._estimate(self._alternative_calibration, p)
                tree = tree.graft(DraftTree([token], [ROOT], [ALTERNATIVE_SOURCE], [score]), j - 1 if j else ROOT)
        return tree.best_first().truncated(budget)

    def observe(self, verification: Verification) -> None:
        tree = verification.tree
        chain = [i for i in range(len(tree)) if tree.source(i) == DRAFT_SOURCE]
        # The accepted path runs down the chain first, then into a suffix or an alternative.
        agreed = sum(tree.source(i) == DRAFT_SOURCE for i in verification.accepted_nodes)
        taken = self._observe_alternatives(verification, agreed)
        if self._chain_length:
            self._depth.observe(self._chain_length, len(chain), agreed + taken)
        if not chain:
            return
        trials = agreed + (agreed < len(chain))
        self._calibration.add(agreed, sum(self._chain_confidence[:trials]))
        self._inspire(verification, chain, agreed)
        if len(chain) == self._chain_length:
            if agreed == len(chain):
                suffix_agreed, trials = agreement_trials(verification)
                self._suffix_rate.observe(suffix_agreed - agreed, trials - agreed)
            self._refine(verification, chain[-1])

    def _observe_alternatives(self, verification: Verification, agreed: int) -> int:
        """Calibrate the alternatives the target reached (those beside the first `agreed + 1` chain
        tokens) against the draft model's probabilities for them; returns how many it took (0 or 1)."""
        tree, depths, taken, expected, trials = verification.tree, verification.tree.depths(), 0, 0.0, 0
        accepted = set(verification.accepted_nodes)
        for i in range(len(tree)):
            if tree.source(i) == ALTERNATIVE_SOURCE and depths[i] <= agreed + 1:
                token = tree.tokens[i]
                expected += dict(self._chain_alternatives[depths[i] - 1])[token]
                taken += i in accepted
                trials += 1
        if trials:
            self._alternative_calibration.add(taken, expected)
        return taken

    # --- what the pool learns -----------------------------------------------------------------

    def _inspire(self, verification: Verification, chain: list[int], agreed: int) -> None:
        """After the first rejected draft token, each run of `beta - 1` draft tokens the target agrees
        with, plus the target's next token, becomes a phrase: the paper's candidate inspiration."""
        beta, target, tokens = self.pool.beta, verification.target_tokens, verification.tree.tokens
        # The target's token at each chain position, given the draft before it, and one past the end.
        predicted = [target[0]] + [target[i + 1] for i in chain]
        run = 0
        for j in range(agreed + 1, len(chain)):
            run = run + 1 if tokens[chain[j]] == predicted[j] else 0
            if run >= beta - 1:
                self.pool.add(predicted[j - beta + 2 : j + 2])

    def _refine(self, verification: Verification, last: int) -> None:
        """Each suffix candidate becomes the target's tokens at its positions: the paper's refinement.

        Only the verified positions are known; a candidate that agreed at all of them keeps the rest.
        """
        children, target = verification.tree.children(), verification.target_tokens
        for phrase in self._suffixes:
            node = children.get(last, {}).get(phrase[1])
            if node is None:
                continue  # cut before the target saw it
            refined = [phrase[0], target[last + 1], target[node + 1]]
            for token in phrase[2:-1]:
                node = children.get(node, {}).get(token)
                if node is None:
                    break
                refined.append(target[node + 1])
            refined = refined[: self.pool.beta]
            if list(phrase[: len(refined)]) == refined:
                refined = list(phrase)
            self.pool.replace(phrase, refined)

    def _learn_output(self, tokens: Sequence[int]) -> None:
        """Every beta-gram ending in the output accepted since the last proposal becomes a phrase."""
        beta = self.pool.beta
        for end in range(max(self._learned + 1, beta), len(tokens) + 1):
            self.pool.add(tokens[end - beta : end])
        self._learned = len(tokens)


def _phrase_tree(phrases: list[Sequence[int]], budget: int, agreement: float, source: str, reach: float = 1.0) -> DraftTree:
    """The phrases merged by common prefixes, the `budget` best nodes, best first (ties: newest phrase first)."""
    if budget < 1 or not phrases:
        return DraftTree.empty()
    return best_subtree(frequency_trie(phrases), budget, source, agreement, reach)
