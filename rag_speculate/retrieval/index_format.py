"""The corpus index's folder on disk: its file names, its manifest, and the checks made on loading.

The manifest records what built the folder (tokenizer and embedding model fingerprints, options,
a key over all inputs) and every file's size and checksum. Loading checks them, so an index is
never used with a tokenizer whose ids mean other text, and a truncated or corrupted file is found
before it is searched.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from .documents import Document
from .fingerprint import tokenizer_fingerprint
from ..errors import InvalidArgumentError, RagSpeculateError
from ..files import sha256_file, write_new_file

if TYPE_CHECKING:
    from .chunking import ChunkingOptions
    from .embedding import Embedder

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_FORMAT = "rag-speculate corpus index"
CHUNKS = "chunks.jsonl"
CHUNK_TOKENS = "chunk_tokens.npy"
CHUNK_OFFSETS = "chunk_offsets.npy"
VECTORS = "vectors.faiss"
DATASTORE = "datastore"
# The datastore folder checks its own files.
CHECKED_FILES = (CHUNKS, CHUNK_TOKENS, CHUNK_OFFSETS, VECTORS)


class CorpusIndexError(RagSpeculateError):
    """An index cannot be built or loaded; the message names the folder, the problem and the fix."""


def build_key(
    documents: Sequence[Document], tokenizer: PreTrainedTokenizerBase, embedder: Embedder, options: ChunkingOptions
) -> str:
    """A sha256 over everything that decides the index's contents: equal keys, nothing to rebuild."""
    digest = hashlib.sha256()
    header = {"version": FORMAT_VERSION, "tokenizer": tokenizer_fingerprint(tokenizer), "embedding": embedder.fingerprint, "options": options.__dict__}
    digest.update(json.dumps(header, sort_keys=True).encode())
    for d in documents:
        if not isinstance(d, Document):
            raise InvalidArgumentError(f"documents must be Document objects, got {type(d).__name__}")
        digest.update(json.dumps([d.text, d.title, d.id, d.metadata], sort_keys=True, ensure_ascii=False).encode())
    return digest.hexdigest()


def write_manifest(
    folder: Path,
    *,
    key: str,
    tokenizer: PreTrainedTokenizerBase,
    embedder: Embedder,
    dimension: int,
    options: ChunkingOptions,
    documents: int,
    chunks: int,
    tokens: int,
) -> None:
    """The manifest of a folder whose other files are all written, with their sizes and checksums."""
    manifest = {
        "format": _FORMAT,
        "format_version": FORMAT_VERSION,
        "build_key": key,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "vocab_size": len(tokenizer),
        "embedding": {
            "name": embedder.name,
            "fingerprint": embedder.fingerprint,
            "dimension": dimension,
            "query_instruction": embedder.query_instruction,
        },
        "options": options.__dict__,
        "documents": documents,
        "chunks": chunks,
        "tokens": tokens,
        "files": {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)} for name in CHECKED_FILES},
    }
    write_new_file(folder / MANIFEST, json.dumps(manifest, indent=2).encode())


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CorpusIndexError(f"no corpus index at {path}; build one with: rag-speculate index CORPUS --out {path}")
    file = path / MANIFEST
    if not file.is_file():
        raise CorpusIndexError(f"{path} is not a corpus index (no {MANIFEST}); build one with: rag-speculate index CORPUS --out {path}")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise damaged(path, f"{MANIFEST} is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise CorpusIndexError(f"{path} holds a {MANIFEST} that is not a rag-speculate corpus index's")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise damaged(path, f"it has format version {manifest.get('format_version')!r}, this rag-speculate reads {FORMAT_VERSION}")
    return manifest


def check_tokenizer(path: Path, manifest: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer_fingerprint(tokenizer) != manifest["tokenizer_fingerprint"]:
        raise CorpusIndexError(
            f"index {path} was built with another tokenizer (its vocabulary or special tokens differ), so its "
            "token ids mean other text for this model; rebuild it with: rag-speculate index CORPUS --out "
            f"{path} --model <this model>"
        )


def check_file(path: Path, name: str, spec: dict[str, Any]) -> None:
    file = path / name
    if not file.is_file():
        raise damaged(path, f"{name} is missing")
    size = file.stat().st_size
    if size != spec["bytes"]:
        raise damaged(path, f"{name} has {size} bytes, {spec['bytes']} were written (truncated or overwritten)")
    if sha256_file(file) != spec["sha256"]:
        raise damaged(path, f"{name} does not match its checksum (corrupted on disk)")


def damaged(path: Path, problem: str) -> CorpusIndexError:
    return CorpusIndexError(f"corpus index {path}: {problem}; rebuild it with: rag-speculate index CORPUS --out {path}")
