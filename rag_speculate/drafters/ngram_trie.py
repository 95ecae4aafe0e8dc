"""Drafts from the retrieved documents and the prompt: the N-Gram Trie drafter.

The paper slides an n-token window over the context, splits it into a prefix of `max_prefix`
tokens and a suffix, and inserts every sub-prefix followed by the suffix into one frequency trie.
The subtree reached by the query `q` (k <= max_prefix tokens) therefore holds, for every place
where `q` occurs in the context, the next `n - k` tokens, counted once per occurrence.

We build exactly that subtree, but lazily: an n-gram index (every 1..max_prefix-gram -> where it
occurs) costs one pass over the context instead of max_prefix * n trie insertions per position,
and the small subtree for the matched query is assembled at lookup from its occurrences. Lookup
backs off from the longest query to one token as in the paper, and the draft keeps the
highest-frequency nodes through a heap, so what the target sees is always a connected tree.

Beyond the paper: accepted output is indexed too, so phrases the answer repeats are found, and
the most recent occurrences win when a frequent n-gram has more than `max_occurrences`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import takewhile

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
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._output_start = self._output_indexed = 0
        self._agreement = MatchAgreement()

    def start(self, context: DraftContext) -> None:
        self._tokens = []
        self._index = {}
        # Each query brings other documents: how well they predict the answer is learnt afresh.
        self._agreement = MatchAgreement()
        for segment in (*context.document_ids, context.prompt_ids):
            self._add_segment(segment)
        # The output forms one more segment, indexed as it grows.
        self._add_segment(())
        self._output_start = len(context.prompt_ids)
        self._output_indexed = 0

    def _add_segment(self, segment: Sequence[int]) -> None:
        self._tokens.append(_SEPARATOR)
        self._extend(segment)

    def _extend(self, tokens: Sequence[int]) -> None:
        """Append tokens and index every n-gram (n <= max_prefix) that ends at one of them."""
        all_tokens, index = self._tokens, self._index
        for token in tokens:
            all_tokens.append(token)
            end = len(all_tokens)
            for k in range(1, self.max_prefix + 1):
                gram = tuple(all_tokens[end - k : end])
                if len(gram) < k or _SEPARATOR in gram:
                    break
                # Stored as the position right after the n-gram: where its continuation starts.
                index.setdefault(gram, []).append(end)

    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        if self.learn_from_output:
            self._index_output(tokens)
        if budget < 1:
            return DraftTree.empty()
        all_tokens = self._tokens
        for k in range(min(self.max_prefix, len(tokens)), 0, -1):
            # An occurrence with nothing after it (the tail of the output itself) cannot draft.
            starts = [s for s in self._index.get(tuple(tokens[-k:]), ()) if s < len(all_tokens) and all_tokens[s] != _SEPARATOR]
            if starts:
                return self._best_subtree(starts[-self.max_occurrences :], self.n - k, budget, self._agreement.rate(k))
        return DraftTree.empty()

    def _index_output(self, tokens: Sequence[int]) -> None:
        """Index the output generated since the last proposal, so phrases the answer repeats are found."""
        new = tokens[self._output_start + self._output_indexed :]
        self._output_indexed += len(new)
        self._extend(new)

    def observe(self, verification: Verification) -> None:
        self._agreement.observe(verification)

    def _best_subtree(self, starts: list[int], length: int, budget: int, agreement: float) -> DraftTree:
        """Frequency trie of the continuations, pruned to the `budget` most frequent nodes."""
        continuations = (takewhile(_not_separator, self._tokens[start : start + length]) for start in starts)
        return best_subtree(frequency_trie(continuations), budget, self.name, agreement)


def _not_separator(token: int) -> bool:
    return token != _SEPARATOR
