"""The one engine each entrance holds: one per configuration and process (`shared_engine`), drafting
for RAG from the retrieved chunks (the trie), the whole corpus (REST, with an index) and, if named,
a draft model (`rag_drafters`), all given when the engine is built."""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..devices import Device, resolve_device
from ..drafters import Drafter, NGramTrieDrafter, OuroborosDrafter, RESTDrafter
from ..drafters.ouroboros.int8 import int8_draft_model
from ..engine import SpeculativeEngine
from ..errors import InvalidArgumentError
from ..models.loading import load_model, load_tokenizer
from ..retrieval.corpus import CorpusIndex

# "auto": bf16 where the hardware computes in it, else fp32 (devices.default_dtype).
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# What `shared_engine` passes on to the engine it builds; anything else is refused before a model loads.
ENGINE_OPTIONS = frozenset(inspect.signature(SpeculativeEngine.__init__).parameters) - {"self", "model", "tokenizer", "drafter", "name"}

_engines: dict[tuple, SpeculativeEngine] = {}
_engines_lock = threading.Lock()


def shared_engine(
    model: str, *, dtype: str = "auto", device: Device = None, quantization: str | None = None,
    index: CorpusIndex | None = None, draft_model: str | None = None, draft_quantization: str | None = None,
    progress: Callable[[str], None] | None = None, **options: Any,
) -> SpeculativeEngine:  # fmt: skip
    """One engine per configuration and process: entrances and adapters built with the same arguments
    share its weights, probes, cost curve, prompt cache and thread. `device` as
    `devices.resolve_device` reads it (None: CUDA when available), so "cuda" and None name the same
    engine on a GPU machine; `quantization` as `SpeculativeEngine.from_pretrained` takes it; `index`,
    `draft_model` and `draft_quantization` as `rag_drafters` takes them; `options` as
    `SpeculativeEngine` takes them (None: its default). An index of another tokenizer is refused
    before the weights load."""
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}", "dtype")
    unknown = sorted(set(options) - ENGINE_OPTIONS)
    if unknown:
        raise InvalidArgumentError(f"unknown engine option {unknown[0]!r}; the engine takes {', '.join(sorted(ENGINE_OPTIONS))}", unknown[0])
    resolved = resolve_device(device)
    options = {name: value for name, value in options.items() if value is not None}
    # A folder as given (the engine checks it): two spellings of one folder make two engines sharing it.
    key = (model, dtype, str(resolved), quantization, None if index is None else str(index.path), draft_model,
           draft_quantization, tuple(sorted((name, repr(os.fspath(value) if isinstance(value, os.PathLike) else value))
                                            for name, value in options.items())))  # fmt: skip
    # Loading under the lock makes a concurrent second caller wait for this copy instead of loading another.
    with _engines_lock:
        if key not in _engines:
            if index is not None:
                index.check_tokenizer(load_tokenizer(model, progress=progress), model)
            target, tokenizer = load_model(model, dtype=DTYPES[dtype], device=resolved, progress=progress, quantization=quantization)
            drafters = rag_drafters(target, tokenizer, index, draft_model, draft_quantization, progress)
            _engines[key] = SpeculativeEngine(target, tokenizer, drafters, name=model, **options)
        return _engines[key]


def rag_drafters(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, index: CorpusIndex | None = None,
    draft_model: str | None = None, draft_quantization: str | None = None, progress: Callable[[str], None] | None = None,
) -> list[Drafter]:  # fmt: skip
    """What drafts for `model` in one tree: the retrieved chunks (trie), the whole corpus of `index`
    (REST) and, if named, a draft model (`draft_quantization` as `from_pretrained` takes it; by
    default int8 computing in int8 on a CPU)."""
    drafters: list[Drafter] = [NGramTrieDrafter()]
    if index is not None:
        drafters.append(RESTDrafter(index.datastore))
    if draft_model:
        draft, draft_tokenizer = load_model(draft_model, dtype=model.dtype, device=model.device, progress=progress,
                                            quantization=draft_quantization)  # fmt: skip
        if draft.device.type == "cpu" and draft_quantization is None:
            # A draft's activations may be quantized too (one scale a forward): it only proposes.
            draft = int8_draft_model(draft)
        drafters.append(OuroborosDrafter(draft, draft_tokenizer))
    return drafters
