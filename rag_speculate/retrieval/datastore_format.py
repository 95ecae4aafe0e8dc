"""The datastore's folder on disk: `.npy` arrays, loaded memory-mapped, and a JSON header with checksums.

A folder is written under a temporary name and renamed into place, so a crash never leaves a
half-written datastore; loading checks the header, every array's size and shape and, unless told
not to, its checksum, and refuses a tokenizer other than the one that built it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from .fingerprint import tokenizer_fingerprint
from ..errors import RagSpeculateError
from ..files import fsync_dir, replace_dir, sha256_file, sibling, write_new_file

FORMAT_VERSION = 1
_FORMAT = "rag-speculate-datastore"
HEADER = "datastore.json"
ARRAYS = ("tokens", "ends")
_HEADER_FIELDS = {"tokenizer_fingerprint", "vocab_size", "documents", "tokens", "arrays"}
_ARRAY_FIELDS = {"shape", "bytes", "sha256"}
_REBUILD_HINT = "rebuild it with Datastore.from_texts(texts, tokenizer).save(path)"


class DatastoreError(RagSpeculateError):
    """A datastore cannot be built, saved or loaded; the message says why and how to rebuild it."""


def check_replaceable(path: Path) -> None:
    """Refuse to overwrite a folder that is not a datastore: it may hold anything of the user's."""
    if path.exists() and not (path / HEADER).is_file():
        raise DatastoreError(f"{path} exists and is not a datastore; refusing to replace it (choose another path)")


def write_folder(path: Path, arrays: dict[str, np.ndarray], fields: dict[str, Any]) -> None:
    """Write `arrays` and a header of `fields` to a staging folder, then swap it in for `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
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
    header = _read_header(path)
    if tokenizer is not None and header["tokenizer_fingerprint"] not in (None, tokenizer_fingerprint(tokenizer)):
        raise DatastoreError(
            f"datastore {path} was built with another tokenizer (its vocabulary or special tokens differ), "
            f"so its token ids mean other text; {_REBUILD_HINT} using the model's tokenizer"
        )
    return header, {name: _load_array(path, name, header["arrays"][name], verify) for name in ARRAYS}


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
        header = json.loads(file.read_text())
    except ValueError:
        raise damaged(path, f"{HEADER} is corrupt (not JSON)") from None
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise damaged(path, f"{HEADER} is not a rag-speculate datastore header")
    if header.get("format_version") != FORMAT_VERSION:
        version = header.get("format_version")
        raise damaged(path, f"it has format version {version!r}, this rag-speculate reads {FORMAT_VERSION}")
    arrays = header.get("arrays")
    if not (
        _HEADER_FIELDS <= header.keys()
        and isinstance(arrays, dict)
        and all(isinstance(arrays.get(name), dict) and _ARRAY_FIELDS <= arrays[name].keys() for name in ARRAYS)
    ):
        raise damaged(path, f"{HEADER} is corrupt (fields missing)")
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
