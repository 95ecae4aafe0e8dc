"""The speculative decoding engine: draft, verify in one forward, keep what the target agrees with.

Every generation runs on the engine's own thread (`thread.py`), whichever thread asked for it, and
the generations in flight run together there, a step at a time (`scheduler.py`): each step
verifies every sequence's draft in one forward of the model. `generate` waits for its generation,
`stream` reads its deltas as they come, `generate_batch` starts several at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cpu import forward_context, kernel_functions
from ..decoding.batch import BatchForward, unsupported
from ..decoding.budget import CostModel
from ..decoding.forward import TreeForward
from ..decoding.lean_forward import Kernels, lean_forward
from ..decoding.output import eos_token_ids
from ..decoding.prompt_cache import PromptCache, kv_bytes_per_token
from ..decoding.request import Request
from ..decoding.result import Channel, GenerationResult, GenerationStream
from ..devices import cpu_flags
from ..drafters import CombinedDrafter, Drafter, NGramTrieDrafter
from ..drafters.base import ForwardContext, Target
from ..errors import InvalidArgumentError, RagSpeculateError, check_int
from ..files.cache import cache_dir
from .inputs import Document, Inputs, Prompt
from .runner import BatchRunner, SequentialRunner
from .scheduler import Scheduler
from .thread import EngineThread

logger = logging.getLogger(__name__)

# The most draft nodes one forward may verify per sequence; each step verifies only the best-first
# prefix of each draft that pays for its measured cost (budget.py). On a CPU a forward's cost grows
# with every token fed, so more than 16 rarely pays; on a GPU a larger budget costs little more.
DEFAULT_DRAFT_BUDGET = 16
# Generations run together at most, by default: room for a server's clients while drafts shrink as rows are added.
DEFAULT_MAX_BATCH = 8
# Prompt tokens a joining sequence feeds per step while others decode: their steps wait at most this long.
DEFAULT_PREFILL_CHUNK = 128
# KV entries the running sequences may hold together, by default: each row room for this many tokens.
_DEFAULT_ROW_TOKENS = 8192
# Bumped when how the cost curve is measured changes, so curves saved before are timed again.
_COSTS_VERSION = 1


def kernel_context(model: PreTrainedModel, wanted: bool | None = None) -> ForwardContext | None:
    """The CPU kernels' mode for `model`'s forwards, or None for torch's own kernels (`wanted`: True
    requires them, False refuses them, None takes them where they work). The kernel modules load
    only here, for a model on the CPU."""
    return None if wanted is False else forward_context(model, required=bool(wanted))


class SpeculativeEngine:
    """Wraps a Hugging Face causal LM; output is token-identical to `model.generate` (greedy) or
    drawn from exactly the same distribution (sampling), only faster."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        drafter: Drafter | Sequence[Drafter] | None = None,
        *,
        draft_budget: int | None = None,
        name: str | None = None,
        fast_kernels: bool | None = None,
        prompt_cache_bytes: int | None = None,
        prompt_cache_dir: str | os.PathLike | None = None,
        prompt_cache_disk_bytes: int | None = None,
        max_batch: int | None = None,
        kv_cache_bytes: int | None = None,
        prefill_chunk: int | None = None,
    ):
        """`fast_kernels`: forwards through the CPU kernels (`rag_speculate.cpu`: linear layers and
        attention, each row as if alone); None uses them where they work (fp32 and bf16 on CPU),
        True requires them, False keeps torch's; a draft model's forwards follow the same choice.
        `prompt_cache_bytes`: memory for the KV entries of prompts and answers seen before
        (`prompt_cache.py`), reused by later requests that begin with the same tokens; None makes
        room for some tens of thousands of tokens, 0 turns it off. `prompt_cache_dir`: a folder for
        its disk tier, shared by every process and replica that names it (created private to the
        user; refused if another user could change it), holding `prompt_cache_disk_bytes` (None: 8 GiB)
        of entries that survive restarts; None: memory only. `max_batch`: generations run
        together at most (1: one at a time); `kv_cache_bytes`: memory for the running generations'
        KV entries (a request that does not fit waits; None: room for `max_batch` sequences of 8,192
        tokens); `prefill_chunk`: prompt tokens a joining generation feeds per step while others decode."""
        if draft_budget is not None and (not isinstance(draft_budget, int) or isinstance(draft_budget, bool) or draft_budget < 0):
            raise InvalidArgumentError(f"draft_budget must be >= 0 (0 disables drafting), got {draft_budget!r}", "draft_budget")
        self.draft_budget = DEFAULT_DRAFT_BUDGET if draft_budget is None else draft_budget
        max_batch = DEFAULT_MAX_BATCH if max_batch is None else check_int(max_batch, "max_batch", 1)
        prefill_chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else check_int(prefill_chunk, "prefill_chunk", 1)
        if kv_cache_bytes is not None:
            check_int(kv_cache_bytes, "kv_cache_bytes", 1)
        self.model = model.eval()
        self.tokenizer = tokenizer
        # How users and tracing know this model: the name it was loaded by, else its config's.
        self.name = name or Path(str(model.config.name_or_path or type(model).__name__)).name
        self.drafter = _one_drafter(drafter)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self._inputs = Inputs(tokenizer, self.vocab_size, self.max_positions, self.name)
        context = kernel_context(model, fast_kernels)
        self.fast_kernels = context is not None
        # The model's own forward, or its lean forward where that gives the same logits bit for bit
        # (calling the kernels itself, outside their mode); why not, "" when it does.
        lean, self.lean_forward_skipped = lean_forward(
            model, Kernels(*kernel_functions()) if context else Kernels(), exact=True, context=context or contextlib.nullcontext
        )  # fmt: skip
        forwards = {"forward": lean, "context": contextlib.nullcontext} if lean else {"context": context or contextlib.nullcontext}
        # The forward that prefills and verifies one generation at a time (benchmarks time it).
        self.forward = TreeForward(model, **forwards)
        # A draft model's forwards go through the kernels where they serve it, unless they are refused.
        draft_kernels = False if fast_kernels is False else None
        drafts_with: Callable[[torch.nn.Module], ForwardContext] = (
            lambda other: kernel_context(other, draft_kernels) or contextlib.nullcontext
        )
        self.drafter.attach(Target(tokenizer, self.vocab_size, model.device, drafts_with))
        self.tree_attention, reason = self.forward.supports_tree_attention()
        if not self.tree_attention:
            warnings.warn(
                f"{type(model).__name__} cannot verify a draft tree with a custom 4D attention mask ({reason}); "
                "falling back to verifying only the longest draft branch per forward",
                RuntimeWarning,
                stacklevel=2,
            )
        interacting = _rows_interact(model)
        if interacting:
            warnings.warn(
                f"{interacting}, so a verification or batched forward can round a row otherwise than generate's "
                "one-token step: outputs can leave generate's. Load it with llm_int8_threshold=0.0 for exact ones",
                RuntimeWarning,
                stacklevel=2,
            )
        self.prompt_cache = PromptCache.for_model(model, prompt_cache_bytes, folder=prompt_cache_dir,
                                                  disk_bytes=prompt_cache_disk_bytes, kernels=self.fast_kernels)  # fmt: skip
        self.prompt_cache.warm_with(self._warm)
        batched = BatchForward(model, **forwards)
        # Why generations run one at a time here ("" when they run together).
        self.batching_unsupported = unsupported(model) or ("" if self.tree_attention else "it verifies chains only")
        if not self.batching_unsupported:
            self.batching_unsupported = batched.rows_unsupported(self.forward)
        if self.batching_unsupported:
            if max_batch > 1:
                logger.info("%s runs one generation at a time: %s", type(model).__name__, self.batching_unsupported)
            max_batch = 1
            runner: BatchRunner | SequentialRunner = SequentialRunner(model, self.forward, self.prompt_cache, self.tree_attention)
        else:
            runner = BatchRunner(model, batched, self.prompt_cache)
        self.max_batch = max_batch
        row_tokens = min(self.max_positions or _DEFAULT_ROW_TOKENS, _DEFAULT_ROW_TOKENS)
        kv_tokens = (kv_cache_bytes // kv_bytes_per_token(model)) if kv_cache_bytes is not None else max_batch * row_tokens
        if kv_tokens < 2:
            raise InvalidArgumentError(f"kv_cache_bytes={kv_cache_bytes} has no room for a request's KV entries", "kv_cache_bytes")
        # Forward cost by tokens fed, loaded or timed on first use (building an engine should stay
        # cheap); assign one to skip the timing or to pin the curve.
        self.cost_model: CostModel | None = None
        self._scheduler = Scheduler(
            runner, tokenizer=tokenizer, eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size,
            drafter=self.drafter, draft_budget=self.draft_budget, costs=self._costs, max_batch=max_batch,
            kv_tokens=kv_tokens, prefill_chunk=prefill_chunk, device=model.device,
        )  # fmt: skip
        self._thread = EngineThread(f"rag-speculate-{self.name}", self._scheduler.step, self._scheduler.fail_all)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        drafter: Drafter | Sequence[Drafter] | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | int | torch.device | None = None,
        progress: Callable[[str], None] | None = None,
        quantization: str | None = None,
        **options: Any,
    ) -> SpeculativeEngine:
        """From a packaged model name, a `.gguf` file, a local folder or a Hugging Face model id;
        `options` as the constructor takes them (`draft_budget`, `fast_kernels`, `prompt_cache_bytes`,
        `prompt_cache_dir`, `prompt_cache_disk_bytes`, `max_batch`, `kv_cache_bytes`, `prefill_chunk`).

        `device=None` is CUDA when torch sees a GPU, else the CPU; `dtype=None` is bf16 on a GPU and
        on CPUs that compute in it, else fp32 (`devices.default_dtype`). `quantization`: "int8" (int8
        weights and activations, as llama.cpp's Q8_0) or "int4" (activations in `dtype`), or "gguf" to keep a GGUF file's own quantized
        tensors; on the CPU (`rag_speculate.quantization`). The answers are then exactly the
        quantized model's own.
        """
        from ..models.loading import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device, progress=progress, quantization=quantization)
        return cls(model, tokenizer, drafter, name=options.pop("name", name_or_path), **options)

    def generate(self, prompt: Prompt, **options: Any) -> GenerationResult:
        """Generate a completion (on the engine's thread, beside any other in flight; this one
        waits). Options as in `prepare`."""
        return self.stream(prompt, **options).collect()

    def generate_batch(self, prompts: Sequence[Prompt], **options: Any) -> list[GenerationResult]:
        """Generate a completion for each prompt, all running together; options as in `prepare`,
        the same for every prompt. Every one is checked before any starts."""
        requests = [self.prepare(prompt, **options) for prompt in prompts]
        return [stream.collect() for stream in [self.stream_request(r) for r in requests]]

    def stream(self, prompt: Prompt, **options: Any) -> GenerationStream:
        """Text deltas as tokens are accepted; the stream's `result` holds the GenerationResult.
        Options as in `prepare`, every one checked now rather than at the first delta.

        The generation runs to its end unless the stream is closed (or dropped): a caller that stops
        reading never holds the engine, whatever thread comes next.
        """
        return self.stream_request(self.prepare(prompt, **options))

    def stream_request(self, request: Request) -> GenerationStream:
        """`stream` for a request `prepare` has checked: a server checks a request when it arrives
        and starts it when the engine has room."""
        if self._thread.is_current():
            raise RagSpeculateError("a generation cannot start another on the same engine and wait for it")
        channel = Channel()
        self._scheduler.submit(request, channel)
        self._thread.wake()
        return GenerationStream(channel)

    @property
    def in_flight(self) -> int:
        """Generations started and not yet finished, running or waiting for room."""
        return self._scheduler.in_flight()

    def prepare(
        self,
        prompt: Prompt,
        *,
        documents: Sequence[Document] | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        chat: bool = False,
        tools: Sequence[dict] | None = None,
    ) -> Request:
        """A generation's arguments, checked and tokenized; a bad one raises `InvalidArgumentError`
        naming it (`.argument`).

        `prompt` is text, token ids, or (with `chat=True`) a list of {"role", "content"} messages
        (roles system, user, assistant, tool; the last turn a user's or a tool's); `documents`
        (text or token ids) feed the drafters only, never the prompt. `temperature=0` is greedy;
        `seed` makes sampling repeatable. `tools` (OpenAI function format, with `chat=True`) reach the
        chat template; their schemas and the tool results in the history also feed the drafters, since
        a call's arguments and an answer over tool results copy from them.
        """
        return self._inputs.request(
            prompt, documents=documents, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, stop=stop, seed=seed, chat=chat, tools=tools,
        )  # fmt: skip

    def encode_prompt(self, prompt: Prompt, *, chat: bool = False, tools: Sequence[dict] | None = None) -> list[int]:
        """The token ids `generate` would use for this prompt (and these tools, with `chat=True`)."""
        return self._inputs.prompt_ids(prompt, chat=chat, tools=tools)

    def _warm(self, prompts: Sequence[Prompt], options: dict[str, Any]) -> int:
        """`prompt_cache.warm`: each prompt run for one new token, all together, so its entries land in
        the cache; a list of messages is a chat unless `chat` says otherwise. The prompt tokens prefilled."""
        chat = options.pop("chat", None)
        options["max_new_tokens"] = 1
        requests = [self.prepare(p, chat=_is_chat(p) if chat is None else chat, **options) for p in prompts]
        results = [stream.collect() for stream in [self.stream_request(r) for r in requests]]
        return sum(r.stats.prompt_tokens - r.stats.cached_prompt_tokens for r in results)

    def _costs(self) -> CostModel:
        """The target's forward cost by tokens fed: assigned, saved for this model and machine, or timed now."""
        if self.cost_model is None:
            path = _costs_path(self)
            self.cost_model = CostModel.load(path)
            if self.cost_model is None:
                longest = self.max_batch * (self.draft_budget + 1)
                self.cost_model = CostModel.measure(self.forward.timed(self.tree_attention), longest)
                try:
                    self.cost_model.save(path)
                except OSError as error:  # a read-only cache costs a timing per engine, nothing more
                    logger.info("cannot save the cost curve at %s: %s", path, error)
        return self.cost_model


def _rows_interact(model: PreTrainedModel) -> str:
    """Why a row of `model`'s forward depends on the rows beside it ("" where none is known)."""
    config = getattr(model.config, "quantization_config", None)
    read = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    if config is not None and read("load_in_8bit", False) and (read("llm_int8_threshold", 6.0) or 0.0) > 0:
        return (f"bitsandbytes' LLM.int8 (llm_int8_threshold={read('llm_int8_threshold', 6.0)}) keeps a column in "
                "16 bits when any row of the forward exceeds the threshold there")  # fmt: skip
    return ""


def _one_drafter(drafter: Drafter | Sequence[Drafter] | None) -> Drafter:
    """The n-gram trie by default; several drafters compete in one tree."""
    if drafter is None:
        return NGramTrieDrafter()
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, Sequence) and not isinstance(drafter, str):
        return drafter[0] if len(drafter) == 1 and isinstance(drafter[0], Drafter) else CombinedDrafter(drafter)
    raise InvalidArgumentError(f"drafter must be a Drafter or a list of them, got {type(drafter).__name__}")


def _is_chat(prompt: Prompt) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and isinstance(prompt[0], dict)


def _linear_kinds(model: torch.nn.Module) -> list[str]:
    """What computes the model's linear layers: plain weights by dtype, a tensor subclass by name,
    layers of their own (quantized ones) by their description; a layer's cost depends on it."""
    kinds = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            kinds.add(f"{type(module.weight).__name__} {module.weight.dtype}")
        elif getattr(module, "rows_alone", False):
            kinds.add(f"{type(module).__name__} {module.extra_repr()}")
    return sorted(kinds)


def _costs_path(engine: SpeculativeEngine) -> Path:
    """Where this model's cost curve on this machine is kept: keyed by what its forward's cost
    depends on (the model's shapes, dtype and device, its linear layers' kinds, the kernels, the
    CPU, torch, the threads)."""
    config = engine.model.config.to_dict()
    shape = {key: config.get(key) for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads", "vocab_size")}  # fmt: skip
    parameter = next(engine.model.parameters())
    identity = {
        "version": _COSTS_VERSION, "shape": shape, "dtype": str(parameter.dtype), "device": parameter.device.type,
        "linear": _linear_kinds(engine.model),
        "kernels": engine.fast_kernels, "tree": engine.tree_attention, "longest": engine.max_batch * (engine.draft_budget + 1),
        "cpu": platform.processor() or platform.machine(), "flags": sorted(cpu_flags()), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(parameter.device) if parameter.device.type == "cuda" else None,
    }  # fmt: skip
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "costs" / f"{digest}.json"
