"""The speculative decoding engine: draft, verify in one forward, keep what the target agrees with.

Every generation runs on the engine's own thread (`thread.py`), whichever thread asked for it, and
the generations in flight run together there, a step at a time (`scheduler.py`): each step
verifies every sequence's draft in one forward of the model. `generate` waits for its generation,
`stream` reads its deltas as they come, `generate_batch` starts several at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cuda.graphs import CudaGraphs
from ..decoding.budget import CostModel
from ..decoding.output import eos_token_ids
from ..decoding.prompt_cache import PromptCache, kv_bytes_per_token
from ..decoding.request import Request
from ..decoding.result import Channel, GenerationResult, GenerationStream
from ..drafters import CombinedDrafter, Drafter, NGramTrieDrafter
from ..drafters.base import ForwardContext, Target
from ..errors import InvalidArgumentError, RagSpeculateError, check_int
from .costs import cost_curve
from .inputs import Document, Inputs, Prompt
from .runner import StaticLayout, make_runner
from .scheduler import Scheduler
from .thread import EngineThread
from .traits import ModelTraits, kernel_context

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


@dataclass(frozen=True)
class EngineStats:
    """`static_step`: verification in fixed shapes on a preallocated cache; `cuda_graphs`: the graphs
    captured of its shapes, holding `cuda_graph_bytes` of GPU memory."""

    static_step: bool
    cuda_graphs: int
    cuda_graph_bytes: int


class SpeculativeEngine:
    """Wraps a Hugging Face causal LM; output is token-identical to `model.generate` (greedy) or
    drawn from exactly the same distribution (sampling), only faster.

    `drafter`: one, or several drafting into one tree (None: the n-gram trie over the documents
    and the prompt). `fast_kernels`: forwards through the CPU kernels (`rag_speculate.cpu`: linear
    layers and attention, each row as if alone); None uses them where they work (fp32 and bf16 on
    CPU), True requires them, False keeps torch's; a draft model's forwards follow the same choice.
    `prompt_cache_bytes`: memory for the KV entries of prompts and answers seen before
    (`prompt_cache.py`), reused by later requests that begin with the same tokens; None makes
    room for some tens of thousands of tokens, 0 turns it off. `prompt_cache_dir`: a folder for
    its disk tier, shared by every process and replica that names it (created private to the
    user; refused if another user could change it), holding `prompt_cache_disk_bytes` (None: 8 GiB)
    of entries that survive restarts; None: memory only. `max_batch`: generations run
    together at most (1: one at a time); `kv_cache_bytes`: memory for the running generations'
    KV entries (a request that does not fit waits; None: room for `max_batch` sequences of 8,192
    tokens); `prefill_chunk`: prompt tokens a joining generation feeds per step while others decode.
    `cuda_graphs`: each shape of the verification step captured in a CUDA graph and replayed
    (`rag_speculate/cuda/graphs.py`); None: on where the model is on a CUDA GPU and its forward takes
    a batch's rows. They replay the fixed-shape step (`static_step`, `decoding/static.py`): the KV
    cache allocated once, `kv_cache_bytes` shared evenly among `max_batch` rows (a request that
    cannot fit a row is refused), every step padded to a few shapes; None: on where the graphs are,
    True runs it eagerly anywhere (on a CPU the growing cache is the faster one).
    A bad option raises InvalidArgumentError naming it, before the model is probed.
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, drafter: Drafter | Sequence[Drafter] | None = None,
        *, draft_budget: int | None = None, name: str | None = None, fast_kernels: bool | None = None,
        prompt_cache_bytes: int | None = None, prompt_cache_dir: str | os.PathLike | None = None,
        prompt_cache_disk_bytes: int | None = None, max_batch: int | None = None, kv_cache_bytes: int | None = None,
        prefill_chunk: int | None = None, cuda_graphs: bool | None = None, static_step: bool | None = None,
    ):  # fmt: skip
        self.draft_budget = _at_least(draft_budget, "draft_budget", 0, DEFAULT_DRAFT_BUDGET)
        max_batch = _at_least(max_batch, "max_batch", 1, DEFAULT_MAX_BATCH)
        prefill_chunk = _at_least(prefill_chunk, "prefill_chunk", 1, DEFAULT_PREFILL_CHUNK)
        _at_least(kv_cache_bytes, "kv_cache_bytes", 1, None)
        _check_static(model, cuda_graphs, static_step)
        self.drafter = _one_drafter(drafter)
        self.model, self.tokenizer = model.eval(), tokenizer
        # How users and tracing know this model: the name it was loaded by, else its config's.
        self.name = name or Path(str(model.config.name_or_path or type(model).__name__)).name
        self.traits = traits = ModelTraits.learn(model, fast_kernels)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self._inputs = Inputs(tokenizer, traits.vocab_size, traits.max_positions, self.name)
        self.drafter.attach(Target(tokenizer, traits.vocab_size, traits.device, _draft_context(fast_kernels)))
        self.prompt_cache = PromptCache.for_model(model, prompt_cache_bytes, folder=prompt_cache_dir, disk_bytes=prompt_cache_disk_bytes,
                                                  kernels=bool(traits.kernels), off=traits.prefixes.why_not)  # fmt: skip
        self.prompt_cache.warm_with(self._warm)
        self.max_batch = _batch_size(model, traits, max_batch)
        kv_tokens = _kv_tokens(model, traits, self.max_batch, kv_cache_bytes)
        # Fixed shapes on a preallocated cache where CUDA graphs replay them: a GPU's step costs its launches.
        layout, self._graphs = _static_step(traits, cuda_graphs, static_step, kv_tokens, self.max_batch, self.draft_budget)
        self._runner = make_runner(model, traits, self.prompt_cache, layout, self._graphs)
        # Forward cost by tokens fed, timed on first use (`_costs`: building stays cheap); assign one to pin it.
        self.cost_model: CostModel | None = None
        self._scheduler = Scheduler(
            self._runner, tokenizer=tokenizer, eos_token_ids=self.eos_token_ids, vocab_size=traits.vocab_size,
            drafter=self.drafter, draft_budget=self.draft_budget, costs=self._costs, max_batch=self.max_batch,
            kv_tokens=kv_tokens, prefill_chunk=prefill_chunk, device=traits.device,
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
        `prompt_cache_dir`, `prompt_cache_disk_bytes`, `max_batch`, `kv_cache_bytes`, `prefill_chunk`,
        `cuda_graphs`, `static_step`).

        `device=None` is CUDA when torch sees a GPU, else the CPU; `dtype=None` is bf16 on a GPU and
        on CPUs that compute in it, else fp32 (`devices.default_dtype`). `quantization`: "int8" (int8
        weights and activations, as llama.cpp's Q8_0) or "int4" (GGUF's Q4_K times int8 activations, as llama.cpp's
        Q4_K x Q8_K), or "gguf" to keep a GGUF file's own quantized tensors; on the CPU (`rag_speculate.quantization`). The answers are then exactly the
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

    def stats(self) -> EngineStats:
        """What the engine holds now, beside its prompt cache's `prompt_cache.stats()`."""
        graphs = self._graphs
        return EngineStats(static_step=self._runner.row_room() is not None, cuda_graphs=graphs.captured if graphs else 0,
                           cuda_graph_bytes=graphs.bytes if graphs else 0)  # fmt: skip

    @property
    def in_flight(self) -> int:
        """Generations started and not yet finished, running or waiting for room."""
        return self._scheduler.in_flight()

    def prepare(
        self,
        prompt: Prompt,
        *,
        documents: Sequence[Document] | None = None,
        max_new_tokens: int | Callable[[int], int] = 256,
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
        (text or token ids) feed the drafters only, never the prompt. `max_new_tokens` may be a
        function of the prompt's length in tokens (the room a context leaves, say). `temperature=0` is greedy;
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
            longest = self.max_batch * (self.draft_budget + 1)
            # Timed through the step that verifies, each step's curve its own: graphs cost a fraction of eager forwards.
            step = "cuda graphs" if self._graphs else "static" if self.stats().static_step else "growing"
            self.cost_model = cost_curve(self.model, self.traits, self._runner.timed, longest, step)
        return self.cost_model


def _at_least(value: int | None, name: str, least: int, default: int | None) -> int | None:
    """`value` checked as an integer of at least `least` (InvalidArgumentError naming `name`), or `default` for None."""
    return default if value is None else check_int(value, name, least)


def _batch_size(model: PreTrainedModel, traits: ModelTraits, max_batch: int) -> int:
    """`max_batch`, or 1 for a model whose forward takes one generation's rows at a time (said once)."""
    if not traits.rows and max_batch > 1:
        logger.info("%s runs one generation at a time: %s", type(model).__name__, traits.rows.why_not)
    return max_batch if traits.rows else 1


def _kv_tokens(model: PreTrainedModel, traits: ModelTraits, max_batch: int, kv_cache_bytes: int | None) -> int:
    """The KV entries the running generations may hold together: what `kv_cache_bytes` holds, else
    each row room for a long prompt and answer (as many as the model has positions, up to 8,192)."""
    if kv_cache_bytes is None:
        return max_batch * min(traits.max_positions or _DEFAULT_ROW_TOKENS, _DEFAULT_ROW_TOKENS)
    if kv_cache_bytes // kv_bytes_per_token(model) < 2:
        raise InvalidArgumentError(f"kv_cache_bytes={kv_cache_bytes} has no room for a request's KV entries", "kv_cache_bytes")
    return kv_cache_bytes // kv_bytes_per_token(model)


def _check_static(model: PreTrainedModel, cuda_graphs: bool | None, static_step: bool | None) -> None:
    """`cuda_graphs` and `static_step` each True, False or None, and graphs asked for only on a CUDA GPU."""
    for name, value in (("cuda_graphs", cuda_graphs), ("static_step", static_step)):
        if value is not None and not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be True, False or None, got {value!r}", name)
    device = next(model.parameters()).device
    if cuda_graphs and device.type != "cuda":
        raise InvalidArgumentError(f"cuda_graphs=True, but the model is on {device}: CUDA graphs run on a CUDA GPU only", "cuda_graphs")
    if cuda_graphs and static_step is False:
        raise InvalidArgumentError("cuda_graphs=True replays the fixed-shape step: it cannot run with static_step=False", "cuda_graphs")


def _static_step(
    traits: ModelTraits, cuda_graphs: bool | None, static_step: bool | None, kv_tokens: int, max_batch: int, draft_budget: int
) -> tuple[StaticLayout | None, CudaGraphs | None]:
    """The preallocated cache's layout where the step runs in fixed shapes (`kv_tokens` shared among
    `max_batch` rows, steps of up to `draft_budget` + 1 tokens a row), and the graphs that replay it,
    as the options ask (None: both where the model is on a CUDA GPU and its forward takes a batch's rows)."""
    for name, value in (("cuda_graphs", cuda_graphs), ("static_step", static_step)):
        if value and not traits.rows:
            raise InvalidArgumentError(f"{name}=True, but the model's forward cannot take a batch's rows: {traits.rows.why_not}", name)
    graphs = traits.device.type == "cuda" and bool(traits.rows) and static_step is not False if cuda_graphs is None else cuda_graphs
    static = graphs if static_step is None else static_step
    layout = StaticLayout.for_budget(kv_tokens, max_batch, draft_budget + 1) if static else None
    return layout, CudaGraphs(traits.device) if graphs else None


def _draft_context(fast_kernels: bool | None) -> Callable[[torch.nn.Module], ForwardContext]:
    """How a draft model's forwards run: through the kernels where they serve it, unless refused."""
    wanted = False if fast_kernels is False else None
    return lambda other: kernel_context(other, wanted)[0] or contextlib.nullcontext


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
