"""The phrase candidate pool of Ouroboros (Zhao et al., 2024): short phrases by their first token.

For each token the pool keeps at most `W` phrases (tuples of 2 to `beta` token ids) starting with
it and replaces the least recently used when full; adding a phrase again refreshes it. Memory is
therefore bounded by `W` phrases per token of the vocabulary, whatever is fed. A pool outlives
generations (the paper's warm start) and can be saved to a versioned JSON file tied to the
tokenizer its ids come from, written in one rename, every field checked against a schema on loading.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from ...errors import InvalidArgumentError, RagSpeculateError
from ...files.durable import atomic_write_bytes
from ...files.schema import SHA256, FieldError, fields, integer, list_of, load_json
from ...fingerprint import tokenizer_fingerprint

Phrase = tuple[int, ...]

FORMAT_VERSION = 1
_FORMAT = "rag-speculate-phrase-pool"
# Every field loading reads, with its type and range; `format` and `format_version` are checked first.
_FILE = fields(
    {
        "W": integer(1),
        "beta": integer(2),
        "tokenizer_fingerprint": SHA256,
        "count": integer(0),
        "phrases_sha256": SHA256,
        "phrases": list_of(list_of(integer(0))),
    }
)
_FIX_HINT = (
    "delete it and start from an empty PhrasePool (a saved pool only speeds the first drafts up), "
    "or save a new one with pool.save(path, tokenizer)"
)


class PhrasePoolError(RagSpeculateError):
    """A phrase pool file cannot be loaded; the message names the file, the problem and the fix."""


class PhrasePool:
    """At most `W` phrases of 2 to `beta` token ids per first token, least recently used replaced."""

    def __init__(self, W: int = 20, beta: int = 8):
        for name, value, least in (("W", W, 1), ("beta", beta, 2)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise InvalidArgumentError(f"{name} must be an integer >= {least}, got {value!r}")
        self.W = W
        self.beta = beta
        # The tokenizer this pool's ids belong to, once saved or loaded; None for a fresh pool.
        self.fingerprint: str | None = None
        # first token -> its phrases, least recently used first.
        self._phrases: dict[int, OrderedDict[Phrase, None]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Phrase]:
        """Every phrase, least recently used first among those sharing a first token."""
        for slot in self._phrases.values():
            yield from slot

    def add(self, phrase: Sequence[int]) -> None:
        """Insert `phrase` (2 to `beta` ids) as the newest of its first token's, evicting the oldest if full."""
        phrase = self._checked(phrase)
        slot = self._phrases.setdefault(phrase[0], OrderedDict())
        for stored in list(slot):
            # A phrase a stored one starts with adds no candidate: refresh the longer one. One that
            # extends stored ones supersedes them. Either way the W slots hold distinct candidates.
            if stored[: len(phrase)] == phrase:
                slot.move_to_end(stored)
                return
            if phrase[: len(stored)] == stored:
                del slot[stored]
                self._size -= 1
        slot[phrase] = None
        self._size += 1
        if len(slot) > self.W:
            slot.popitem(last=False)
            self._size -= 1

    def replace(self, old: Sequence[int], new: Sequence[int]) -> None:
        """Drop `old` (if still held) and add `new`: the paper's candidate refinement."""
        old = tuple(old)
        slot = self._phrases.get(old[0]) if old else None
        if slot is not None and old in slot:
            del slot[old]
            self._size -= 1
        self.add(new)

    def candidates(self, token: int, k: int | None = None) -> list[Phrase]:
        """The phrases starting with `token`, most recently used first; at most `k` of them."""
        slot = self._phrases.get(token)
        if not slot:
            return []
        return list(reversed(slot))[:k]

    def fill_from(self, token_ids: Sequence[int], stride: int = 1) -> None:
        """Add the `beta`-grams of `token_ids` starting every `stride` tokens (a corpus, earlier outputs).

        Later phrases are newer, so when one token starts more than `W` of them the last ones stay.
        """
        if not isinstance(stride, int) or stride < 1:
            raise InvalidArgumentError(f"stride must be an integer >= 1, got {stride!r}")
        for start in range(0, len(token_ids) - self.beta + 1, stride):
            self.add(token_ids[start : start + self.beta])

    def _checked(self, phrase: Sequence[int]) -> Phrase:
        try:
            # Plain ints whatever integer type came in (numpy slices of a corpus), so phrases compare
            # equal and save as JSON.
            ids = tuple(operator.index(t) for t in phrase)
        except TypeError:
            raise InvalidArgumentError(f"a phrase holds int token ids, got {phrase!r}") from None
        if not 2 <= len(ids) <= self.beta:
            raise InvalidArgumentError(f"a phrase holds 2 to beta={self.beta} token ids, got {len(ids)}")
        if min(ids) < 0:
            raise InvalidArgumentError(f"token ids are >= 0, got {ids!r}")
        return ids

    # --- saving and loading -----------------------------------------------------------------

    def save(self, path: str | os.PathLike, tokenizer: PreTrainedTokenizerBase) -> None:
        """Write the pool to the JSON file `path`, tied to `tokenizer`, replacing it only once complete."""
        path = Path(path)
        # Oldest first within each token, so loading re-adds them in recency order.
        phrases = [list(phrase) for phrase in self]
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        header = {
            "format": _FORMAT,
            "format_version": FORMAT_VERSION,
            "W": self.W,
            "beta": self.beta,
            "tokenizer_fingerprint": self.fingerprint,
            "count": len(phrases),
            "phrases_sha256": _digest(phrases),
            "phrases": phrases,
        }
        atomic_write_bytes(path, json.dumps(header, separators=(",", ":")).encode())

    @classmethod
    def load(cls, path: str | os.PathLike, tokenizer: PreTrainedTokenizerBase) -> PhrasePool:
        """Read a pool `save` wrote with the same tokenizer; its W and beta are the file's."""
        path = Path(path)
        data = _read(path)
        if data["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
            raise PhrasePoolError(
                f"phrase pool {path} was saved with another tokenizer (its vocabulary or special tokens differ), "
                f"so its token ids mean other text; {_FIX_HINT} using this model's tokenizer"
            )
        try:
            pool = cls(data["W"], data["beta"])
            for phrase in data["phrases"]:
                pool.add(phrase)
        except InvalidArgumentError as error:  # a phrase of the wrong length for the file's beta
            raise _damaged(path, f"it holds an invalid entry ({error})") from None
        vocab = len(tokenizer)
        if any(max(phrase) >= vocab for phrase in data["phrases"]):
            raise _damaged(path, f"it holds token ids outside the tokenizer's {vocab}")
        pool.fingerprint = data["tokenizer_fingerprint"]
        return pool


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise PhrasePoolError(f"phrase pool {path} does not exist; save one with pool.save(path, tokenizer) first")
    try:
        data = load_json(path.read_bytes())
    except ValueError:  # UnicodeDecodeError is one
        raise _damaged(path, "it is truncated or corrupt (not valid JSON)") from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise _damaged(path, "it is not a rag-speculate phrase pool")
    if data.get("format_version") != FORMAT_VERSION or type(data["format_version"]) is not int:
        raise _damaged(
            path, f"it has format version {data.get('format_version')!r}, this rag-speculate reads {FORMAT_VERSION}"
        )
    try:
        _FILE(data, "")
    except FieldError as error:
        raise _damaged(path, str(error)) from None
    if data["count"] != len(data["phrases"]) or data["phrases_sha256"] != _digest(data["phrases"]):
        raise _damaged(path, "its phrases do not match their count and checksum (corrupted on disk)")
    return data


def _digest(phrases: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(phrases, separators=(",", ":")).encode()).hexdigest()


def _damaged(path: Path, problem: str) -> PhrasePoolError:
    return PhrasePoolError(f"phrase pool {path}: {problem}; {_FIX_HINT}")
