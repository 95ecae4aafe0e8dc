"""The REST datastore: a corpus's token ids, searched for the longest match of the context.

The search structure is a suffix array over the tokens read backwards (`suffix_array.py`); the
folder it is saved to is described in `datastore_format.py`. An appended document goes to a small
in-memory side index, searched along with the main one and merged into it (suffix array rebuilt)
on `save`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from ...errors import InvalidArgumentError
from ...fingerprint import tokenizer_fingerprint
from . import datastore_format as fmt
from .datastore_format import FORMAT_VERSION, DatastoreError
from .suffix_array import INT32_MAX, SEPARATOR, SuffixIndex, checked_ids, concatenate

__all__ = [
    "FORMAT_VERSION",
    "Datastore",
    "DatastoreError",
    "Retrieval",
    "check_retrieval_arguments",
]


def check_retrieval_arguments(n_max: int, m: int, max_matches: int) -> None:
    for name, value in (("n_max", n_max), ("m", m), ("max_matches", max_matches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class Retrieval:
    """What the datastore holds after the context's longest matching suffix."""

    match_length: int  # tokens of the context matched; 0 when not even its last token occurs
    occurrences: int  # places the match occurs, of which at most `max_matches` were read
    continuations: list[list[int]]  # up to `m` tokens after each place read


class Datastore:
    """A corpus searchable for the longest match of a context, as REST drafts from.

    Make one with `build`, `from_texts` or `load`; `retrieve` is what `RESTDrafter` calls.
    """

    def __init__(self, index: SuffixIndex, vocab_size: int, fingerprint: str | None, documents: int):
        self._main = index
        self._main_documents = documents
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self._appended: list[np.ndarray] = []
        self._side: SuffixIndex | None = None  # the appended documents' index, built when first searched

    # --- making one ---------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        *,
        vocab_size: int | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> Datastore:
        """From documents already tokenized with the target's tokenizer (lists or 1-D int arrays).

        Pass the `tokenizer` to record its fingerprint, so `load` can refuse another tokenizer;
        `vocab_size` defaults to `len(tokenizer)`, and one of the two is required.
        """
        if vocab_size is None:
            if tokenizer is None:
                raise InvalidArgumentError("Datastore.build needs vocab_size or tokenizer to check the token ids")
            vocab_size = len(tokenizer)
        if not isinstance(vocab_size, int) or not 1 <= vocab_size <= INT32_MAX:
            raise InvalidArgumentError(f"vocab_size must be an integer in [1, {INT32_MAX}], got {vocab_size!r}")
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise InvalidArgumentError("token_ids must be a list of documents, each a list of int token ids")
        if not any(len(document) for document in token_ids):
            raise InvalidArgumentError("token_ids is empty: a datastore needs at least one token")
        tokens = concatenate(token_ids, vocab_size, "token_ids")
        fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        return cls(SuffixIndex.build(tokens), vocab_size, fingerprint, len(token_ids))

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer: PreTrainedTokenizerBase) -> Datastore:
        """Tokenize `texts` (without special tokens) with the target's tokenizer and build."""
        if isinstance(texts, str) or not all(isinstance(text, str) for text in texts):
            raise InvalidArgumentError("texts must be a list of strings")
        token_ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
        return cls.build(token_ids, tokenizer=tokenizer)

    # --- what it holds ------------------------------------------------------------------------

    @property
    def num_documents(self) -> int:
        return self._main_documents + len(self._appended)

    @property
    def num_tokens(self) -> int:
        """Token ids of all documents, separators not counted."""
        appended = sum(len(document) for document in self._appended)
        return len(self._main.tokens) - self._main_documents - 1 + appended

    # --- growing ------------------------------------------------------------------------------

    def append(self, token_ids: Sequence[int]) -> None:
        """Add one document (e.g. a generation's output), searched from now on and kept by `save`.

        Appended documents get their own index, rebuilt at the next retrieval after an append, at a
        cost that grows with all the appended tokens; `save` merges them into the main index.
        """
        document = checked_ids(token_ids, self.vocab_size, "token_ids")
        if document.size:
            self._appended.append(document.astype(np.int32))
            self._side = None

    # --- retrieval ----------------------------------------------------------------------------

    def retrieve(self, context: Sequence[int], *, n_max: int = 16, m: int = 10, max_matches: int = 64) -> Retrieval:
        """The continuations of the longest suffix of `context` (at most `n_max` tokens) found here.

        When it occurs more than `max_matches` times, that many places are read, evenly spread over
        all of them: they are sorted by what precedes the match, so the first few would all share
        one earlier phrase, while an even spread keeps the continuations' frequencies representative.
        """
        check_retrieval_arguments(n_max, m, max_matches)
        query = self._reversed_query(context, n_max)
        found = [(index, index.match(query)) for index in self._indexes()]
        length = max(len(ranges) for _, ranges in found)
        if length == 0:
            return Retrieval(0, 0, [])
        spans = [(index, *ranges[length - 1]) for index, ranges in found if len(ranges) == length]
        total = sum(hi - lo for _, lo, hi in spans)
        count = min(max_matches, total)
        picks = np.arange(count, dtype=np.int64) * total // count
        continuations: list[list[int]] = []
        offset = 0
        for index, lo, hi in spans:
            mine = picks[(picks >= offset) & (picks < offset + hi - lo)]
            continuations += index.continuations(mine - offset + lo, m)
            offset += hi - lo
        return Retrieval(length, total, continuations)

    def _reversed_query(self, context: Sequence[int], n_max: int) -> list[int]:
        """The context's last `n_max` tokens, last first, up to the first that cannot occur here."""
        query = []
        for token in reversed(context[-n_max:]):
            if not 0 <= token < self.vocab_size:
                break
            query.append(int(token))
        return query

    def _indexes(self) -> list[SuffixIndex]:
        if not self._appended:
            return [self._main]
        if self._side is None:
            self._side = SuffixIndex.build(concatenate(self._appended, self.vocab_size, "appended"))
        return [self._main, self._side]

    # --- saving and loading -------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write to the folder `path`, merging appended documents in (the suffix array is rebuilt).

        Written under a temporary name and renamed into place, so a crash never leaves a
        half-written datastore and a datastore already at `path` is replaced only once the new
        one is complete.
        """
        path = Path(path)
        fmt.check_replaceable(path)
        self._merge_appended()
        fields = {
            "tokenizer_fingerprint": self.fingerprint,
            "vocab_size": self.vocab_size,
            "documents": self.num_documents,
            "tokens": self.num_tokens,
        }
        fmt.write_folder(path, {"tokens": self._main.tokens, "ends": self._main.ends}, fields)

    def _merge_appended(self) -> None:
        if not self._appended:
            return
        appended = concatenate(self._appended, self.vocab_size, "appended")
        # The main stream ends with a separator and the appended one starts with one: keep one.
        self._main = SuffixIndex.build(np.concatenate([self._main.tokens, appended[1:]]))
        self._main_documents += len(self._appended)
        self._appended = []
        self._side = None

    @classmethod
    def load(
        cls, path: str | os.PathLike, tokenizer: PreTrainedTokenizerBase | None = None, *, verify: bool = True
    ) -> Datastore:
        """Open a saved datastore, its arrays memory-mapped (read from disk as retrieval needs them).

        With a `tokenizer`, refuses a datastore built with another one (a datastore built from
        token ids without a tokenizer records none and cannot be checked). The header's fields,
        the arrays' sizes, shapes and lengths are always checked; `verify=True` also compares every
        array's sha256 with the header's and checks what retrieval relies on (ids within the
        vocabulary, positions within documents). That reads the whole datastore once, which costs
        far less than loading a model, so it is on by default.
        """
        path = Path(path)
        header, arrays = fmt.read_folder(path, tokenizer, verify)
        tokens = arrays["tokens"]
        if len(tokens) < 2 or tokens[0] != SEPARATOR or tokens[-1] != SEPARATOR:
            raise fmt.damaged(path, "tokens.npy does not hold separator-delimited documents")
        return cls(
            SuffixIndex(tokens, arrays["ends"]), header["vocab_size"], header["tokenizer_fingerprint"], header["documents"]
        )
