"""Ouroboros (Zhao et al., 2024): a small draft model, sped up and extended by a phrase pool.

A proposal has the paper's two parts, and one of ours:

- Sentence draft. The draft model extends the context phrase by phrase: in ONE draft forward it
  checks the pool's phrases that start with the last token (merged by common prefixes, tree
  attention), keeps the longest one it agrees with plus its own next token, and rolls its KV
  cache back to those tokens. With an empty pool this is plain greedy decoding of the draft
  model, one token per forward. It stops once the draft holds `gamma` tokens.
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
model's own probability for each token, scaled by a factor counted from verifications (how the
target's agreement relates to the draft's confidence; as transformers' assisted generation stops
at a confidence threshold, the chain stops where this estimate no longer pays); suffix nodes
multiply the chain end's score by their share of the candidates and a separate, lower suffix rate
per token; an alternative's is the chance the target reaches its position times its own
calibrated probability. The pool persists across generations (the paper's
warm start) and can be saved with `PhrasePool.save`.

Simplified from the paper, for a 2-core CPU where every token fed to a forward costs:

- Lookahead decoding's Jacobi window (Fu et al., 2023), which the paper runs inside each draft
  forward to harvest n-grams for the pool, is off by default (`lookahead=0`): each of its
  `lookahead * (lookahead_ngram - 1)` rows costs the int8 draft forward 1.5-3 ms against 28 ms
  for a forward of one token, so the paper's window (20 columns of 8-grams, 140 rows) would make
  every draft forward about 15 times dearer, and small windows (4 and 12 rows) did not cut draft
  forwards (docs/benchmarks.md section 4, "Lookahead decoding's window"). Without it the pool
  learns from the draft model's own sentence drafts, the accepted output, the prompt and
  documents, inspiration and refinement.
- A draft forward checks only the pool nodes that pay for their cost: up to `draft_tree_budget`
  best-first, cut by `budget.best_prefix` with the draft model's timed cost curve and the rate at
  which it has agreed with pool phrases (the paper checks all W candidates).
- The sentence draft also stops when its next token's expected acceptance falls below the score
  floor: what drafting one more token costs, a draft forward plus the row it adds to the
  target's forward, over a target forward (`DraftContext.target_cost`), since a token accepted with
  probability s saves s target steps; `min_score` pins it. The next token's estimate is unknown
  until its draft forward has run, so the chain's score so far is weighed by the typical estimate
  of a drafted token (a running average). It also stops at
  the depth the engine verified last time (it verifies only the prefix of a draft that pays for
  its target forward; drafting deeper wastes draft forwards). When the engine verifies none of a
  draft, drafting pauses for 1, 2, 4, ... proposals. The paper always drafts `gamma`.
- The draft model drafts greedily, also when the target samples (verification stays exact).

Measured for the defaults (2 threads, this project's 2-core AVX2 machine, 500 tokens of context;
`benchmarks/forward_cost.py --context 500`, docs/benchmarks.md section 1): one forward of the
1.5b target in fp32 costs 345 ms at q=1 with torch's kernel, 240 ms through the engine's fast
linear kernels (2.0x that at 9, 3.4x at 17; section 1.2). The 0.5b draft costs 120 ms in fp32
with torch's kernel (2.1x at 2, 2.4x at 8, 2.7x at 16), which leaves a draft model roughly
breaking even on this CPU; with its linear layers in int8 (`loading.int8_draft_model`) it costs
45-65 ms, a quarter of a fast target step, and pays where it predicts the target (docs/benchmarks.md
section 4: math and rag, not translation). Drafting runs it through `lean_forward` where that fits
the model (the same logits, a third less time per forward in int8: 43 ms at 1 token, 70 at 8).
Its head scores only the 32,768 lowest ids, the special ones and the prompt's and documents'
(`head_vocabulary`): the 0.5B Qwen's whole head is 28% of its weights, and the restricted one
takes the target's token as often (section 4.5; a forward over 1 token 24 ms against 28).

Hence `draft_tree_budget=16` (a 16-node tree costs 2.4 single-token target forwards in fp32,
and the curve steepens beyond) and the cost-derived score floor (for the int8 draft under the bf16
target on this project's current CPU, about 0.25: a 15 ms draft forward and a 5 ms target row
against an 80 ms target forward).
The target's cost grows slowly from q=9 to 17, yet gamma=16 measured level with the paper's
gamma=12 (docs/benchmarks.md section 4), so 12 is kept, and W=20, beta=8, K=3. Pool trees
rarely pay inside an fp32 draft forward (2 tokens cost twice 1); in int8 the draft curve is
nearly flat to q=8 (44 ms at 1, 62 ms at 8), so checking them is cheap.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..budget import AgreementRate, CostModel, agreement_trials, best_prefix
from ..cpu_linear import fast_linear_works
from ..datastore import tokenizer_fingerprint
from ..errors import InvalidArgumentError
from ..lean_forward import lean_forward
from ..output import eos_token_ids
from ..sampling import SamplingParams
from ..tree import ROOT, DraftTree
from ..verify import Verification, Verifier, accept, keep_cache_entries, make_cache, sliding_window
from .base import DraftContext, Drafter
from .frequency_trie import best_subtree, frequency_trie
from .phrase_pool import Phrase, PhrasePool, PhrasePoolError

DRAFT_SOURCE = "draft_model"
ALTERNATIVE_SOURCE = "draft_alternative"
POOL_SOURCE = "pool"
LOOKAHEAD_SOURCE = "lookahead"
_GREEDY = SamplingParams()
Alternative = tuple[int, float]  # a token the draft model ranked below its choice, and its probability
# Priors of the acceptance rates: how often the target takes a suffix candidate's next token, and
# how often the draft model takes a pool phrase's next token.
_SUFFIX_PRIOR = 0.5
_POOL_PRIOR = 0.75
_CALIBRATION_MEMORY = 0.95  # per proposal: the calibration follows the text being generated
_MAX_PAUSE = 64  # proposals skipped at most after the engine verified none of a draft
_TYPICAL_MEMORY = 0.9  # per drafted token: the typical estimate follows the text being generated
# The score floor when the target's costs are unknown: 0.5b fp32 drafting for 1.5b fp32 here.
_FALLBACK_MIN_SCORE = 0.4


def head_ids(tokenizer: PreTrainedTokenizerBase, lowest: int, vocab_size: int, *contexts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids below `vocab_size` that a draft head restricted to `lowest` scores, in two ascending
    groups: the `lowest` lowest ids (a BPE vocabulary numbers its tokens roughly by how often they
    occur, so these are the common ones) with the special tokens (the end of the text among them),
    the same for every generation; and the other ids of `contexts` (names and rare words an answer
    copies from its prompt and documents)."""
    common = set(range(min(lowest, vocab_size))).union(i for i in tokenizer.all_special_ids if 0 <= i < vocab_size)
    rare = {i for ids in contexts for i in ids if 0 <= i < vocab_size} - common
    return torch.tensor(sorted(common), dtype=torch.long), torch.tensor(sorted(rare), dtype=torch.long)


class OuroborosDrafter(Drafter):
    """Drafts with `draft_model`, which must share the target's tokenizer; see the module docstring.

    `W` and `beta` size the pool built when `pool` is None; a given pool keeps its own. `lean=False`
    runs the draft model through its own forward even where `lean_forward` fits it. `alternatives`:
    how many of the draft model's next-best tokens hang beside each chain token (0: a chain only).
    `lookahead`: columns of lookahead decoding's Jacobi window run in every draft forward (0: none),
    which adds `lookahead` phrases of `lookahead_ngram` tokens to the pool per forward.
    `head_vocabulary`: through the lean forward, the draft model's output head scores only the
    `head_vocabulary` lowest token ids, the special ones and those of each generation's prompt and
    documents (`head_ids`); None: every id.
    """

    name = "ouroboros"
    paces_itself = True  # _DepthLimit

    def __init__(
        self,
        draft_model: PreTrainedModel,
        draft_tokenizer: PreTrainedTokenizerBase,
        *,
        gamma: int = 12,
        W: int = 20,
        beta: int = 8,
        K: int = 3,
        pool: PhrasePool | None = None,
        draft_tree_budget: int = 16,
        alternatives: int = 1,
        min_score: float | None = None,
        learn_from_context: bool = True,
        lean: bool = True,
        lookahead: int = 0,
        lookahead_ngram: int = 4,
        head_vocabulary: int | None = 32768,
    ):
        least = {"gamma": 1, "K": 0, "draft_tree_budget": 0, "alternatives": 0, "lookahead": 0, "lookahead_ngram": 2,
                 "head_vocabulary": 1}
        values = (gamma, K, draft_tree_budget, alternatives, lookahead, lookahead_ngram,
                  1 if head_vocabulary is None else head_vocabulary)
        for arg, value in zip(least, values):
            if not isinstance(value, int) or isinstance(value, bool) or value < least[arg]:
                raise InvalidArgumentError(f"{arg} must be an integer >= {least[arg]}, got {value!r}")
        if min_score is not None and not 0 <= min_score <= 1:
            raise InvalidArgumentError(f"min_score must be in [0, 1] or None (from measured costs), got {min_score}")
        self.draft_model = draft_model.eval()
        self.draft_tokenizer = draft_tokenizer
        self.gamma = gamma
        self.K = K
        self.draft_tree_budget = draft_tree_budget
        self.alternatives = alternatives
        # None: the measured cost of a draft forward over the target's (see `_score_floor`).
        self.min_score = min_score
        self._floor = self._score_floor(None)
        self.learn_from_context = learn_from_context
        self.pool = pool if pool is not None else PhrasePool(W, beta)
        if lookahead and lookahead_ngram > self.pool.beta:
            raise InvalidArgumentError(
                f"lookahead_ngram must be at most the pool's beta={self.pool.beta} (its longest phrase), "
                f"got {lookahead_ngram}"
            )
        self.lookahead = lookahead
        self.lookahead_ngram = lookahead_ngram
        # Draft forward cost by tokens fed, timed at the first `start`; assign one to pin it (tests).
        self.cost_model: CostModel | None = None
        # Seconds the last `propose` spent, and the draft forwards run so far by tokens fed, so a
        # caller can judge whether the draft model pays for itself.
        self.last_propose_s = 0.0
        self.draft_forward_sizes: Counter[int] = Counter()
        # Why the draft model runs its own forward rather than the leaner one (`lean_forward`); "" when lean.
        forward, self.lean_forward_skipped = lean_forward(draft_model) if lean else (None, "lean=False")
        self._verifier = Verifier(draft_model, fast_kernels=fast_linear_works(draft_model)[0], forward=forward)
        self._lean = forward
        self.head_vocabulary = head_vocabulary
        # The ids the draft's logits score, column by column, and each one's column; None: all ids.
        self._head_ids: list[int] | None = None
        self._column: dict[int, int] = {}
        self._tree_attention = True
        self._draft_vocab = draft_model.get_input_embeddings().num_embeddings
        # Ids both models embed: the only ones proposed or fed as pool phrases (set by `attach`).
        self._vocab_size = self._draft_vocab
        self._eos = eos_token_ids(draft_model, draft_tokenizer)
        # The rates describe the model pair, not one request, so they outlive generations.
        self._calibration = _Calibration()
        self._alternative_calibration = _Calibration()
        self._typical_estimate = 1.0  # of a drafted token's acceptance, what the next one is expected to get
        self._suffix_rate = AgreementRate(prior=_SUFFIX_PRIOR)
        self._pool_rate = AgreementRate(prior=_POOL_PRIOR)
        self._reset()

    @property
    def draft_forwards(self) -> int:
        return sum(self.draft_forward_sizes.values())

    def _reset(self) -> None:
        self._cache = make_cache(self.draft_model)
        self._cached: list[int] = []  # the tokens whose keys and values the draft cache holds
        self._learned = 0  # tokens of the context whose beta-gram ending there the pool has seen
        # The last proposal: its chain length and the pool phrases hung after it, for `observe`.
        self._chain_length = 0
        self._chain_scores: list[float] = []
        self._chain_confidence: list[float] = []
        # Per chain position, the draft model's next-best tokens and its probability for each.
        self._chain_alternatives: list[list[Alternative]] = []
        # Per generation: the engine also cuts drafts to the tokens a generation has left.
        self._depth = _DepthLimit(self.gamma)
        self._suffixes: list[Phrase] = []
        self._window = _JacobiWindow(self.lookahead, self.lookahead_ngram)

    def attach(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        fingerprint = tokenizer_fingerprint(tokenizer)
        if tokenizer_fingerprint(self.draft_tokenizer) != fingerprint:
            raise InvalidArgumentError(
                "the draft model's tokenizer differs from the target's (vocabulary or special tokens), so its "
                "token ids mean other text; pick a draft model of the target's family that shares its tokenizer"
            )
        if self.pool.fingerprint not in (None, fingerprint):
            raise PhrasePoolError(
                "the phrase pool was saved with another tokenizer, so its token ids mean other text; "
                "pass a new PhrasePool or one saved with the target's tokenizer"
            )
        if self._draft_vocab < len(tokenizer):
            raise InvalidArgumentError(
                f"the draft model embeds {self._draft_vocab} token ids but the tokenizer has {len(tokenizer)}: "
                "it was built for another tokenizer; pick a draft model of the target's family"
            )
        # Embedding tables may be padded past the tokenizer differently: propose only ids both embed.
        self._vocab_size = min(self._draft_vocab, vocab_size)
        # Its drafts are only checked: a forward whose logits move with the rows beside it (int8)
        # can still draft through a tree.
        self._tree_attention, _ = self._verifier.supports_tree_attention(exact=False)
        # Builds the head's common rows (1.5 s for the 0.5B Qwen) here rather than in a generation.
        self._restrict_head()

    def _restrict_head(self, *contexts: Sequence[int]) -> None:
        if self._lean is None or self.head_vocabulary is None:
            return
        groups = head_ids(self.draft_tokenizer, self.head_vocabulary, self._vocab_size, *contexts)
        self._lean.restrict_head(*(g for g in groups if len(g)))
        self._head_ids = torch.cat(groups).tolist()
        self._column = {t: c for c, t in enumerate(self._head_ids)}

    def start(self, context: DraftContext) -> None:
        """Fresh draft cache, holding the prompt; the pool and the learnt rates are kept (warm start)."""
        self._reset()
        if self.learn_from_context:
            for ids in (*context.document_ids, context.prompt_ids):
                self.pool.fill_from(ids)
        self._learned = len(context.prompt_ids)
        self._restrict_head(context.prompt_ids, *context.document_ids)
        # Timed and prefilled here, so `last_propose_s` times drafting alone.
        self._floor = self._score_floor(context.target_cost)
        if context.prompt_ids:
            self._verifier.prefill(self._cache, self._feedable(context.prompt_ids))
            self._cached = list(context.prompt_ids)

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
        self._suffix_rate.observe(0, 0)
        self._calibration.fade()
        if budget < 1:
            return DraftTree.empty()
        length = min(self.gamma, budget, self._depth.allowed())
        if length < 1:
            return DraftTree.empty()
        chain = self._sentence_draft(self._rollback(tokens[:-1]), tokens[-1], length)[:budget]
        self._chain_length = len(chain)
        self._chain_scores = self._chain_scores[: len(chain)]
        self._chain_alternatives = self._chain_alternatives[: len(chain)]
        if budget > len(chain) and chain[-1] not in self._eos:
            self._suffixes = self._usable(self.pool.candidates(chain[-1], self.K))
        return self._longer_draft(chain, budget)

    # --- the draft model ----------------------------------------------------------------------

    def _rollback(self, context: Sequence[int]) -> list[int]:
        """Drop the cached entries `context` does not continue; returns the tokens of `context` the
        cache still lacks (the output accepted since the last draft), to be fed with the next draft forward."""
        common = 0
        for cached, token in zip(self._cached, context):
            if cached != token:
                break
            common += 1
        if len(self._cached) > common:
            keep_cache_entries(self._cache, len(self._cached) - common, [])
            del self._cached[common:]
        return list(context[common:])

    def _sentence_draft(self, pending: list[int], root: int, length: int) -> list[int]:
        """Greedy draft-model tokens after `root`, phrase by phrase, until `length` or the score floor.

        A token's acceptance estimate is the draft model's own probability for it, calibrated
        against what the target accepted; the chain's score is their running product, and the
        draft stops once that times the typical estimate of a drafted token falls below the score
        floor (the next draft forward would cost more than the target time it is expected to save);
        the first forward always runs (whether to draft at all is `_DepthLimit`'s). `pending`,
        context the draft cache lacks, is fed with the first draft forward: a forward over a few
        more tokens costs little more than over one (int8 0.5B here: 44 ms at 1 token, 62 ms at
        8), a forward of its own a whole one.
        """
        first, draft, score = root, [], 1.0
        self._chain_scores, self._chain_confidence, self._chain_alternatives = [], [], []
        while len(draft) < length and (not draft or score * self._typical_estimate >= self._floor):
            tokens, confidence, alternatives = self._draft_step(pending, root)
            pending = []
            for c in confidence:
                estimate = self._calibration.estimate(c)
                self._typical_estimate += (estimate - self._typical_estimate) * (1 - _TYPICAL_MEMORY)
                score *= estimate
                self._chain_scores.append(score)
            self._chain_confidence.extend(confidence)
            self._chain_alternatives.extend(alternatives)
            draft.extend(tokens)
            root = tokens[-1]
            if any(t in self._eos for t in tokens):
                # Whatever follows the end of the text is never accepted.
                draft = draft[: next(i for i, t in enumerate(draft) if t in self._eos) + 1]
                break
        # The draft's own phrases: when it is rejected and drafted again, they are checked whole.
        self.pool.fill_from([first, *draft])
        return draft

    @torch.inference_mode()
    def _draft_step(self, pending: list[int], root: int) -> tuple[list[int], list[float], list[list[Alternative]]]:
        """One draft forward: feed `pending`, check the pool's phrases after `root`, keep the longest
        agreed plus one token; returns those tokens, the draft model's probability of each, and
        its next-best tokens at each of their positions with their probabilities."""
        phrases = self._usable(self.pool.candidates(root))
        tree = self._pool_tree(phrases)
        window = sliding_window(self._cache)
        fed = len(self._cached) + len(pending) + self.draft_tree_budget + self._window.rows + 2
        if self._tree_attention and (window is None or fed < window):
            forward = self._verifier.forward_tree
            comb = self._window.tree(self._feedable([*pending, root]))
        else:
            tree, forward, comb = tree.longest_branch(), self._verifier.forward_chain, DraftTree.empty()
        pool_nodes, tree = len(tree), _side_by_side(tree, comb)
        first, *forced = self._feedable([*pending, root])
        started = time.perf_counter()
        # The pending tokens and the root lead the tree as a chain; only the rows from the root on are read.
        logits = forward(self._cache, first, _after_chain(forced, tree), len(tree) + 1)
        step = accept(self._in_head(tree), logits[:, : self._vocab_size], _GREEDY, None)
        accepted = self._ids(step.accepted_tokens)
        kept = list(range(len(forced) + 1)) + [len(forced) + 1 + i for i in step.accepted_nodes]
        keep_cache_entries(self._cache, len(forced) + len(tree) + 1, kept)
        self._costs().observe(len(forced) + len(tree) + 1, time.perf_counter() - started)
        self.draft_forward_sizes[len(forced) + len(tree) + 1] += 1
        self._cached.extend([*pending, root, *accepted[:-1]])
        if pool_nodes:
            # The window's nodes follow the pool's and share none of their paths: a path into the
            # window is the pool's phrases rejected at the root.
            into_window = step.accepted_nodes[:1] and step.accepted_nodes[0] >= pool_nodes
            self._pool_rate.observe(*((0, 1) if into_window else agreement_trials(step)))
        if comb.tokens:
            outputs = self._ids([step.target_tokens[pool_nodes + row + 1] for row in self._window.last_level_rows()])
            for phrase in self._usable(self._window.advance(outputs)):
                self.pool.add(phrase)
        self._refresh_best(phrases, accepted[:-1])
        rows = logits[[0, *(i + 1 for i in step.accepted_nodes)], : self._vocab_size].float()
        # Greedy drafting: the first of the top tokens is the drafted one.
        top = torch.softmax(rows, dim=-1).topk(1 + self.alternatives, dim=-1)
        probabilities, ids = top.values.tolist(), [self._ids(row) for row in top.indices.tolist()]
        alternatives = [list(zip(row_ids[1:], row_p[1:])) for row_ids, row_p in zip(ids, probabilities)]
        return accepted, [row[0] for row in probabilities], alternatives

    def _in_head(self, tree: DraftTree) -> DraftTree:
        """`tree` with its tokens as columns of the draft's logits; -1, which no argmax picks, for
        ids a restricted head does not score."""
        if self._head_ids is None:
            return tree
        return dataclasses.replace(tree, tokens=[self._column.get(t, -1) for t in tree.tokens])

    def _ids(self, columns: list[int]) -> list[int]:
        return columns if self._head_ids is None else [self._head_ids[c] for c in columns]

    def _pool_tree(self, phrases: list[Phrase]) -> DraftTree:
        """The phrases' continuations as one tree, cut to the best-first nodes that pay for their cost."""
        self._pool_rate.observe(0, 0)
        if not phrases or self.draft_tree_budget < 1:
            return DraftTree.empty()
        tree = _phrase_tree([p[1:] for p in phrases], self.draft_tree_budget, self._pool_rate.rate, POOL_SOURCE)
        return tree.truncated(best_prefix(tree.scores, self._costs()), self.pool.beta)

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

        The token costs its draft forward and, once verified, a row of the target's forward: in bf16
        here a target forward over 9 tokens costs 1.54 over 1 (docs/benchmarks.md section 4.11), a
        row a third of a draft forward. The row is the curve's average over 1-9 tokens rather than
        its first step: the learned curve's cost at 1 token mostly keeps its startup timing at a
        short context (the engine seldom runs a forward without a draft), while the sizes drafts
        use follow the real, longer context: the difference of the first two sizes would count the
        context's growth in full as one row's cost, the average over 8 rows an eighth of it.
        """
        if self.min_score is not None:
            return self.min_score
        if target_cost is None:
            return _FALLBACK_MIN_SCORE
        row = max(0.0, target_cost(9) - target_cost(1)) / 8
        return min(1.0, (self._costs()(1) + row) / target_cost(1))

    def _costs(self) -> CostModel:
        if self.cost_model is None:
            probe = self._verifier.timed_forward(self._tree_attention)
            self.cost_model = CostModel.measure(probe, self.draft_tree_budget + 1)
        return self.cost_model

    def _feedable(self, ids: Sequence[int]) -> list[int]:
        # A target with a larger padded embedding table may emit an id the draft model cannot read;
        # any id it embeds will do there, its guesses are only checked.
        return [t if t < self._draft_vocab else 0 for t in ids]

    def _usable(self, phrases: list[Phrase]) -> list[Phrase]:
        return [p for p in phrases if max(p) < self._vocab_size]

    # --- the target's draft -------------------------------------------------------------------

    def _longer_draft(self, chain: list[int], budget: int) -> DraftTree:
        """The chain, the suffix candidates hung after its last token, and the draft model's
        next-best tokens beside each chain token, the `budget` best by score, best first.

        An alternative costs no draft forward, only its place in the target's: where the draft
        model hesitates between two tokens, the target's forward checks both.
        """
        tails = [p[1:] for p in self._suffixes]
        suffix = _phrase_tree(tails, budget - len(chain), self._suffix_rate.rate, POOL_SOURCE, self._chain_scores[-1])
        tree = _after_chain(chain, suffix, [DRAFT_SOURCE] * len(chain), self._chain_scores)
        reach = [1.0, *self._chain_scores]  # the estimate that the target reaches each chain position
        beside = [
            (token, j - 1 if j else ROOT, reach[j] * self._alternative_calibration.estimate(p))
            for j, options in enumerate(self._chain_alternatives)
            for token, p in options
        ]
        if not beside:
            return tree
        tokens, parents, scores = (list(column) for column in zip(*beside))
        sources = tree.sources + [ALTERNATIVE_SOURCE] * len(tokens)
        tree = DraftTree(tree.tokens + tokens, tree.parents + parents, sources, tree.scores + scores)
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
        self._calibration.observe(agreed, sum(self._chain_confidence[:trials]))
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
            self._alternative_calibration.observe(taken, expected)
        return taken

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


class _JacobiWindow:
    """Lookahead decoding's 2D window (Fu et al., 2023): `levels` rows of `columns` guesses ahead of
    the draft's root, refined by one Jacobi iteration per draft forward.

    Column i of level j guesses the token i + j + 1 places after the root, given level 0's columns
    up to i and the column's own guesses above j: so the window is a tree (level 0 a chain from the
    root, each column hanging below it) and runs inside the draft forward's tree attention. Each
    forward's outputs at the last level become a new level and the oldest level is dropped; once
    the window is full, each column's guesses plus its output are an n-gram of the draft model's
    own text, for the pool. The window moves one place per forward while the root moves by the
    tokens the forward accepted, so guesses go stale after a long step (lookahead decoding does the
    same); they are only candidates, and the draft model checks level 0 as a draft of its own.
    """

    def __init__(self, columns: int, ngram: int):
        self.columns = columns
        self.ngram = ngram
        self.levels: list[list[int]] = []

    @property
    def rows(self) -> int:
        return self.columns * (self.ngram - 1)

    def tree(self, context: Sequence[int]) -> DraftTree:
        """The window's guesses, level by level (node j * columns + i is column i of level j); on first
        use in a generation, level 0 repeats the last tokens of `context` (any guess will do)."""
        c = self.columns
        if not c:
            return DraftTree.empty()
        if not self.levels:
            tail = list(context[-c:])
            self.levels = [(tail * c)[:c]]
        parents = [i - 1 for i in range(c)] + [(j - 1) * c + i for j in range(1, len(self.levels)) for i in range(c)]
        tokens = [t for level in self.levels for t in level]
        return DraftTree(tokens, parents, [LOOKAHEAD_SOURCE] * len(tokens), [0.0] * len(tokens))

    def last_level_rows(self) -> range:
        """The nodes of `tree` whose next tokens are this iteration's outputs."""
        return range((len(self.levels) - 1) * self.columns, len(self.levels) * self.columns)

    def advance(self, outputs: list[int]) -> list[Phrase]:
        """Take one forward's outputs at the last level; returns the n-grams the window completed."""
        ngrams: list[Phrase] = []
        if len(self.levels) == self.ngram - 1:
            ngrams = [tuple(level[i] for level in self.levels) + (outputs[i],) for i in range(self.columns)]
            self.levels.pop(0)
        self.levels.append(outputs)
        return ngrams


class _Calibration:
    """How the target's acceptance of a draft token relates to the draft model's probability for it:
    estimate = min(1, factor * probability), the factor counted from verifications (faded each step)."""

    def __init__(self, prior_weight: float = 4.0):
        self._prior = prior_weight
        self._agreed = 0.0
        self._expected = 0.0

    def estimate(self, probability: float) -> float:
        return min(1.0, probability * (self._agreed + self._prior) / (self._expected + self._prior))

    def observe(self, agreed: int, expected: float) -> None:
        self._agreed += agreed
        self._expected += expected

    def fade(self) -> None:
        self._agreed *= _CALIBRATION_MEMORY
        self._expected *= _CALIBRATION_MEMORY


class _DepthLimit:
    """How deep to draft: the engine verifies only the best-first prefix of a draft that pays for its
    target forward, so drafting deeper than it verifies wastes draft forwards.

    After a chain verified whole, one token deeper is allowed (a probe); after a cut, the depth the
    engine kept. When the engine verified none of a chain (no prefix paid for its place in the
    target's forward) and the target took none of its alternatives, drafting pauses for 1, 2, 4,
    ... proposals, then probes in full. A draft the target verified and rejected does not pause
    drafting: the calibration already lowers the next estimates, and here a draft forward costs a
    tenth of a target step (int8, lean forward) and a second row of the target's forward another
    tenth, so the next draft still pays where the draft model is right a fifth of the time
    (docs/benchmarks.md section 4, "Drafting on after a rejected draft").
    """

    def __init__(self, most: int):
        self.most = most
        self.depth = most
        self._pause = 0
        self._next_pause = 1

    def allowed(self) -> int:
        """Tokens to draft at this proposal at most; 0 while paused."""
        if self._pause:
            self._pause -= 1
            return 0
        return self.depth

    def observe(self, proposed: int, verified: int, agreed: int) -> None:
        if verified == agreed == 0:
            self._pause, self._next_pause = self._next_pause, min(2 * self._next_pause, _MAX_PAUSE)
        else:
            self._next_pause = 1
        if agreed == 0:
            # A short draft after a miss or a pause may never pay to verify: the next one drafts in full.
            self.depth = self.most
        else:
            # At least one: the engine may have verified only an alternative, which outranked the
            # chain token beside it, and a depth of 0 would end drafting for the generation.
            self.depth = min(verified + 1, self.most) if verified == proposed else max(verified, 1)


def _after_chain(chain: list[int], tree: DraftTree, sources: list[str] | None = None, scores: list[float] | None = None) -> DraftTree:
    """`tree` hung after the last of `chain`'s tokens, which lead it one after another; given the
    chain's `sources` and `scores`, the tree's own follow them."""
    last = len(chain) - 1
    parents = list(range(-1, last)) + [last if p == ROOT else p + len(chain) for p in tree.parents]
    if sources is None or scores is None:
        return DraftTree(chain + tree.tokens, parents)
    return DraftTree(chain + tree.tokens, parents, sources + tree.sources, scores + tree.scores)


def _side_by_side(first: DraftTree, second: DraftTree) -> DraftTree:
    """Both trees below the same root, `first`'s nodes first (they win between equal siblings)."""
    if not second.tokens:
        return first
    if not first.tokens:
        return second
    parents = first.parents + [p if p == ROOT else p + len(first) for p in second.parents]
    sources, scores = first.sources + second.sources, first.scores + second.scores
    return DraftTree(first.tokens + second.tokens, parents, sources, scores)


def _phrase_tree(phrases: list[Sequence[int]], budget: int, agreement: float, source: str, reach: float = 1.0) -> DraftTree:
    """The phrases merged by common prefixes, the `budget` best nodes, best first (ties: newest phrase first)."""
    if budget < 1 or not phrases:
        return DraftTree.empty()
    return best_subtree(frequency_trie(phrases), budget, source, agreement, reach)
