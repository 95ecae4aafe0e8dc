"""The speculative decoding engine: draft, verify in one forward, keep what the target agrees with.

The whole decode loop is `_run`; everything it calls is small and lives beside it.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .budget import CostModel, best_prefix
from ..drafters import CombinedDrafter, DraftContext, Drafter, NGramTrieDrafter
from ..errors import InvalidArgumentError, RagSpeculateError
from .output import OutputTracker, eos_token_ids
from .result import GenerationResult, GenerationStats, GenerationStream, run_to_end
from .request import Request, check_int, check_messages, check_not_bytes, check_seed, check_text, sampling_params, stop_strings
from .sampling import sample_token
from .tool_calls import check_tools, tool_documents
from .tree import DraftTree
from .forward import TreeForward, kernel_context
from .kv_cache import make_cache, sliding_window
from .prompt_cache import PromptCache
from .verify import verify

Prompt = str | Sequence[int] | Sequence[dict]
Document = str | Sequence[int]

# The most draft nodes one forward may verify; each step verifies only the best-first prefix of
# the draft that pays for its measured cost (budget.py). On a CPU a forward's cost grows with every
# token fed, so more than 16 rarely pays; on a GPU a larger budget costs little more.
DEFAULT_DRAFT_BUDGET = 16
_DOCUMENT_CACHE_SIZE = 1024


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
        (fp32 on CPU, bf16 with AVX512-BF16), True requires them, False keeps torch's.
        `prompt_cache_bytes`: memory for the KV entries of prompts and answers seen before
        (`prompt_cache.py`), reused by later requests that begin with the same tokens; None makes
        room for some tens of thousands of tokens, 0 turns it off."""
        if draft_budget is not None and draft_budget < 0:
            raise InvalidArgumentError(f"draft_budget must be >= 0 (0 disables drafting), got {draft_budget}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        # How users and tracing know this model: the name it was loaded by, else its config's.
        self.name = name or Path(str(model.config.name_or_path or type(model).__name__)).name
        self.drafter = _one_drafter(drafter)
        self.draft_budget = DEFAULT_DRAFT_BUDGET if draft_budget is None else draft_budget
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.drafter.attach(tokenizer, self.vocab_size, model.device)
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        context = kernel_context(model, fast_kernels)
        self.fast_kernels = context is not None
        self._forward = TreeForward(model, context=context or contextlib.nullcontext)
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
        # One generation at a time: the model's forward and the drafter's state are not shared-safe.
        self._lock = threading.Lock()
        # Callers validate and tokenize before taking the generation lock, so the cache has its own.
        self._documents_lock = threading.Lock()
        self._documents: OrderedDict[str, list[int]] = OrderedDict()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype: torch.dtype | None = None,
        device: str | int | torch.device | None = None,
        drafter: Drafter | Sequence[Drafter] | None = None,
        draft_budget: int | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> SpeculativeEngine:
        """From a packaged model name, a `.gguf` file, a local folder or a Hugging Face model id.

        `device=None` is CUDA when torch sees a GPU, else the CPU; `dtype=None` is bf16 on a GPU and
        on CPUs that compute in it, else fp32 (`models.loading.default_dtype`).
        """
        from ..models.loading import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device, progress=progress)
        return cls(model, tokenizer, drafter, draft_budget=draft_budget, name=name_or_path)

    def generate(self, prompt: Prompt, **options: Any) -> GenerationResult:
        """Generate a completion, on the calling thread. Options as in `prepare`."""
        return run_to_end(self._run(self.prepare(prompt, **options)))

    def stream(self, prompt: Prompt, **options: Any) -> GenerationStream:
        """Text deltas as tokens are accepted; the stream's `result` holds the GenerationResult.
        Options as in `prepare`, every one checked now rather than at the first delta.

        The generation runs on a worker thread to its end unless the stream is closed (or dropped):
        a caller that stops reading never holds the engine, whatever thread comes next.
        """
        return self.stream_request(self.prepare(prompt, **options))

    def stream_request(self, request: Request) -> GenerationStream:
        """`stream` for a request `prepare` has checked: a server checks a request when it arrives
        and starts it when the engine is free."""
        return GenerationStream(lambda cancelled: self._run(request, cancelled))

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
        """A generation's arguments, checked and tokenized; a bad one raises `InvalidArgumentError` naming it.

        `prompt` is text, token ids, or (with `chat=True`) a list of {"role", "content"} messages
        (roles system, user, assistant, tool; the last turn a user's or a tool's); `documents`
        (text or token ids) feed the drafters only, never the prompt. `temperature=0` is greedy;
        `seed` makes sampling repeatable. `tools` (OpenAI function format, with `chat=True`) reach the
        chat template; their schemas and the tool results in the history also feed the drafters, since
        a call's arguments and an answer over tool results copy from them (`tool_calls.parse_tool_calls`
        reads the calls back out of the answer).
        """
        request = Request(
            prompt_ids=self.encode_prompt(prompt, chat=chat, tools=tools),
            document_ids=self._document_ids(documents) + self._document_ids(self._tool_documents(prompt, tools, chat)),
            max_new_tokens=check_int(max_new_tokens, "max_new_tokens", 1),
            sampling=sampling_params(temperature, top_p, top_k),
            stop=stop_strings(stop),
            seed=check_seed(seed),
        )
        self._check_lengths(request)
        return request

    def _run(self, request: Request, cancelled: threading.Event | None = None) -> Generator[str, None, GenerationResult]:
        with self._lock:
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
            while not output.done and not (cancelled is not None and cancelled.is_set()):
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

    # --- turning user input into token ids -------------------------------------------------

    def encode_prompt(self, prompt: Prompt, *, chat: bool = False, tools: Sequence[dict] | None = None) -> list[int]:
        """The token ids `generate` would use for this prompt (and these tools, with `chat=True`)."""
        check_not_bytes(prompt, "prompt")
        if tools is not None and not chat:
            raise InvalidArgumentError("tools= reach the model through its chat template: they need chat=True")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgumentError("prompt is empty")
            check_text(prompt, "prompt")
            if chat:
                return self._chat_ids([{"role": "user", "content": prompt}], tools)
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, Sequence) or not prompt:
            raise InvalidArgumentError("prompt must be a non-empty string, list of token ids or list of chat messages")
        if all(isinstance(m, dict) for m in prompt):
            if not chat:
                raise InvalidArgumentError("a list of chat messages as prompt needs chat=True")
            return self._chat_ids(list(prompt), tools)
        return self._token_ids(prompt, "prompt")

    def _chat_ids(self, messages: list[dict], tools: Sequence[dict] | None = None) -> list[int]:
        check_messages(messages)
        if tools is not None and "tools" not in (self.tokenizer.chat_template or ""):
            raise InvalidArgumentError(f"{self.name}'s chat template takes no tools: pick a model whose template renders them")
        extra = {"tools": check_tools(tools)} if tools is not None else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return self.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def _tool_documents(prompt: Prompt, tools: Sequence[dict] | None, chat: bool) -> list[str]:
        messages = prompt if chat and isinstance(prompt, Sequence) and not isinstance(prompt, str) else []
        return tool_documents(tools, [m for m in messages if isinstance(m, dict)])

    def _token_ids(self, ids: Sequence[Any], what: str) -> list[int]:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidArgumentError(f"{what} must be a string or a list of int token ids")
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise InvalidArgumentError(f"{what} has token ids outside the vocabulary range [0, {self.vocab_size})")
        return list(ids)

    def _document_ids(self, documents: Sequence[Document] | None) -> list[list[int]]:
        if documents is None:
            return []
        if isinstance(documents, (str, bytes, bytearray)) or not isinstance(documents, Sequence):
            raise InvalidArgumentError("documents must be a list of documents (strings or lists of token ids)")
        out = []
        for i, doc in enumerate(documents):
            check_not_bytes(doc, f"documents[{i}]")
            if isinstance(doc, str):
                out.append(self._tokenize_document(check_text(doc, f"documents[{i}]")))
            elif isinstance(doc, Sequence):
                out.append(self._token_ids(doc, f"documents[{i}]"))
            else:
                raise InvalidArgumentError(f"documents[{i}] must be a string or a list of token ids, got {type(doc).__name__}")
        return out

    def _tokenize_document(self, text: str) -> list[int]:
        """Each distinct document is tokenized once per engine: RAG pipelines retrieve the same ones again."""
        key = hashlib.sha1(text.encode()).hexdigest()
        with self._documents_lock:
            ids = self._documents.get(key)
            if ids is not None:
                self._documents.move_to_end(key)
                return ids
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        with self._documents_lock:
            self._documents[key] = ids
            if len(self._documents) > _DOCUMENT_CACHE_SIZE:
                self._documents.popitem(last=False)
        return ids

    def _check_lengths(self, request: Request) -> None:
        total = len(request.prompt_ids) + request.max_new_tokens
        if self.max_positions is not None and total > self.max_positions:
            raise InvalidArgumentError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) = {total} "
                f"exceeds the model's position limit of {self.max_positions}"
            )


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
