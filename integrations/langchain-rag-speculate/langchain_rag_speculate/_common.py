"""What the LLM and the chat model share: how the engine is found, the settings, per-call arguments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Self

from langchain_core.documents import Document
from langchain_core.language_models import LangSmithParams
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from rag_speculate import GenerationResult, SpeculativeEngine
from rag_speculate.devices import device_from_map, resolve_device
from rag_speculate.entrypoints.engines import DTYPES, shared_engine
from rag_speculate.entrypoints.prompt import check_call_arguments
from rag_speculate.retrieval.documents import TOKEN_IDS_KEY

# LangSmith groups runs by provider; LangChain partner packages use their package's suffix.
PROVIDER = "rag_speculate"
# What a caller may pass per call (besides `stop`), through invoke/stream/batch keyword arguments or `.bind`
# (the chat model also takes tools, tool_choice and response_format: `_tools.TOOL_ARGUMENTS`).
CALL_ARGUMENTS = ("max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "documents")
# What tells two configurations apart (LangChain's caches and tracing key on it).
IDENTIFYING_PARAMS = (
    "model",
    "dtype",
    "device",
    "draft_budget",
    "quantization",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
)


# Settings that configure loading a model, which an engine= already loaded has settled.
LOADING = ("dtype", "device", "device_map", "draft_budget", "prompt_cache_dir", "prompt_cache_disk_bytes", "quantization")


# Unknown settings are rejected: a mistyped one would otherwise be silently ignored. Each model class
# sets this again: pydantic takes the config of its last base, LangChain's, which ignores them.
MODEL_CONFIG = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True, protected_namespaces=())


class SpeculativeHFParams(BaseModel):
    """Settings of a rag-speculate model; every one except the loading ones can be overridden per call."""

    model_config = MODEL_CONFIG

    # The per-call arguments this class accepts (besides `stop`).
    call_arguments: ClassVar[tuple[str, ...]] = CALL_ARGUMENTS

    model: str | None = Field(default=None, validation_alias=AliasChoices("model", "model_id"))
    """A packaged model name (e.g. "qwen2.5-coder-1.5b-instruct"), a .gguf file, a local folder or a Hugging Face id."""
    engine: SpeculativeEngine | None = Field(default=None, exclude=True, repr=False)
    """An engine already loaded, to share one model between several LangChain and LlamaIndex objects."""
    dtype: str = "auto"
    device: str | int | None = None
    """As `HuggingFacePipeline` takes it: None for CUDA when available, else the CPU; "cpu", "cuda",
    "cuda:1"; or a GPU index (-1: the CPU)."""
    device_map: str | dict | None = None
    """As transformers takes it, for one device: "auto" (the default device), "cuda:0", "cpu"; the
    engine runs a model on one device, so a map over several is refused."""
    draft_budget: int | None = None
    """Draft tree nodes verified per forward (None: the engine's default; 0 disables speculation)."""
    prompt_cache_dir: str | None = None
    """A folder for the prompt cache's disk tier, shared by every process naming it (None: memory only)."""
    prompt_cache_disk_bytes: int | None = None
    """What `prompt_cache_dir` may hold, in bytes (None: 8 GiB)."""
    quantization: Literal["int8", "int4", "gguf"] | None = None
    """The model's linear layers as int8 or 4-bit weights, or a GGUF file's own quantized tensors, on
    the CPU (None: as loaded); the answers are the quantized model's own."""

    max_tokens: int = Field(default=256, ge=1, validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: list[str] | None = None

    @model_validator(mode="after")
    def _check_source(self) -> Self:
        if self.engine is None:
            if not self.model:
                raise ValueError(
                    "pass model= (a packaged model name, .gguf file, folder or Hugging Face id) or engine="
                )
            if self.dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
            # Refused now, by name, rather than when the model loads.
            self.device = str(resolve_device(device_from_map(self.device_map, self.device)))
            self.device_map = None
            return self
        loading = sorted(set(LOADING) & self.model_fields_set)
        if loading:
            raise ValueError(f"{', '.join(loading)} configure loading a model: they cannot be combined with engine=")
        # Describe the engine as it is, so tracing and _identifying_params tell the truth.
        self.model = self.model or self.engine.name
        self.dtype = str(self.engine.model.dtype).removeprefix("torch.")
        self.device = str(self.engine.model.device)
        self.draft_budget = self.engine.draft_budget
        return self

    @classmethod
    def from_model_id(
        cls,
        model_id: str,
        *,
        dtype: str = "auto",
        device: str | int | None = None,
        device_map: str | dict | None = None,
        draft_budget: int | None = None,
        **kwargs: Any,
    ) -> Self:
        """Load the model now (or reuse the engine this process already loaded with the same settings);
        `device` and `device_map` as `HuggingFacePipeline.from_model_id` takes them."""
        llm = cls(model=model_id, dtype=dtype, device=device, device_map=device_map, draft_budget=draft_budget, **kwargs)
        llm.get_engine()
        return llm

    @classmethod
    def from_engine(cls, engine: SpeculativeEngine, *, model: str | None = None, **kwargs: Any) -> Self:
        """Wrap an engine that is already loaded (several adapters may share it)."""
        return cls(engine=engine, model=model, **kwargs)

    def get_engine(self) -> SpeculativeEngine:
        """The engine, loaded on first use so that building the object stays cheap."""
        if self.engine is None:
            self.engine = shared_engine(
                self.model, dtype=self.dtype, device=self.device, draft_budget=self.draft_budget,
                prompt_cache_dir=self.prompt_cache_dir, prompt_cache_disk_bytes=self.prompt_cache_disk_bytes,
                quantization=self.quantization,
            )  # fmt: skip
        return self.engine

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in IDENTIFYING_PARAMS}

    def _generation_kwargs(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The engine's keyword arguments for one call: the settings, overridden by what the call passed
        (the chat model reads its own arguments, the tools, itself)."""
        # stop arrives as its own parameter in LangChain, so it is allowed here too.
        check_call_arguments(type(self).__name__, kwargs, ("stop", *self.call_arguments))
        return {
            "max_new_tokens": kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_tokens)),
            "temperature": kwargs.get("temperature", self.temperature),
            "top_p": kwargs.get("top_p", self.top_p),
            "top_k": kwargs.get("top_k", self.top_k),
            "seed": kwargs.get("seed", self.seed),
            "stop": self.stop if stop is None else stop,
            "documents": drafter_documents(kwargs.get("documents")),
        }

    def _ls_params(self, params: LangSmithParams, stop: list[str] | None, kwargs: dict[str, Any]) -> LangSmithParams:
        """The framework's defaults, with our provider and the settings it cannot see."""
        params["ls_provider"] = PROVIDER
        if "max_new_tokens" in kwargs:
            params["ls_max_tokens"] = kwargs["max_new_tokens"]
        if stop is None and self.stop:
            params["ls_stop"] = self.stop
        return params

    def _result_info(self, result: GenerationResult) -> dict[str, Any]:
        """What a caller learns about one generation besides its text."""
        return {
            "finish_reason": result.finish_reason,
            "model_name": self.model,
            "token_usage": result.stats.usage(),
            "speculative_stats": result.stats.as_dict(),
        }


def drafter_documents(documents: Sequence[Document | str | Sequence[int]] | None) -> list | None:
    """Documents for the drafters: LangChain Documents (their pre-tokenized ids when the corpus index
    stored them, else their text), strings or token-id lists."""
    if documents is None:
        return None
    if isinstance(documents, (str, Document)) or not isinstance(documents, Sequence):
        kinds = "LangChain Documents, strings or token-id lists"
        raise TypeError(f"documents must be a list of {kinds}, got {type(documents).__name__}")
    return [_drafter_document(doc) for doc in documents]


def _drafter_document(doc: Document | str | Sequence[int]) -> str | list[int]:
    if isinstance(doc, Document):
        ids = doc.metadata.get(TOKEN_IDS_KEY)
        return list(ids) if ids is not None else doc.page_content
    return doc  # text or token ids: the engine checks them
