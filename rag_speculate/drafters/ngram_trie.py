"""Drafts from the retrieved documents and the prompt: the N-Gram Trie drafter.

The paper slides an n-token window over the context, splits it into a prefix of `max_prefix`
tokens and a suffix, and inserts every sub-prefix followed by the suffix into one frequency trie.
The subtree reached by the query `q` (k <= max_prefix tokens) therefore holds, for every place
where `q` occurs in the context, the next `n - k` tokens, counted once per occurrence.

We build exactly that subtree, but lazily: an n-gram index (every 1..max_prefix-gram -> where it
occurs) costs a few array passes over the context instead of max_prefix * n trie insertions per
position, and the small subtree for the matched query is assembled at lookup from its occurrences.
Lookup backs off from the longest query to one token as in the paper, and the draft keeps the
highest-frequency nodes through a heap, so what the target sees is always a connected tree.

Beyond the paper: accepted output is indexed too, so phrases the answer repeats are found, and
the most recent occurrences win when a frequent n-gram has more than `max_occurrences`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import takewhile

import numpy as np

from ..decoding.tree import DraftTree
from ..decoding.verify import Verification
from ..errors import InvalidArgumentError
from .agreement import MatchAgreement
from .base import DraftContext, Drafter
from .frequency_trie import best_subtree, frequency_trie

_SEPARATOR = -1  # between documents, so no continuation runs from one document into the next


class NGramTrieDrafter(Drafter):
    name = "ngram_trie"

    def __init__(self, n: int = 13, max_prefix: int = 3, max_occurrences: int = 64, learn_from_output: bool = True):
        if max_prefix < 1 or n <= max_prefix:
            raise InvalidArgumentError(f"need 1 <= max_prefix < n, got max_prefix={max_prefix}, n={n}")
        if max_occurrences < 1:
            raise InvalidArgumentError(f"max_occurrences must be >= 1, got {max_occurrences}")
        self.n = n
        self.max_prefix = max_prefix
        self.max_occurrences = max_occurrences
        self.learn_from_output = learn_from_output
        self._context = _ContextGrams([], max_prefix, 1)
        self._output: list[int] = []
        self._output_index: dict[tuple[int, ...], list[int]] = {}
        self._output_start = 0
        self._agreement = MatchAgreement()

    def start(self, context: DraftContext) -> None:
        # Each query brings other documents: how well they predict the answer is learnt afresh.
        self._agreement = MatchAgreement()
        self._context = _ContextGrams([*context.document_ids, context.prompt_ids], self.max_prefix, context.vocab_size)
        # The output forms one more segment, after the context's, indexed as it grows.
        self._output = []
        self._output_index = {}
        self._output_start = len(context.prompt_ids)

    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        if self.learn_from_output:
            self._index_output(tokens)
        if budget < 1:
            return DraftTree.empty()
        for k in range(min(self.max_prefix, len(tokens)), 0, -1):
            query = tuple(tokens[-k:])
            # An occurrence with nothing after it (the tail of the output itself) cannot draft.
            in_output = [end for end in self._output_index.get(query, ()) if end < len(self._output)]
            starts = self._context.ends(query, self.max_occurrences) + [len(self._context.tokens) + e for e in in_output]
            if starts:
                return self._best_subtree(starts[-self.max_occurrences :], self.n - k, budget, self._agreement.rate(k))
        return DraftTree.empty()

    def _index_output(self, tokens: Sequence[int]) -> None:
        """Index the output generated since the last proposal (every n-gram, n <= max_prefix, ending
        at a new token), so phrases the answer repeats are found."""
        output, index = self._output, self._output_index
        for token in tokens[self._output_start + len(output) :]:
            output.append(token)
            end = len(output)
            for k in range(1, min(self.max_prefix, end) + 1):
                # Stored as the position right after the n-gram: where its continuation starts.
                index.setdefault(tuple(output[end - k : end]), []).append(end)

    def observe(self, verification: Verification) -> None:
        self._agreement.observe(verification)

    def _best_subtree(self, starts: list[int], length: int, budget: int, agreement: float) -> DraftTree:
        """Frequency trie of the continuations, pruned to the `budget` most frequent nodes."""
        continuations = (self._continuation(start, length) for start in starts)
        return best_subtree(frequency_trie(continuations), budget, self.name, agreement)

    def _continuation(self, start: int, length: int) -> Sequence[int]:
        """Up to `length` tokens from `start`: in the context up to its segment's end, else in the output."""
        context = self._context.tokens
        if start < len(context):
            return list(takewhile(_not_separator, context[start : start + length].tolist()))
        return self._output[start - len(context) : start - len(context) + length]


class _ContextGrams:
    """Where each n-gram (n = 1..max_prefix) of the context's segments occurs, built in a few array
    passes rather than a dict insertion per n-gram and token, which cost seconds for the largest
    requests' documents.

    `tokens` holds the segments, each after a separator, with one more at the end. For each n, the
    positions right after every n-gram that a token of its segment follows are kept sorted by the
    n-gram's key, and in order within one key (a stable sort). A key is exact: the n-gram's last
    token plus `base` times the place where its first n - 1 tokens' key first occurs among the sorted
    (n - 1)-gram keys, so two n-grams share a key only when they are the same tokens.
    """

    def __init__(self, segments: Sequence[Sequence[int]], max_prefix: int, vocab_size: int):
        self.tokens = tokens = np.full(sum(map(len, segments)) + len(segments) + 1, _SEPARATOR, dtype=np.int64)
        at = 1
        for segment in segments:
            tokens[at : at + len(segment)] = segment
            at += len(segment) + 1
        self.base = max(vocab_size, int(tokens.max()) + 1)
        real = tokens != _SEPARATOR
        followed = np.append(real[1:], False)
        self.keys: list[np.ndarray] = []
        self.after: list[np.ndarray] = []
        keys, whole, rank = tokens, real, np.zeros(len(tokens), dtype=np.int64)
        for n in range(1, max_prefix + 1):
            if n > 1:
                # The n-gram ending at i is the (n-1)-gram ending at i - 1 and the token at i.
                whole = np.append(False, whole[:-1] & real[1:])
                keys = np.append(0, rank[:-1] * self.base + tokens[1:])
            last = np.flatnonzero(whole & followed)
            order = np.argsort(keys[last], kind="stable")
            self.keys.append(keys[last][order])
            self.after.append(last[order] + 1)
            # Each n-gram's rank for the next n: where its key first occurs in the sorted keys.
            sorted_keys = self.keys[-1]
            first = np.ones(len(sorted_keys), dtype=bool)
            first[1:] = sorted_keys[1:] != sorted_keys[:-1]
            rank[last[order]] = np.maximum.accumulate(np.where(first, np.arange(len(sorted_keys)), 0))

    def ends(self, query: Sequence[int], limit: int) -> list[int]:
        """The last `limit` positions right after an occurrence of `query` (at most max_prefix
        tokens) that a token of its segment follows, in order."""
        rank = 0
        for n, token in enumerate(query):
            if n >= len(self.keys) or not 0 <= token < self.base:
                return []
            keys, key = self.keys[n], rank * self.base + token
            rank = int(np.searchsorted(keys, key))
            if rank == len(keys) or keys[rank] != key:
                return []
        end = int(np.searchsorted(keys, key, side="right"))
        return self.after[len(query) - 1][max(rank, end - limit) : end].tolist()


def _not_separator(token: int) -> bool:
    return token != _SEPARATOR
