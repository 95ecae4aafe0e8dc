"""What a server process (or a Ray Serve replica) is built from: a few names and paths, read once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...engine import SpeculativeEngine
from ...retrieval.corpus import CorpusIndex
from ..engines import shared_engine
from ..warm import WarmPrompt, warm

# A request body larger than this is refused before it is parsed.
MAX_BODY_BYTES = 8 * 1024 * 1024
# A streamed answer whose client takes nothing for this long is cut off, freeing the engine.
SEND_TIMEOUT_S = 30.0
# A request body that has not arrived whole this long after its headers is refused (408).
BODY_TIMEOUT_S = 60.0
# On SIGTERM or SIGINT, how long the running generations get to finish before they are stopped.
SHUTDOWN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServerConfig:
    """`model`: a packaged name, folder, .gguf or hub id (what clients send as "model" is
    `served_name`, by default the model's name); `index`: a folder from `rag-speculate index`,
    opened read-only, for retrieval and for the REST drafter (`embedding_model`: the folder of the
    model that embedded it, when it was built from one); `max_queued`: requests waiting for the
    engine beyond the one it runs, after which the server answers 503; `api_key`: what clients must
    send as `Authorization: Bearer KEY` (None: no key); the timeouts: `app.create_app`'s and, on
    SIGTERM or SIGINT, `shutdown_timeout_s` for the running generations to finish;
    `max_batch`: generations the engine runs together, `draft_budget`: draft tokens a sequence
    verifies per step at most and `cuda_graphs`: its step replayed in CUDA graphs (None: the
    defaults; `SpeculativeEngine`);
    `quantization` and `draft_quantization`: as `SpeculativeEngine.from_pretrained` takes them;
    `prompt_cache_dir` and `prompt_cache_disk_bytes`: the prompt cache's disk tier, one folder every
    replica shares; `warm`: prompts prefilled before the first request (`entrypoints/warm.py`)."""

    model: str
    index: Path | None = None
    embedding_model: str | None = None
    draft_model: str | None = None
    device: str | None = None
    dtype: str = "auto"
    served_name: str | None = None
    max_queued: int = 16
    max_batch: int | None = None
    draft_budget: int | None = None
    cuda_graphs: bool | None = None
    quantization: str | None = None
    draft_quantization: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    api_key: str | None = field(default=None, repr=False)
    send_timeout_s: float = SEND_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S
    prompt_cache_dir: Path | None = None
    prompt_cache_disk_bytes: int | None = None
    warm: tuple[WarmPrompt, ...] = field(default=(), repr=False)

    @property
    def name(self) -> str:
        return self.served_name or Path(self.model).name

    def app_options(self) -> dict:
        """What `app.create_app` takes from the configuration."""
        return {"max_body_bytes": self.max_body_bytes, "api_key": self.api_key, "send_timeout_s": self.send_timeout_s,
                "body_timeout_s": self.body_timeout_s}


def load(config: ServerConfig) -> tuple[SpeculativeEngine, CorpusIndex | None]:
    """The engine (drafting from the request's documents, the index's corpus and the draft model)
    and the index, loaded and verified, and the warm prompts prefilled, before the server takes a
    request."""
    index = None if config.index is None else CorpusIndex.load(config.index, embedder=config.embedding_model)
    engine = shared_engine(
        config.model, dtype=config.dtype, device=config.device, quantization=config.quantization, index=index,
        draft_model=config.draft_model, draft_quantization=config.draft_quantization, max_batch=config.max_batch,
        draft_budget=config.draft_budget, cuda_graphs=config.cuda_graphs, prompt_cache_dir=config.prompt_cache_dir,
        prompt_cache_disk_bytes=config.prompt_cache_disk_bytes,
    )  # fmt: skip
    warm(engine, config.warm)
    return engine, index
