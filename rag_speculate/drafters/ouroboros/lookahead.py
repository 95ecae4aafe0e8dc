"""Lookahead decoding's Jacobi window (Fu et al., 2023), run inside Ouroboros's draft forwards to harvest phrases."""

from __future__ import annotations

from collections.abc import Sequence

from ...decoding.tree import DraftTree
from .phrase_pool import Phrase

LOOKAHEAD_SOURCE = "lookahead"


class JacobiWindow:
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
