"""The datastore's folder on disk: `.npy` arrays, loaded memory-mapped, and a JSON header with checksums.

A folder is written under a temporary name and renamed into place, so a crash never leaves a
half-written datastore; loading checks every header field against a schema, every array's size and
shape and, unless told not to, its checksum and the arrays' invariants (an edit can keep the
checksums right), and refuses a tokenizer other than the one that built it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from ...errors import RagSpeculateError
from ...files.cache import sha256_file
from ...files.durable import fsync_dir, not_replaceable, recover, replace_dir, sibling, write_new_file
from ...files.schema import SHA256, FieldError, fields, integer, list_of, load_json, optional, text
from ...fingerprint import tokenizer_fingerprint

FORMAT_VERSION = 1
_FORMAT = "rag-speculate-datastore"
HEADER = "datastore.json"
ARRAYS = ("tokens", "ends")
SEPARATOR = -1  # ends each document in `tokens` (see suffix_array.py)
_INT32_MAX = int(np.iinfo(np.int32).max)
# Every field loading reads, with its type and range; `format` and `format_version` are checked first.
_ARRAY = fields({"dtype": text(), "shape": list_of(integer(0), 1), "bytes": integer(0), "sha256": SHA256})
_HEADER = fields(
    {
        "tokenizer_fingerprint": optional(SHA256),  # None: built from token ids without a tokenizer
        "vocab_size": integer(1, _INT32_MAX),
        "documents": integer(1),
        "tokens": integer(1),
        "arrays": fields({name: _ARRAY for name in ARRAYS}),
    }
)
# Arrays are checked in slices of this many entries, so no temporary the size of the corpus is held.
_SLICE = 1 << 20
_REBUILD_HINT = "rebuild it with Datastore.from_texts(texts, tokenizer).save(path)"


class DatastoreError(RagSpeculateError):
    """A datastore cannot be built, saved or loaded; the message says why and how to rebuild it."""


def check_replaceable(path: Path) -> None:
    """Refuse to overwrite a folder that is not a datastore: it may hold anything of the user's."""
    names = (HEADER, *(f"{name}.npy" for name in ARRAYS))
    foreign = not_replaceable(path, "datastore", HEADER, _FORMAT, names) if path.exists() else None
    if foreign:
        raise DatastoreError(f"{path} {foreign}; refusing to replace it (choose another path)")


def write_folder(path: Path, arrays: dict[str, np.ndarray], fields: dict[str, Any]) -> None:
    """Write `arrays` and a header of `fields` to a staging folder, then swap it in for `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    staging = sibling(path, "tmp")
    staging.mkdir()
    try:
        specs = {name: _write_array(staging / f"{name}.npy", arrays[name]) for name in ARRAYS}
        header = {"format": _FORMAT, "format_version": FORMAT_VERSION, **fields, "arrays": specs}
        write_new_file(staging / HEADER, json.dumps(header, indent=2).encode())
        fsync_dir(staging)
        replace_dir(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def read_folder(
    path: Path, tokenizer: PreTrainedTokenizerBase | None, verify: bool
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and the memory-mapped arrays of the datastore at `path`, checked."""
    recover(path)
    header = _read_header(path)
    if tokenizer is not None and header["tokenizer_fingerprint"] not in (None, tokenizer_fingerprint(tokenizer)):
        raise DatastoreError(
            f"datastore {path} was built with another tokenizer (its vocabulary or special tokens differ), "
            f"so its token ids mean other text; {_REBUILD_HINT} using the model's tokenizer"
        )
    arrays = {name: _load_array(path, name, header["arrays"][name], verify) for name in ARRAYS}
    _check_arrays(path, header, arrays["tokens"], arrays["ends"], verify)
    return header, arrays


def damaged(path: Path, problem: str) -> DatastoreError:
    return DatastoreError(f"datastore {path}: {problem}; {_REBUILD_HINT}")


def _write_array(file: Path, array: np.ndarray) -> dict[str, Any]:
    with file.open("xb") as out:
        np.save(out, array, allow_pickle=False)
        out.flush()
        os.fsync(out.fileno())
    return {"dtype": array.dtype.str, "shape": list(array.shape), "bytes": file.stat().st_size, "sha256": sha256_file(file)}


def _read_header(path: Path) -> dict[str, Any]:
    file = path / HEADER
    if not file.is_file():
        raise DatastoreError(
            f"{path} is not a datastore (no {HEADER}); build one with Datastore.from_texts(texts, tokenizer).save(path)"
        )
    try:
        header = load_json(file.read_bytes())
    except ValueError:  # UnicodeDecodeError is one
        raise damaged(path, f"{HEADER} is corrupt (not JSON)") from None
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise damaged(path, f"{HEADER} is not a rag-speculate datastore header")
    if header.get("format_version") != FORMAT_VERSION or type(header["format_version"]) is not int:
        version = header.get("format_version")
        raise damaged(path, f"it has format version {version!r}, this rag-speculate reads {FORMAT_VERSION}")
    try:
        _HEADER(header, "")
    except FieldError as error:
        raise damaged(path, f"{HEADER} {error}") from None
    return header


def _load_array(path: Path, name: str, spec: dict[str, Any], verify: bool) -> np.ndarray:
    file = path / f"{name}.npy"
    if not file.is_file():
        raise damaged(path, f"{file.name} is missing")
    size = file.stat().st_size
    if size != spec["bytes"]:
        problem = "is truncated" if size < spec["bytes"] else "is larger than written"
        raise damaged(path, f"{file.name} {problem} ({size} of {spec['bytes']} bytes)")
    try:
        array = np.load(file, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise damaged(path, f"{file.name} is not a readable array ({error})") from None
    if array.dtype != np.int32 or array.ndim != 1 or list(array.shape) != spec["shape"]:
        raise damaged(path, f"{file.name} holds {array.dtype} {array.shape}, not int32 {tuple(spec['shape'])}")
    if verify and sha256_file(file) != spec["sha256"]:
        raise damaged(path, f"{file.name} does not match its checksum (corrupted on disk)")
    # A plain ndarray over the mapping: indexing a np.memmap subclass is slower on the search path.
    return array.view(np.ndarray)


def _check_arrays(path: Path, header: dict[str, Any], tokens: np.ndarray, ends: np.ndarray, verify: bool) -> None:
    """The invariants retrieval relies on: token ids within the vocabulary, one separator per document
    boundary, every suffix position inside a document with a successor, so no search reads out of range.

    Without `verify` only the lengths: the rest reads the whole datastore, as the checksums do.
    """
    tokens_count, documents = header["tokens"], header["documents"]
    if len(tokens) != tokens_count + documents + 1:
        counted = f"{tokens_count} tokens in {documents} documents"
        raise damaged(path, f"tokens.npy holds {len(tokens)} entries, the header counts {counted}")
    if len(ends) > tokens_count:
        raise damaged(path, f"ends.npy holds {len(ends)} positions, more than the {tokens_count} tokens")
    if not verify:
        return
    if len(tokens) and (tokens.min() < SEPARATOR or tokens.max() >= header["vocab_size"]):
        raise damaged(path, f"tokens.npy holds token ids outside [0, vocab_size={header['vocab_size']})")
    separators = sum(int(np.count_nonzero(part == SEPARATOR)) for part in _slices(tokens))
    if separators != documents + 1:
        raise damaged(path, f"tokens.npy holds {separators - 1} document ends, the header counts {documents} documents")
    for part in _slices(ends):
        if len(part) and (part.min() < 1 or part.max() > len(tokens) - 3):
            raise damaged(path, "ends.npy holds positions outside the tokens")
        if np.any(tokens[part] == SEPARATOR) or np.any(tokens[part + 1] == SEPARATOR):
            raise damaged(path, "ends.npy holds a position at a separator or at the end of a document")


def _slices(array: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, len(array), _SLICE):
        yield array[start : start + _SLICE]
