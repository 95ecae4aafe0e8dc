"""What a server process (or a Ray Serve replica) is built from: a few names and paths, read once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...engine import SpeculativeEngine
from ...retrieval.corpus import CorpusIndex
from ..engines import rag_engine, shared_engine

# A request body larger than this is refused before it is parsed.
MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    """`model`: a packaged name, folder, .gguf or hub id (what clients send as "model" is
    `served_name`, by default the model's name); `index`: a folder from `rag-speculate index`,
    opened read-only, for retrieval and for the REST drafter (`embedding_model`: the folder of the
    model that embedded it, when it was built from one); `max_queued`: requests waiting for the
    engine beyond the one it runs, after which the server answers 503."""

    model: str
    index: Path | None = None
    embedding_model: str | None = None
    draft_model: str | None = None
    device: str | None = None
    dtype: str = "auto"
    served_name: str | None = None
    max_queued: int = 16
    max_body_bytes: int = MAX_BODY_BYTES

    @property
    def name(self) -> str:
        return self.served_name or Path(self.model).name


def load(config: ServerConfig) -> tuple[SpeculativeEngine, CorpusIndex | None]:
    """The engine (drafting from the request's documents, the index's corpus and the draft model)
    and the index, loaded and verified before the server takes a request."""
    base = shared_engine(config.model, dtype=config.dtype, device=config.device, draft_budget=None)
    index = None
    if config.index is not None:
        index = CorpusIndex.load(config.index, tokenizer=base.tokenizer, embedder=config.embedding_model)
    return rag_engine(base, index, config.draft_model), index
