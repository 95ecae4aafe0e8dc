"""The datastore's search structure: a corpus's token ids and a suffix array of them read backwards.

Layout. `tokens` holds every document's token ids as int32 (vocabularies past 65,535 are the
norm), each document followed by a separator (-1), with one more separator in front, so no match
and no continuation runs across a document boundary. `ends` is the suffix array of the *reversed*
token stream, stored as forward positions: every position `e` whose token has a successor in its
document, sorted by `tokens[e], tokens[e-1], tokens[e-2], ...`.

Why reversed: REST (He et al., 2023, Algorithm 1) looks for the longest suffix of the context, at
most `n_max` tokens, that occurs in the corpus, trying `n_max`, `n_max - 1`, ... tokens in turn. In
the reversed order the places where the context's last k tokens occur form one range of `ends`,
nested in the range for its last k - 1 tokens, so one descent (narrow by the last token, then by
the one before, ...) finds that same longest match at the cost of a single search. Positions
without a successor are left out of `ends`, so every match has a continuation, as the paper's
(context, continuation) pairs do.

The suffix array is sorted by pydivsufsort (libdivsufsort), which sorts bytes: each token becomes
a fixed-width big-endian code of `token + 1`, whose byte order is the token order (the separator
sorts first, as -1 does among int32), and only suffixes that start on a code boundary are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import InvalidArgumentError
from .datastore_format import SEPARATOR, DatastoreError

INT32_MAX = int(np.iinfo(np.int32).max)  # token ids and positions are stored as int32
# Below this many candidates one vectorised gather beats more steps of a Python binary search.
_GATHER_LIMIT = 256
# Large arrays are processed in slices of this many entries, so no corpus-sized temporary is held.
_SLICE = 1 << 16


@dataclass(frozen=True)
class SuffixIndex:
    tokens: np.ndarray
    ends: np.ndarray

    @classmethod
    def build(cls, tokens: np.ndarray) -> SuffixIndex:
        return cls(tokens, _reversed_suffix_order(tokens))

    def match(self, reversed_query: Sequence[int]) -> list[tuple[int, int]]:
        """The range of `ends` matching the query's first 1, 2, ... tokens, as long as one matches."""
        ranges = []
        lo, hi = 0, len(self.ends)
        for k, token in enumerate(reversed_query):
            lo = self._first_at_least(lo, hi, k, token)
            hi = self._first_at_least(lo, hi, k, token + 1)
            if lo == hi:
                break
            ranges.append((lo, hi))
        return ranges

    def _first_at_least(self, lo: int, hi: int, k: int, value: int) -> int:
        """First index in [lo, hi) whose k-th token back is >= value (the range is sorted by it)."""
        tokens, ends = self.tokens, self.ends
        while hi - lo > _GATHER_LIMIT:
            mid = (lo + hi) // 2
            if tokens[ends[mid] - k] < value:
                lo = mid + 1
            else:
                hi = mid
        return lo + int(np.searchsorted(tokens[ends[lo:hi] - k], value))

    def continuations(self, picks: np.ndarray, m: int) -> list[list[int]]:
        """Up to `m` tokens after each picked match, cut at the end of its document."""
        starts = self.ends[picks].astype(np.int64) + 1
        # Clipped to the final separator, so a window past the end reads as the end of a document.
        window = np.minimum(starts[:, None] + np.arange(m), len(self.tokens) - 1)
        rows = self.tokens[window].tolist()
        return [row[: row.index(SEPARATOR)] if SEPARATOR in row else row for row in rows]


def concatenate(documents: Sequence[Sequence[int]], vocab_size: int, what: str) -> np.ndarray:
    """The documents' token ids as one int32 array, each followed by a separator, with one in front too."""
    lengths = [len(document) for document in documents]
    size = sum(lengths) + len(lengths) + 1
    if size > INT32_MAX:
        raise InvalidArgumentError(
            f"{what} holds too many tokens: a datastore holds at most {INT32_MAX} with separators"
        )
    tokens = np.empty(size, dtype=np.int32)
    tokens[0] = SEPARATOR
    position = 1
    # One document at a time, so only the int32 copy of the whole corpus is ever held.
    for i, (document, length) in enumerate(zip(documents, lengths)):
        tokens[position : position + length] = checked_ids(document, vocab_size, f"{what}[{i}]")
        tokens[position + length] = SEPARATOR
        position += length + 1
    return tokens


def checked_ids(document: Sequence[int], vocab_size: int, what: str) -> np.ndarray:
    ids = np.asarray(document)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"{what} must be a list of int token ids")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise InvalidArgumentError(f"{what} has token id {bad}, outside [0, vocab_size={vocab_size})")
    return ids


def _reversed_suffix_order(tokens: np.ndarray) -> np.ndarray:
    """Every position with a successor in its document, sorted by the tokens read backwards from it."""
    try:
        from pydivsufsort import divsufsort
    except ImportError as error:
        raise DatastoreError(
            "building a datastore needs pydivsufsort: pip install 'rag-speculate[retrieval]'"
        ) from error
    text, width = _byte_codes(tokens[::-1])
    order = divsufsort(text)
    del text
    last = len(tokens) - 1
    ends = np.empty(len(tokens), dtype=np.int32)
    kept = 0
    for start in range(0, len(order), _SLICE):
        chunk = order[start : start + _SLICE]
        found = last - chunk[chunk % width == 0] // width  # suffixes starting inside a code are byte artefacts
        found = found[tokens[found] != SEPARATOR]
        found = found[tokens[found + 1] != SEPARATOR]
        ends[kept : kept + len(found)] = found
        kept += len(found)
    # A view: the few unused entries (two per document) cost less than a copy of the rest.
    return ends[:kept]


def _byte_codes(tokens: np.ndarray) -> tuple[np.ndarray, int]:
    """Fixed-width big-endian bytes of token + 1, and their width: byte order is token order."""
    width = ((int(tokens.max()) + 1).bit_length() + 7) // 8
    text = np.empty((len(tokens), width), dtype=np.uint8)
    # In slices, so no temporary the size of the corpus is held beside the text.
    for start in range(0, len(tokens), _SLICE):
        codes = tokens[start : start + _SLICE].astype(">u4")
        codes += 1  # the separator wraps from 2**32 - 1 to 0
        text[start : start + _SLICE] = codes.view(np.uint8).reshape(-1, 4)[:, 4 - width :]
    return text.reshape(-1), width
