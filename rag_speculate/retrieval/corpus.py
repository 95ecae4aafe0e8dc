"""The corpus index: one folder from which retrieval feeds both the prompt and the drafts.

Built once from a corpus (`CorpusIndex.build`, or `rag-speculate index`):

- documents are cut into chunks of `chunk_tokens` target-model tokens overlapping by
  `chunk_overlap` (`chunking.py`);
- the chunks are embedded with a sentence-transformers model (`embedding.py`) into a FAISS index:
  exact by default, IVF for corpora where a linear scan is too slow;
- each chunk's token ids are stored, so a retrieved chunk reaches the n-gram trie untokenized;
- the whole documents' token ids make a REST datastore (`datastore.py`) in the same folder.

A manifest (`index_format.py`) records what built the folder and lets loading refuse a mismatched
tokenizer or embedding model, or any file that disagrees with it or with the others; rebuilding
with the same inputs does nothing; a build is staged beside the folder and renamed into place, so
an interrupted one leaves the previous index (`files.durable.replace_dir`, `recover`).

This module also re-exports the corpus names users import from here.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from ..drafters.rest import Datastore, DatastoreError
from ..errors import InvalidArgumentError, RagSpeculateError
from ..files.durable import fsync_dir, os_reason, recover, replace_dir, sibling, write_new_file
from . import index_format as fmt
from .chunking import ChunkingOptions, chunk_document
from .documents import Chunk, Document, read_corpus
from .embedding import (
    BGE_EMBEDDING,
    BGE_QUERY_INSTRUCTION,
    PACKAGED_EMBEDDING,
    Embedder,
    load_embedder,
    packaged_embedding_path,
)
from .index_format import FORMAT_VERSION, MANIFEST, CorpusIndexError, embedding_named_by

__all__ = [
    "BGE_EMBEDDING",
    "BGE_QUERY_INSTRUCTION",
    "FORMAT_VERSION",
    "MANIFEST",
    "PACKAGED_EMBEDDING",
    "Chunk",
    "ChunkingOptions",
    "CorpusIndex",
    "CorpusIndexError",
    "Document",
    "Embedder",
    "load_embedder",
    "packaged_embedding_path",
    "read_corpus",
]


class CorpusIndex:
    """A built index, loaded: `search` for chunks, `datastore` for the REST drafter."""

    def __init__(
        self,
        path: Path,
        manifest: dict[str, Any],
        embedder: Embedder,
        vectors: Any,
        datastore: Datastore,
        chunks: list[dict[str, Any]],
        tokens: np.ndarray,
        offsets: np.ndarray,
    ):
        self.path = path
        self.manifest = manifest
        self.embedder = embedder
        self.datastore = datastore
        self._vectors = vectors
        self._chunks = chunks
        self._tokens = tokens
        self._offsets = offsets

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
        recover(out)
        # Only a folder an index build wrote is ever replaced: anything else may be the user's.
        foreign = fmt.not_an_index(out) if out.exists() else None
        if foreign:
            raise CorpusIndexError(f"{out} {foreign}; refusing to replace it (choose another --out)")
        embedder = embedder if isinstance(embedder, Embedder) else load_embedder(embedder)
        say = log or (lambda _message: None)
        build_key = fmt.build_key(documents, tokenizer, embedder, options)
        if (out / MANIFEST).is_file():
            try:
                existing = cls.load(out, tokenizer=tokenizer, embedder=embedder)
                if existing.manifest["build_key"] == build_key:
                    say(f"{out} is up to date ({len(existing)} chunks)")
                    return existing
            except RagSpeculateError as problem:
                say(f"rebuilding {out}: {problem}")

        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            staging = sibling(out, "tmp")
            staging.mkdir()
            try:
                cls._write(staging, documents, tokenizer, embedder, options, build_key, progress, say)
                replace_dir(staging, out)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        except OSError as error:  # a full disk, a path through a file, no permission: the old index stays
            raise CorpusIndexError(f"cannot write the corpus index {out}: {os_reason(error)}") from None
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
            ids, pieces = chunk_document(document.text, tokenizer, options)
            document_ids.append(ids)
            for text, piece in pieces:
                chunks.append({"text": text, "title": document.title, "id": document.id, "metadata": document.metadata, "document": number})
                chunk_ids.append(piece)
        say(f"embedding {len(chunks)} chunks with {embedder.name}")
        vectors = embedder.embed([c["text"] for c in chunks], progress=progress)
        say("building the FAISS index and the REST datastore")
        index = _faiss_index(vectors, options)
        Datastore.build(document_ids, vocab_size=len(tokenizer), tokenizer=tokenizer).save(folder / fmt.DATASTORE)

        lengths = np.array([len(ids) for ids in chunk_ids], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = np.fromiter((t for ids in chunk_ids for t in ids), dtype=np.int32, count=int(offsets[-1]))
        write_new_file(folder / fmt.CHUNKS, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chunks).encode())
        write_new_file(folder / fmt.CHUNK_TOKENS, fmt.npy_bytes(flat))
        write_new_file(folder / fmt.CHUNK_OFFSETS, fmt.npy_bytes(offsets))
        import faiss

        write_new_file(folder / fmt.VECTORS, faiss.serialize_index(index).tobytes())
        fmt.write_manifest(
            folder,
            key=build_key,
            tokenizer=tokenizer,
            embedder=embedder,
            dimension=int(vectors.shape[1]),
            options=options,
            documents=len(documents),
            chunks=len(chunks),
            tokens=int(sum(len(ids) for ids in document_ids)),
        )
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

        The embedding model is the one the manifest names, loaded by that name (the packaged
        model or a hub id; an index built from a folder needs `embedder`), unless `embedder` is
        given, which must then be the same weights: vectors of another model are meaningless to
        this index. Every file is checked against the manifest and the others before use.
        """
        path = Path(path)
        recover(path)
        fmt.check_trusted(path)
        manifest = fmt.read_manifest(path)
        if tokenizer is not None:
            fmt.check_tokenizer(path, manifest, tokenizer)
        built_with = manifest["embedding"]
        if not isinstance(embedder, Embedder):
            embedder = load_embedder(embedding_named_by(path, built_with["name"]) if embedder is None else embedder)
        if embedder.fingerprint != built_with["fingerprint"]:
            raise CorpusIndexError(
                f"index {path} was built with embedding model {built_with['name']!r}, not {embedder.name!r} "
                "(their weights differ); query it with the model that built it, or rebuild it"
            )
        embedder.query_instruction = built_with["query_instruction"]
        for name in fmt.CHECKED_FILES:
            fmt.check_file(path, name, manifest["files"][name])
        # The checksums only say the files are as written: whether they fit together is checked too.
        chunks = fmt.read_chunks(path, manifest)
        tokens, offsets = fmt.read_chunk_arrays(path, manifest)
        vectors = fmt.read_vectors(path, manifest)
        try:
            datastore = Datastore.load(path / fmt.DATASTORE, tokenizer)
        except DatastoreError as error:
            raise fmt.damaged(path, str(error)) from None
        fmt.check_datastore(path, manifest, datastore)
        return cls(path, manifest, embedder, vectors, datastore, chunks, tokens, offsets)

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

    def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase, model: str | None = None) -> None:
        """Raise unless the chunks' token ids mean the same text for `tokenizer` (of `model`, which the
        error names in the command that rebuilds the index)."""
        fmt.check_tokenizer(self.path, self.manifest, tokenizer, model)


def _faiss_index(vectors: np.ndarray, options: ChunkingOptions) -> Any:
    """Inner product over unit vectors (cosine): a flat scan, or IVF trained on the vectors themselves."""
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


def _progress(items: Sequence[Any], enabled: bool, what: str) -> Iterator[Any]:
    from tqdm.auto import tqdm

    return iter(tqdm(items, desc=what, disable=not enabled, unit="doc"))
