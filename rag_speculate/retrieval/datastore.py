"""The REST datastore: a corpus's token ids and a suffix array that finds the context's longest match.

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

Saved as a folder of `.npy` arrays, loaded memory-mapped, plus a JSON header with checksums. An
appended document goes to a small in-memory side index, searched along with the main one and
merged into it (suffix array rebuilt) on `save`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from ..errors import InvalidArgumentError, RagSpeculateError
from ..files import fsync_dir, replace_dir, sha256_file, sibling, write_new_file

FORMAT_VERSION = 1
_FORMAT = "rag-speculate-datastore"
_HEADER = "datastore.json"
_ARRAYS = ("tokens", "ends")
_HEADER_FIELDS = {"tokenizer_fingerprint", "vocab_size", "documents", "tokens", "arrays"}
_ARRAY_FIELDS = {"shape", "bytes", "sha256"}
_SEPARATOR = -1
_INT32_MAX = int(np.iinfo(np.int32).max)  # token ids and positions are stored as int32
# Below this many candidates one vectorised gather beats more steps of a Python binary search.
_GATHER_LIMIT = 256
_SLICE = 1 << 16
_REBUILD_HINT = "rebuild it with Datastore.from_texts(texts, tokenizer).save(path)"


class DatastoreError(RagSpeculateError):
    """A datastore cannot be built, saved or loaded; the message says why and how to rebuild it."""


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A sha256 of the tokenizer's vocabulary and special tokens: equal fingerprints, equal token ids."""
    identity = {
        "vocab": sorted((token_id, token) for token, token_id in tokenizer.get_vocab().items()),
        "special": sorted(zip(tokenizer.all_special_ids, tokenizer.all_special_tokens)),
    }
    return hashlib.sha256(json.dumps(identity, ensure_ascii=False).encode()).hexdigest()


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


@dataclass(frozen=True)
class _Index:
    tokens: np.ndarray
    ends: np.ndarray

    @classmethod
    def build(cls, tokens: np.ndarray) -> _Index:
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
        return [row[: row.index(_SEPARATOR)] if _SEPARATOR in row else row for row in rows]


class Datastore:
    """A corpus searchable for the longest match of a context, as REST drafts from.

    Make one with `build`, `from_texts` or `load`; `retrieve` is what `RESTDrafter` calls.
    """

    def __init__(self, index: _Index, vocab_size: int, fingerprint: str | None, documents: int):
        self._main = index
        self._main_documents = documents
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self._appended: list[np.ndarray] = []
        self._side: _Index | None = None  # the appended documents' index, built when first searched

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
        if not isinstance(vocab_size, int) or not 1 <= vocab_size <= _INT32_MAX:
            raise InvalidArgumentError(f"vocab_size must be an integer in [1, {_INT32_MAX}], got {vocab_size!r}")
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise InvalidArgumentError("token_ids must be a list of documents, each a list of int token ids")
        if not any(len(document) for document in token_ids):
            raise InvalidArgumentError("token_ids is empty: a datastore needs at least one token")
        tokens = _concatenate(token_ids, vocab_size, "token_ids")
        fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        return cls(_Index.build(tokens), vocab_size, fingerprint, len(token_ids))

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
        document = _checked_ids(token_ids, self.vocab_size, "token_ids")
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

    def _indexes(self) -> list[_Index]:
        if not self._appended:
            return [self._main]
        if self._side is None:
            self._side = _Index.build(_concatenate(self._appended, self.vocab_size, "appended"))
        return [self._main, self._side]

    # --- saving and loading -------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write to the folder `path`, merging appended documents in (the suffix array is rebuilt).

        Written under a temporary name and renamed into place, so a crash never leaves a
        half-written datastore and a datastore already at `path` is replaced only once the new
        one is complete.
        """
        path = Path(path)
        _check_replaceable(path)
        self._merge_appended()
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = sibling(path, "tmp")
        staging.mkdir()
        try:
            arrays = {name: _write_array(staging / f"{name}.npy", getattr(self._main, name)) for name in _ARRAYS}
            header = {
                "format": _FORMAT,
                "format_version": FORMAT_VERSION,
                "tokenizer_fingerprint": self.fingerprint,
                "vocab_size": self.vocab_size,
                "documents": self.num_documents,
                "tokens": self.num_tokens,
                "arrays": arrays,
            }
            write_new_file(staging / _HEADER, json.dumps(header, indent=2).encode())
            fsync_dir(staging)
            replace_dir(staging, path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _merge_appended(self) -> None:
        if not self._appended:
            return
        appended = _concatenate(self._appended, self.vocab_size, "appended")
        # The main stream ends with a separator and the appended one starts with one: keep one.
        self._main = _Index.build(np.concatenate([self._main.tokens, appended[1:]]))
        self._main_documents += len(self._appended)
        self._appended = []
        self._side = None

    @classmethod
    def load(
        cls, path: str | os.PathLike, tokenizer: PreTrainedTokenizerBase | None = None, *, verify: bool = True
    ) -> Datastore:
        """Open a saved datastore, its arrays memory-mapped (read from disk as retrieval needs them).

        With a `tokenizer`, refuses a datastore built with another one (a datastore built from
        token ids without a tokenizer records none and cannot be checked). Sizes and shapes are
        always checked; `verify=True` also compares every array's sha256 with the header's, which
        reads the whole datastore (8 bytes per token) once: 0.1-0.2 s per 10M tokens on a 2-core
        machine (benchmarks/datastore_bench.py), against ~1 ms without, but small next to loading a
        model, so it is on by default.
        """
        path = Path(path)
        header = _read_header(path)
        if tokenizer is not None and header["tokenizer_fingerprint"] not in (None, tokenizer_fingerprint(tokenizer)):
            raise DatastoreError(
                f"datastore {path} was built with another tokenizer (its vocabulary or special tokens differ), "
                f"so its token ids mean other text; {_REBUILD_HINT} using the model's tokenizer"
            )
        arrays = {name: _load_array(path, name, header["arrays"][name], verify) for name in _ARRAYS}
        tokens = arrays["tokens"]
        if len(tokens) < 2 or tokens[0] != _SEPARATOR or tokens[-1] != _SEPARATOR:
            raise _damaged(path, "tokens.npy does not hold separator-delimited documents")
        return cls(
            _Index(tokens, arrays["ends"]), header["vocab_size"], header["tokenizer_fingerprint"], header["documents"]
        )


# --- building -------------------------------------------------------------------------------


def _concatenate(documents: Sequence[Sequence[int]], vocab_size: int, what: str) -> np.ndarray:
    """The documents' token ids as one int32 array, each followed by a separator, with one in front too."""
    lengths = [len(document) for document in documents]
    size = sum(lengths) + len(lengths) + 1
    if size > _INT32_MAX:
        raise InvalidArgumentError(
            f"{what} holds too many tokens: a datastore holds at most {_INT32_MAX} with separators"
        )
    tokens = np.empty(size, dtype=np.int32)
    tokens[0] = _SEPARATOR
    position = 1
    # One document at a time, so only the int32 copy of the whole corpus is ever held.
    for i, (document, length) in enumerate(zip(documents, lengths)):
        tokens[position : position + length] = _checked_ids(document, vocab_size, f"{what}[{i}]")
        tokens[position + length] = _SEPARATOR
        position += length + 1
    return tokens


def _checked_ids(document: Sequence[int], vocab_size: int, what: str) -> np.ndarray:
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
        found = found[tokens[found] != _SEPARATOR]
        found = found[tokens[found + 1] != _SEPARATOR]
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


# --- files ----------------------------------------------------------------------------------


def _check_replaceable(path: Path) -> None:
    if path.exists() and not (path / _HEADER).is_file():
        raise DatastoreError(f"{path} exists and is not a datastore; refusing to replace it (choose another path)")


def _write_array(file: Path, array: np.ndarray) -> dict[str, Any]:
    with file.open("xb") as out:
        np.save(out, array, allow_pickle=False)
        out.flush()
        os.fsync(out.fileno())
    return {"dtype": array.dtype.str, "shape": list(array.shape), "bytes": file.stat().st_size, "sha256": sha256_file(file)}


def _read_header(path: Path) -> dict[str, Any]:
    file = path / _HEADER
    if not file.is_file():
        raise DatastoreError(
            f"{path} is not a datastore (no {_HEADER}); build one with Datastore.from_texts(texts, tokenizer).save(path)"
        )
    try:
        header = json.loads(file.read_text())
    except ValueError:
        raise _damaged(path, f"{_HEADER} is corrupt (not JSON)") from None
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise _damaged(path, f"{_HEADER} is not a rag-speculate datastore header")
    if header.get("format_version") != FORMAT_VERSION:
        version = header.get("format_version")
        raise _damaged(path, f"it has format version {version!r}, this rag-speculate reads {FORMAT_VERSION}")
    arrays = header.get("arrays")
    if not (
        _HEADER_FIELDS <= header.keys()
        and isinstance(arrays, dict)
        and all(isinstance(arrays.get(name), dict) and _ARRAY_FIELDS <= arrays[name].keys() for name in _ARRAYS)
    ):
        raise _damaged(path, f"{_HEADER} is corrupt (fields missing)")
    return header


def _load_array(path: Path, name: str, spec: dict[str, Any], verify: bool) -> np.ndarray:
    file = path / f"{name}.npy"
    if not file.is_file():
        raise _damaged(path, f"{file.name} is missing")
    size = file.stat().st_size
    if size != spec["bytes"]:
        problem = "is truncated" if size < spec["bytes"] else "is larger than written"
        raise _damaged(path, f"{file.name} {problem} ({size} of {spec['bytes']} bytes)")
    try:
        array = np.load(file, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise _damaged(path, f"{file.name} is not a readable array ({error})") from None
    if array.dtype != np.int32 or array.ndim != 1 or list(array.shape) != spec["shape"]:
        raise _damaged(path, f"{file.name} holds {array.dtype} {array.shape}, not int32 {tuple(spec['shape'])}")
    if verify and sha256_file(file) != spec["sha256"]:
        raise _damaged(path, f"{file.name} does not match its checksum (corrupted on disk)")
    # A plain ndarray over the mapping: indexing a np.memmap subclass is slower on the search path.
    return array.view(np.ndarray)


def _damaged(path: Path, problem: str) -> DatastoreError:
    return DatastoreError(f"datastore {path}: {problem}; {_REBUILD_HINT}")
