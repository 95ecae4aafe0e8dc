"""The speculative decoding engine: draft, verify in one forward, keep what the target agrees with.

The whole decode loop is `_run`; everything it calls is small and lives beside it. Every generation
runs on the engine's own thread (`thread.py`), whichever thread called: `generate` waits for it,
`stream` reads its deltas as they come.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cpu import forward_context
from ..decoding.budget import CostModel, best_prefix
from ..decoding.forward import TreeForward
from ..decoding.kv_cache import make_cache, sliding_window
from ..decoding.output import OutputTracker, eos_token_ids
from ..decoding.prompt_cache import PromptCache
from ..decoding.request import Request
from ..decoding.result import Channel, GenerationResult, GenerationStats, GenerationStream
from ..decoding.sampling import sample_token
from ..decoding.tree import DraftTree
from ..decoding.verify import verify
from ..drafters import CombinedDrafter, DraftContext, Drafter, NGramTrieDrafter
from ..drafters.base import ForwardContext, Target
from ..errors import InvalidArgumentError, RagSpeculateError
from .inputs import Document, Inputs, Prompt
from .thread import EngineThread

# The most draft nodes one forward may verify; each step verifies only the best-first prefix of
# the draft that pays for its measured cost (budget.py). On a CPU a forward's cost grows with every
# token fed, so more than 16 rarely pays; on a GPU a larger budget costs little more.
DEFAULT_DRAFT_BUDGET = 16


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
    ):
        """`fast_kernels`: decoding and verification forwards through faster CPU kernels
        (`rag_speculate.cpu`: linear layers, and bf16 attention); None uses them where they work
        (fp32 on CPU, bf16 with AVX512-BF16), True requires them, False keeps torch's; a draft
        model's forwards follow the same choice. `prompt_cache_bytes`: memory for the KV entries of
        prompts and answers seen before (`prompt_cache.py`), reused by later requests that begin
        with the same tokens; None makes room for some tens of thousands of tokens, 0 turns it off."""
        if draft_budget is not None and (not isinstance(draft_budget, int) or isinstance(draft_budget, bool) or draft_budget < 0):
            raise InvalidArgumentError(f"draft_budget must be >= 0 (0 disables drafting) and an integer, got {draft_budget!r}", "draft_budget")
        self.model = model.eval()
        self.tokenizer = tokenizer
        # How users and tracing know this model: the name it was loaded by, else its config's.
        self.name = name or Path(str(model.config.name_or_path or type(model).__name__)).name
        self.drafter = _one_drafter(drafter)
        self.draft_budget = DEFAULT_DRAFT_BUDGET if draft_budget is None else draft_budget
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self._inputs = Inputs(tokenizer, self.vocab_size, self.max_positions, self.name)
        context = kernel_context(model, fast_kernels)
        self.fast_kernels = context is not None
        self._forward = TreeForward(model, context=context or contextlib.nullcontext)
        # A draft model's forwards go through the kernels where they serve it, unless they are refused.
        draft_kernels = False if fast_kernels is False else None
        drafts_with: Callable[[torch.nn.Module], ForwardContext] = (
            lambda other: kernel_context(other, draft_kernels) or contextlib.nullcontext
        )
        self.drafter.attach(Target(tokenizer, self.vocab_size, model.device, drafts_with))
        self.tree_attention, reason = self._forward.supports_tree_attention()
        if not self.tree_attention:
            warnings.warn(
                f"{type(model).__name__} cannot verify a draft tree with a custom 4D attention mask ({reason}); "
                "falling back to verifying only the longest draft branch per forward",
                RuntimeWarning,
                stacklevel=2,
            )
        self.prompt_cache = PromptCache.for_model(model, prompt_cache_bytes)
        # Forward cost by tokens fed, timed on first use (building an engine should stay cheap);
        # assign one to skip the timing or to pin the curve.
        self.cost_model: CostModel | None = None
        # One generation at a time, all on one thread: the model's forward and the drafter's state
        # are not shared-safe, and one thread keeps one team of CPU threads busy (`thread.py`).
        self._thread = EngineThread(f"rag-speculate-{self.name}")

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        drafter: Drafter | Sequence[Drafter] | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | int | torch.device | None = None,
        progress: Callable[[str], None] | None = None,
        **options: Any,
    ) -> SpeculativeEngine:
        """From a packaged model name, a `.gguf` file, a local folder or a Hugging Face model id;
        `options` as the constructor takes them (`draft_budget`, `fast_kernels`, `prompt_cache_bytes`).

        `device=None` is CUDA when torch sees a GPU, else the CPU; `dtype=None` is bf16 on a GPU and
        on CPUs that compute in it, else fp32 (`devices.default_dtype`).
        """
        from ..models.loading import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device, progress=progress)
        return cls(model, tokenizer, drafter, name=options.pop("name", name_or_path), **options)

    def generate(self, prompt: Prompt, **options: Any) -> GenerationResult:
        """Generate a completion (on the engine's thread; this one waits). Options as in `prepare`."""
        return self.stream(prompt, **options).collect()

    def stream(self, prompt: Prompt, **options: Any) -> GenerationStream:
        """Text deltas as tokens are accepted; the stream's `result` holds the GenerationResult.
        Options as in `prepare`, every one checked now rather than at the first delta.

        The generation runs to its end unless the stream is closed (or dropped): a caller that stops
        reading never holds the engine, whatever thread comes next.
        """
        return self.stream_request(self.prepare(prompt, **options))

    def stream_request(self, request: Request) -> GenerationStream:
        """`stream` for a request `prepare` has checked: a server checks a request when it arrives
        and starts it when the engine is free."""
        if self._thread.is_current():
            raise RagSpeculateError("a generation cannot start another on the same engine and wait for it")
        channel = Channel()
        self._thread.submit(lambda: _run_into(self._run(request, channel.cancelled), channel))
        return GenerationStream(channel)

    @property
    def in_flight(self) -> int:
        """Generations started and not yet finished, running or waiting for the engine."""
        return self._thread.pending

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

    def _run(self, request: Request, cancelled: threading.Event) -> Generator[str, None, GenerationResult]:
        stats = GenerationStats(prompt_tokens=len(request.prompt_ids))
        started = time.perf_counter()
        params, generator = request.sampling, self._generator(request.seed)
        output = OutputTracker(self.tokenizer, self.eos_token_ids, request.stop, request.max_new_tokens)

        cache = make_cache(self.model)
        # At least the prompt's last token is fed: its logits give the first new token.
        reused = self.prompt_cache.load(self.model, request.prompt_ids[:-1], cache)
        stats.cached_prompt_tokens = reused
        tree_mode = self._tree_mode(cache, request)
        costs = self._cost_model(tree_mode)
        setup_started = time.perf_counter()
        self.drafter.start(DraftContext(request.prompt_ids, request.document_ids, self.vocab_size, costs))
        stats.draft_setup_s = time.perf_counter() - setup_started

        prefill_started = time.perf_counter()
        first = sample_token(self._forward.prefill(cache, request.prompt_ids[reused:]), params, generator)
        stats.prefill_s = time.perf_counter() - prefill_started
        stats.target_forwards = 1
        stats.time_to_first_token_s = time.perf_counter() - started
        tokens = [*request.prompt_ids, first]
        output.extend([first])
        stats.verification = "tree" if tree_mode else "chain"
        yield output.delta()

        decode_started = time.perf_counter()
        # A closed stream stops at the next step, which frees the engine for the next caller.
        while not output.done and not cancelled.is_set():
            draft_started = time.perf_counter()
            # A draft longer than the tokens left could only be cut: don't pay to draft it.
            budget = min(self.draft_budget, request.max_new_tokens - len(output.token_ids) - 1)
            # Best first, so every prefix is a tree and the budget keeps the likeliest nodes.
            tree = self._checked(self.drafter.propose(tokens, budget)).best_first().truncated(budget)
            if tree.scores:
                tree = tree.truncated(best_prefix(tree.scores, costs))
            stats.drafting_s += time.perf_counter() - draft_started

            forward_started = time.perf_counter()
            verification = verify(self._forward, cache, tokens[-1], tree, params, generator, tree_mode)
            fed = len(verification.tree) + 1
            costs.observe(fed, time.perf_counter() - forward_started)
            stats.target_forwards += 1
            stats.forward_sizes[fed] += 1

            draft_started = time.perf_counter()
            self.drafter.observe(verification)
            stats.drafting_s += time.perf_counter() - draft_started

            taken = output.extend(verification.accepted_tokens)
            tokens.extend(verification.accepted_tokens[:taken])
            _count_sources(stats, verification.tree, verification.accepted_nodes[:taken], self.drafter.name)
            delta = output.delta()
            if delta:
                yield delta
        stats.decode_s = time.perf_counter() - decode_started
        stats.new_tokens = len(output.token_ids)
        # Only now, with every entry computed: the cache holds the tokens' entries in order
        # (and, where a stop string cut an accepted draft short, a few more).
        self.prompt_cache.insert(self.model, tokens[: cache.get_seq_length()], cache)
        delta = output.delta()
        if delta:
            yield delta
        return GenerationResult(output.text, output.token_ids, output.finish_reason or "cancelled", stats)

    # --- helpers of the decode loop -------------------------------------------------------

    def _generator(self, seed: int | None) -> torch.Generator:
        generator = torch.Generator(device=self.model.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        return generator

    def _cost_model(self, tree_mode: bool) -> CostModel:
        if self.cost_model is None:
            self.cost_model = CostModel.measure(self._forward.timed(tree_mode), self.draft_budget + 1)
        return self.cost_model

    def _tree_mode(self, cache, request: Request) -> bool:
        """Tree verification, unless the model cannot, or a sliding window would outgrow its past."""
        window = sliding_window(cache)
        longest = len(request.prompt_ids) + request.max_new_tokens + self.draft_budget
        return self.tree_attention and (window is None or longest < window)

    def _checked(self, tree: DraftTree) -> DraftTree:
        if tree.tokens and not 0 <= min(tree.tokens) <= max(tree.tokens) < self.vocab_size:
            raise RagSpeculateError(f"drafter {self.drafter.name!r} proposed a token outside [0, {self.vocab_size})")
        return tree


def _one_drafter(drafter: Drafter | Sequence[Drafter] | None) -> Drafter:
    """The n-gram trie by default; several drafters compete in one tree."""
    if drafter is None:
        return NGramTrieDrafter()
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, Sequence) and not isinstance(drafter, str):
        return drafter[0] if len(drafter) == 1 and isinstance(drafter[0], Drafter) else CombinedDrafter(drafter)
    raise InvalidArgumentError(f"drafter must be a Drafter or a list of them, got {type(drafter).__name__}")


def _count_sources(stats: GenerationStats, tree: DraftTree, accepted: list[int], default: str) -> None:
    for i in range(len(tree)):
        stats.drafted_tokens[tree.source(i) or default] += 1
    for i in accepted:
        stats.accepted_tokens[tree.source(i) or default] += 1


def _run_into(steps: Generator[str, None, GenerationResult], channel: Channel) -> None:
    """Run a generation's steps, handing each delta, then the result or the error, to its stream."""
    try:
        while True:
            channel.delta(next(steps))
    except StopIteration as finished:
        channel.finish(finished.value)
    except BaseException as error:  # noqa: BLE001 - handed to the reader, who raises it
        channel.fail(error)
