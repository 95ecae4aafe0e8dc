"""The draft model's side of Ouroboros: its KV cache, kept in step with the target's accepted text,
and one draft forward over the pool's phrases (tree attention), with its confidence in each token.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...decoding import probe
from ...decoding.budget import CostModel
from ...decoding.forward import TreeForward
from ...decoding.kv_cache import keep_cache_entries, make_cache, window_holds
from ...decoding.output import eos_token_ids
from ...decoding.prompt_cache import PromptCache
from ...decoding.sampling import SamplingParams
from ...decoding.tree import DraftTree
from ...decoding.verify import Verification, accept
from ..base import ForwardContext
from .draft_forward import draft_forward

_GREEDY = SamplingParams()
Alternative = tuple[int, float]  # a token the draft model ranked below its choice, and its probability


def head_ids(tokenizer: PreTrainedTokenizerBase, lowest: int, vocab_size: int, *contexts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids below `vocab_size` that a draft head restricted to `lowest` scores, in two ascending
    groups: the `lowest` lowest ids (a BPE vocabulary numbers its tokens roughly by how often they
    occur, so these are the common ones) with the special tokens (the end of the text among them),
    the same for every generation; and the other ids of `contexts` (names and rare words an answer
    copies from its prompt and documents)."""
    common = set(range(min(lowest, vocab_size))).union(i for i in tokenizer.all_special_ids if 0 <= i < vocab_size)
    rare = {i for ids in contexts for i in ids if 0 <= i < vocab_size} - common
    # Host-side ids, whatever torch's default device: they key the head's cached row groups.
    return (torch.tensor(sorted(common), dtype=torch.long, device="cpu"), torch.tensor(sorted(rare), dtype=torch.long, device="cpu"))


@dataclass(frozen=True)
class DraftStep:
    """One draft forward's outcome."""

    # The tree's tokens the draft model agreed with, then its own next token (token ids).
    tokens: list[int]
    # Its probability for each of those tokens, and its next-best tokens at each position.
    confidence: list[float]
    alternatives: list[list[Alternative]]
    # The walk over the tree fed (nodes as fed; target_tokens are the draft model's choices, as ids).
    walk: Verification


class DraftModel:
    """A draft model, its cache and its forwards; `lean=False` keeps the model's own forward."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, lean: bool, head_vocabulary: int | None,
        tree_budget: int, prompt_cache_bytes: int | None,
    ):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        # Why the draft model runs its own forward rather than the leaner one; "" when lean.
        self._lean, self.lean_forward_skipped = draft_forward(model) if lean else (None, "lean=False")
        # Its forwards run as the engine runs a model's (`attach`).
        self.forward = TreeForward(model, forward=self._lean)
        self.head_vocabulary = head_vocabulary
        self.tree_budget = tree_budget  # pool nodes one draft forward checks at most
        self.embedded = model.get_input_embeddings().num_embeddings
        # Ids both models embed: the only ones proposed or fed as pool phrases (set by `attach`).
        self.vocab_size = self.embedded
        self.eos = eos_token_ids(model, tokenizer)
        self.tree_attention = True
        # Draft forward cost by tokens fed, timed on first use; assign one to pin it (tests).
        self.cost_model: CostModel | None = None
        self.draft_forward_sizes: Counter[int] = Counter()
        # The ids the draft's logits score, column by column, and each one's column; None: all ids.
        self._head_ids: list[int] | None = None
        self._column: dict[int, int] = {}
        # The draft model's own prefill of each prompt is reused as the target's is.
        self.prompt_cache = PromptCache.for_model(model, prompt_cache_bytes)
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds
        self.reset()

    def reset(self) -> None:
        """A fresh cache; what the last one held (prompt and drafted-on output) goes to the prompt cache."""
        if self.cached:
            self.prompt_cache.insert(self.model, self.feedable(self.cached), self.cache)
        self.cache = make_cache(self.model)
        self.cached = []

    def attach(self, vocab_size: int, context: ForwardContext) -> None:
        self.forward.context = context
        # Embedding tables may be padded past the tokenizer differently: propose only ids both embed.
        self.vocab_size = min(self.embedded, vocab_size)
        # Its drafts are only checked: a forward whose logits move with the rows beside it (int8)
        # can still draft through a tree.
        self.tree_attention = not probe.tree_attention(self.forward, exact=False)
        # Builds the head's common rows here rather than in a generation.
        self.restrict_head()

    def restrict_head(self, *contexts: Sequence[int]) -> None:
        if self._lean is None or self.head_vocabulary is None:
            return
        groups = head_ids(self.tokenizer, self.head_vocabulary, self.vocab_size, *contexts)
        self._lean.restrict_head(*(g for g in groups if len(g)))
        self._head_ids = torch.cat(groups).tolist()
        self._column = {t: c for c, t in enumerate(self._head_ids)}

    def costs(self) -> CostModel:
        if self.cost_model is None:
            self.cost_model = CostModel.measure(probe.timed_tree(self.forward, self.tree_attention), self.tree_budget + 1)
        return self.cost_model

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        fed = self.feedable(prompt_ids)
        reused = self.prompt_cache.fetch(self.model, fed[:-1], self.cache).tokens
        self.forward.prefill(self.cache, fed[reused:])
        self.cached = list(prompt_ids)

    def feedable(self, ids: Sequence[int]) -> list[int]:
        # A target with a larger padded embedding table may emit an id the draft model cannot read;
        # any id it embeds will do there, its guesses are only checked.
        return [t if t < self.embedded else 0 for t in ids]

    def usable(self, phrases: list) -> list:
        return [p for p in phrases if max(p) < self.vocab_size]

    def rollback(self, context: Sequence[int]) -> list[int]:
        """Drop the cached entries `context` does not continue; returns the tokens of `context` the
        cache still lacks (the output accepted since the last draft), to be fed with the next draft forward."""
        common = 0
        for cached, token in zip(self.cached, context):
            if cached != token:
                break
            common += 1
        if len(self.cached) > common:
            keep_cache_entries(self.cache, len(self.cached) - common, [])
            del self.cached[common:]
        return list(context[common:])

    def fits_tree(self, extra: int) -> bool:
        """Whether a tree forward over `extra` more tokens can run (a sliding window would forget
        entries before the walk decides which survive)."""
        return self.tree_attention and window_holds(self.cache, len(self.cached) + extra)

    @torch.inference_mode()
    def step(self, pending: list[int], root: int, tree: DraftTree, tree_mode: bool, alternatives: int) -> DraftStep:
        """One draft forward: feed `pending` and `root`, then `tree` (a single chain unless
        `tree_mode`), keep the longest path the draft model agrees with plus its own next token,
        and roll the cache back to those tokens."""
        forward = self.forward.tree if tree_mode else self.forward.chain
        first, *forced = self.feedable([*pending, root])
        started = time.perf_counter()
        # The pending tokens and the root lead the tree as a chain; only the rows from the root on are read.
        logits = forward(self.cache, first, DraftTree.chain(forced).graft(tree, len(forced) - 1), len(tree) + 1)
        walk = accept(self._in_head(tree), logits[:, : self.vocab_size], _GREEDY, None)
        walk = dataclasses.replace(walk, tree=tree, accepted_tokens=self._ids(walk.accepted_tokens), target_tokens=self._ids(walk.target_tokens))
        fed = len(forced) + len(tree) + 1
        keep_cache_entries(self.cache, fed, list(range(len(forced) + 1)) + [len(forced) + 1 + i for i in walk.accepted_nodes])
        self.costs().observe(fed, time.perf_counter() - started)
        self.draft_forward_sizes[fed] += 1
        self.cached.extend([*pending, root, *walk.accepted_tokens[:-1]])
        rows = logits[[0, *(i + 1 for i in walk.accepted_nodes)], : self.vocab_size].float()
        # Greedy drafting: the first of the top tokens is the drafted one.
        top = torch.softmax(rows, dim=-1).topk(1 + alternatives, dim=-1)
        probabilities, ids = top.values.tolist(), [self._ids(row) for row in top.indices.tolist()]
        options = [list(zip(row_ids[1:], row_p[1:])) for row_ids, row_p in zip(ids, probabilities)]
        return DraftStep(walk.accepted_tokens, [row[0] for row in probabilities], options, walk)

    def _in_head(self, tree: DraftTree) -> DraftTree:
        """`tree` with its tokens as columns of the draft's logits; -1, which no argmax picks, for
        ids a restricted head does not score."""
        if self._head_ids is None:
            return tree
        return dataclasses.replace(tree, tokens=[self._column.get(t, -1) for t in tree.tokens])

    def _ids(self, columns: list[int]) -> list[int]:
        return columns if self._head_ids is None else [self._head_ids[c] for c in columns]

