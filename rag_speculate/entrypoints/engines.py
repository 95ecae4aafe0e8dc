"""The engines every entrance shares: one per configuration and process (`shared_engine`), and one
drafting for RAG from the retrieved chunks, the corpus and a draft model (`rag_engine`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

from ..devices import Device, resolve_device
from ..drafters import NGramTrieDrafter, OuroborosDrafter, RESTDrafter
from ..drafters.ouroboros.int8 import int8_draft_model
from ..engine import SpeculativeEngine
from ..errors import InvalidArgumentError
from ..models.loading import load_model
from ..retrieval.corpus import CorpusIndex

# "auto": bf16 where the hardware computes in it, else fp32 (devices.default_dtype).
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

_engines: dict[tuple, SpeculativeEngine] = {}
_engines_lock = threading.Lock()


def shared_engine(
    model: str, *, dtype: str, device: Device, draft_budget: int | None,
    prompt_cache_dir: str | os.PathLike | None = None, prompt_cache_disk_bytes: int | None = None,
    quantization: str | None = None,
) -> SpeculativeEngine:  # fmt: skip
    """One engine per configuration and process: adapters built from the same name share the weights
    (and take turns on them). `device` as `devices.resolve_device` reads it (None: CUDA when
    available), so "cuda" and None name the same engine on a GPU machine; the prompt cache's disk
    tier as `SpeculativeEngine` takes it, `quantization` as `from_pretrained` does."""
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}", "dtype")
    resolved = resolve_device(device)
    # The folder as given (the engine checks it): two spellings of one folder make two engines sharing it.
    key = (model, dtype, str(resolved), draft_budget, None if prompt_cache_dir is None else str(prompt_cache_dir),
           repr(prompt_cache_disk_bytes), quantization)  # fmt: skip
    # Loading under the lock makes a concurrent second caller wait for this copy instead of loading another.
    with _engines_lock:
        if key not in _engines:
            _engines[key] = SpeculativeEngine.from_pretrained(
                model, dtype=DTYPES[dtype], device=resolved, draft_budget=draft_budget,
                prompt_cache_dir=prompt_cache_dir, prompt_cache_disk_bytes=prompt_cache_disk_bytes, quantization=quantization,
            )  # fmt: skip
        return _engines[key]


def rag_engine(
    engine: SpeculativeEngine,
    index: CorpusIndex | None,
    draft_model: str | None = None,
    progress: Callable[[str], None] | None = None,
    prompt_cache_bytes: int | None = None,
    prompt_cache_dir: str | os.PathLike | None = None,
    prompt_cache_disk_bytes: int | None = None,
    max_batch: int | None = None,
    draft_quantization: str | None = None,
) -> SpeculativeEngine:
    """`engine`'s model drafting in one tree from the retrieved chunks (trie), the whole corpus
    (REST, with an index) and, if named, a draft model (`draft_quantization` as `from_pretrained`
    takes it; by default int8 computing in int8 on a CPU); the prompt cache's options and
    `max_batch` as `SpeculativeEngine` takes them."""
    drafters = [NGramTrieDrafter()]
    if index is not None:
        index.check_tokenizer(engine.tokenizer, engine.name)
        drafters.append(RESTDrafter(index.datastore))
    if draft_model:
        model, tokenizer = load_model(draft_model, dtype=engine.model.dtype, device=engine.model.device, progress=progress,
                                      quantization=draft_quantization)  # fmt: skip
        if model.device.type == "cpu" and draft_quantization is None:
            # A draft's activations may be quantized too (one scale a forward): it only proposes.
            model = int8_draft_model(model)
        drafters.append(OuroborosDrafter(model, tokenizer))
    return SpeculativeEngine(engine.model, engine.tokenizer, drafters, name=engine.name, prompt_cache_bytes=prompt_cache_bytes,
                             prompt_cache_dir=prompt_cache_dir, prompt_cache_disk_bytes=prompt_cache_disk_bytes, max_batch=max_batch)  # fmt: skip
