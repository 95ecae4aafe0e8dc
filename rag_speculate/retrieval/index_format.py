"""The corpus index's folder on disk: its file names, its manifest, and the checks made on loading.

The manifest records what built the folder (tokenizer and embedding model fingerprints, options,
a key over all inputs) and every file's size and checksum. Loading checks every manifest field
against a schema, then the files against the manifest, then the files against each other (an edit
can keep the checksums right), so an index is never used with a tokenizer whose ids mean other
text, and a damaged file is refused by name before anything is searched.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from ..drafters.rest import Datastore
from ..errors import CorpusIndexError, InvalidArgumentError
from ..files.cache import sha256_file
from ..files.durable import not_replaceable, untrusted, write_new_file
from ..files.schema import SHA256, FieldError, fields, integer, load_json, of_type, text
from ..fingerprint import tokenizer_fingerprint
from .chunking import ChunkingOptions
from .documents import Document
from .embedding import HUB_ID, PACKAGED_EMBEDDING, Embedder

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
_INT32_MAX = int(np.iinfo(np.int32).max)  # chunk token ids are stored as int32

# Every field loading reads, with its type and range; `format` and `format_version` are checked first.
_MANIFEST = fields(
    {
        "build_key": SHA256,
        "tokenizer_fingerprint": SHA256,
        "vocab_size": integer(1, _INT32_MAX),
        # The embedding model's name is only compared and looked up by name (embedding.py), never opened.
        "embedding": fields(
            {"name": text(r".+"), "fingerprint": SHA256, "dimension": integer(1), "query_instruction": text()}
        ),
        "options": fields(
            {"chunk_tokens": integer(1), "chunk_overlap": integer(0), "ivf_lists": integer(0), "ivf_probe": integer(1)}
        ),
        "documents": integer(1),
        "chunks": integer(1),
        "tokens": integer(1),
        "files": fields({name: fields({"bytes": integer(0), "sha256": SHA256}) for name in CHECKED_FILES}),
    }
)
# A line of chunks.jsonl. A title or id is whatever JSON scalar the Document held.
_CHUNK_ROW = fields(
    {
        "text": text(),
        "title": of_type(str, int, float, type(None)),
        "id": of_type(str, int, float, type(None)),
        "metadata": of_type(dict),
        "document": integer(0),
    }
)


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
        manifest = load_json(file.read_bytes())
    except ValueError:  # UnicodeDecodeError is one
        raise damaged(path, f"{MANIFEST} is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise CorpusIndexError(f"{path} holds a {MANIFEST} that is not a rag-speculate corpus index's")
    if manifest.get("format_version") != FORMAT_VERSION or type(manifest["format_version"]) is not int:
        raise damaged(path, f"it has format version {manifest.get('format_version')!r}, this rag-speculate reads {FORMAT_VERSION}")
    try:
        _MANIFEST(manifest, "")
        ChunkingOptions(**{name: manifest["options"][name] for name in ChunkingOptions.__dataclass_fields__}).check()
    except (FieldError, InvalidArgumentError) as error:
        raise damaged(path, f"{MANIFEST} {error}") from None
    return manifest


def not_an_index(path: Path) -> str | None:
    """Why the existing `path` is not a folder an index build wrote (and must not be replaced), or None."""
    return not_replaceable(path, "corpus index", MANIFEST, _FORMAT, (MANIFEST, DATASTORE, *CHECKED_FILES))


def check_trusted(path: Path) -> None:
    """Refuse an index that another user could have changed: the folder or anything in it owned by
    another user (root aside) or writable by every user, as the CPU kernels' folder is refused. The
    files' checksums are checked once on loading, while the arrays are read as they are used."""
    if not path.is_dir():
        return  # read_manifest says what is missing
    for entry in [path, *sorted(path.rglob("*"))]:
        problem = untrusted(entry)
        if problem:
            raise CorpusIndexError(
                f"corpus index {path}: {entry} {problem}, so another user could have changed it; "
                f"make it yours and writable only by you (chown, chmod o-w) or rebuild it"
            )


def check_tokenizer(path: Path, manifest: dict[str, Any], tokenizer: PreTrainedTokenizerBase, model: str | None = None) -> None:
    if tokenizer_fingerprint(tokenizer) != manifest["tokenizer_fingerprint"]:
        raise CorpusIndexError(
            f"index {path} was built with another tokenizer (its vocabulary or special tokens differ), so its "
            f"token ids mean other text for {model or 'this model'}; rebuild it with: rag-speculate index CORPUS "
            f"--out {path} --model {model or 'MODEL'}"
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


def read_chunks(path: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of chunks.jsonl, each checked, as many as the manifest counts."""
    rows = []
    for number, line in enumerate((path / CHUNKS).read_bytes().splitlines(), start=1):
        where = f"{CHUNKS} line {number}"
        try:
            row = load_json(line)
            _CHUNK_ROW(row, "")
        except ValueError:
            raise damaged(path, f"{where} is not valid JSON") from None
        except FieldError as error:
            raise damaged(path, f"{where} {error}") from None
        if row["document"] >= manifest["documents"]:
            raise damaged(path, f"{where} names document {row['document']}, of {manifest['documents']}")
        rows.append(row)
    if len(rows) != manifest["chunks"]:
        raise damaged(path, f"{CHUNKS} holds {len(rows)} chunks, {MANIFEST} counts {manifest['chunks']}")
    return rows


def read_chunk_arrays(path: Path, manifest: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The chunks' token ids (memory-mapped) and offsets, checked to slice each other within range."""
    tokens = _load_array(path, CHUNK_TOKENS, mmap_mode="r")
    offsets = _load_array(path, CHUNK_OFFSETS)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise damaged(path, f"{CHUNK_TOKENS} holds {tokens.dtype} {tokens.shape}, not integer token ids")
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) != manifest["chunks"] + 1:
        expected = f"{manifest['chunks'] + 1} integer offsets"
        raise damaged(path, f"{CHUNK_OFFSETS} holds {offsets.dtype} {offsets.shape}, not {expected}")
    if offsets[0] != 0 or np.any(offsets[1:] < offsets[:-1]):
        raise damaged(path, f"{CHUNK_OFFSETS} is not increasing from 0")
    if offsets[-1] != len(tokens):
        raise damaged(path, f"{CHUNK_OFFSETS} ends at {offsets[-1]}, but {CHUNK_TOKENS} holds {len(tokens)} tokens")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= manifest["vocab_size"]):
        raise damaged(path, f"{CHUNK_TOKENS} holds token ids outside the vocabulary of {manifest['vocab_size']}")
    return tokens.view(np.ndarray), offsets


def read_vectors(path: Path, manifest: dict[str, Any]) -> Any:
    """The FAISS index, checked to hold one vector of the manifest's dimension per chunk."""
    import faiss

    try:
        vectors = faiss.deserialize_index(np.frombuffer((path / VECTORS).read_bytes(), dtype=np.uint8))
    except RuntimeError:
        raise damaged(path, f"{VECTORS} is not a FAISS index") from None
    dimension, chunks = manifest["embedding"]["dimension"], manifest["chunks"]
    if vectors.d != dimension or vectors.ntotal != chunks or vectors.metric_type != faiss.METRIC_INNER_PRODUCT:
        expected = f"{chunks} of {dimension} by inner product"
        raise damaged(path, f"{VECTORS} holds {vectors.ntotal} vectors of {vectors.d} dimensions, not {expected}")
    lists, probe = manifest["options"]["ivf_lists"], manifest["options"]["ivf_probe"]
    ivf = faiss.try_extract_index_ivf(vectors)
    if (ivf.nlist if ivf is not None else 0) != lists:
        raise damaged(path, f"{VECTORS} is not an IVF index of {lists} lists" if lists else f"{VECTORS} is not an exact index")
    if ivf is not None:
        ivf.nprobe = probe
    return vectors


def check_datastore(path: Path, manifest: dict[str, Any], datastore: Datastore) -> None:
    """The datastore holds the documents the manifest counts, as token ids of the same tokenizer."""
    found = (datastore.vocab_size, datastore.fingerprint, datastore.num_documents, datastore.num_tokens)
    if found != (manifest["vocab_size"], manifest["tokenizer_fingerprint"], manifest["documents"], manifest["tokens"]):
        raise damaged(path, f"its {DATASTORE} and {MANIFEST} disagree on the vocabulary, tokenizer, documents or tokens")


def _load_array(path: Path, name: str, mmap_mode: str | None = None) -> np.ndarray:
    try:
        return np.load(path / name, mmap_mode=mmap_mode, allow_pickle=False)
    except (ValueError, OSError) as error:
        raise damaged(path, f"{name} is not a readable array ({error})") from None


def damaged(path: Path, problem: str) -> CorpusIndexError:
    return CorpusIndexError(f"corpus index {path}: {problem}; rebuild it with: rag-speculate index CORPUS --out {path}")


def embedding_named_by(index: Path, name: str) -> str:
    """The embedding model name an index's manifest records, to load it by; refused if it is a path.

    An index only names its embedding model: a path it recorded could point anywhere, and would
    load whatever is there. A model from a folder is one the caller loads and passes (its weights
    are checked against the index's either way).
    """
    # sentence-transformers opens a folder of a hub id's name, if there is one, before asking the hub.
    if name == PACKAGED_EMBEDDING or (HUB_ID.fullmatch(name) and not Path(name).exists()):
        return name
    raise CorpusIndexError(
        f"corpus index {index}: {MANIFEST} field embedding.name is {name!r}, which is not a model name (the packaged "
        "model or a Hugging Face hub id owner/name) but a path, and an index never opens a path it names; load "
        "that model yourself and pass it: CorpusIndex.load(path, embedder=load_embedder(FOLDER))"
    )
