"""Continuous batching of speculative generations: requests as state, one step function.

Every generation in flight is a `Sequence`: its request, its tokens, its drafter, its output, its
sampling generator, its stream. Each `step`, on the engine's thread:

1. requests that arrived join the queue; a cancelled one leaves it at once;
2. queued sequences start while there is room (`max_batch` sequences, and KV entries within the
   budget: a sequence reserves its prompt, `max_new_tokens` and a draft), taking their prompt's
   longest cached prefix from the prompt cache;
3. one started sequence feeds a chunk of its prompt (`prefill_chunk` tokens while others decode,
   so their steps wait at most one chunk; the whole prompt when nothing else runs), and with the
   last chunk samples its first token (and tells the prompt cache what the prefill cost, which its
   disk tier's loads compete with);
4. every decoding sequence's drafter proposes, `batch_width` picks how many tokens each row feeds
   so that the batch's expected tokens per second is highest (fewer as rows are added, none where
   drafts do not pay), ONE forward verifies them all, and each row accepts its own path;
5. sequences that ended (EOS, a stop string, `max_new_tokens`, cancelled) leave at once, giving
   their entries to the prompt cache and their drafter back for the next sequence.

A row's tokens never depend on the rows beside it where the forwards compute each row as if alone
(the CPU kernels), and its sampling draws from its own generator; so a greedy answer, and a seeded
sampled one, is the one the request gets alone.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from ..decoding.budget import CostModel, batch_width
from ..decoding.output import OutputTracker
from ..decoding.request import Request
from ..decoding.result import Channel, GenerationResult, GenerationStats
from ..decoding.sampling import sample_token
from ..decoding.tree import DraftTree
from ..decoding.verify import Verification, accept, greedy_choices
from ..drafters import DraftContext, Drafter
from ..errors import InvalidArgumentError, RagSpeculateError
from .runner import BatchRunner, SequentialRunner


@dataclass(eq=False)
class Sequence:
    """One generation in flight."""

    key: int
    request: Request
    channel: Channel
    output: OutputTracker
    generator: torch.Generator
    stats: GenerationStats
    submitted: float
    reserved: int  # KV entries it may hold at most
    drafter: Drafter | None = None
    tokens: list[int] = field(default_factory=list)  # the prompt, then the output; the last one not yet fed
    prefilled: int = 0  # prompt tokens whose entries are held
    started: float = 0.0
    decode_started: float = 0.0

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.request.prompt_ids)


class Scheduler:
    def __init__(
        self,
        runner: BatchRunner | SequentialRunner,
        *,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        drafter: Drafter,
        draft_budget: int,
        costs: Callable[[], CostModel],
        max_batch: int,
        kv_tokens: int | None,
        prefill_chunk: int,
        device: torch.device,
    ):
        """`costs()`: the target's forward cost by tokens fed (timed on first use); `kv_tokens`: the
        KV entries the running sequences may hold together (None: no bound)."""
        self.runner, self.tokenizer, self.eos_token_ids, self.vocab_size = runner, tokenizer, eos_token_ids, vocab_size
        self.draft_budget, self.costs, self.max_batch, self.kv_tokens = draft_budget, costs, max_batch, kv_tokens
        self.prefill_chunk, self.device = prefill_chunk, device
        self.drafter = drafter  # the first sequence's; others get forks of it
        self._idle_drafters = [drafter]
        self._incoming: deque[Sequence] = deque()
        self._lock = threading.Lock()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._keys = 0

    # --- from any thread -----------------------------------------------------------------

    def submit(self, request: Request, channel: Channel) -> None:
        reserved = len(request.prompt_ids) + request.max_new_tokens + self.draft_budget + 1
        if self.kv_tokens is not None and reserved > self.kv_tokens:
            raise InvalidArgumentError(
                f"the request needs room for {reserved} tokens of KV entries, more than the engine's "
                f"kv_cache_bytes allow ({self.kv_tokens} tokens): raise kv_cache_bytes or lower max_new_tokens", "max_new_tokens"
            )  # fmt: skip
        room = self.runner.row_room()
        if room is not None and reserved > room:
            raise InvalidArgumentError(
                f"the request needs room for {reserved} tokens of KV entries, more than a row of the engine's "
                f"preallocated cache holds ({room} tokens: kv_cache_bytes shared among max_batch rows): "
                "raise kv_cache_bytes, lower max_batch or lower max_new_tokens", "max_new_tokens"
            )  # fmt: skip
        stats = GenerationStats(prompt_tokens=len(request.prompt_ids))
        output = OutputTracker(self.tokenizer, self.eos_token_ids, request.stop, request.max_new_tokens)
        with self._lock:
            self._keys += 1
            sequence = Sequence(self._keys, request, channel, output, _generator(request.seed, self.device), stats,
                                time.perf_counter(), reserved)  # fmt: skip
            self._incoming.append(sequence)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._incoming) + len(self.waiting) + len(self.running)

    def fail_all(self, error: BaseException) -> None:
        """A step failed outside any one sequence: every sequence in flight gets the error."""
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
        for sequence in [*self.running, *self.waiting]:
            self._fail(sequence, error)
        self.waiting.clear()

    # --- on the engine's thread --------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> bool:
        """One step of every sequence in flight; False when there is none."""
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
        for sequence in [s for s in self.waiting if s.channel.cancelled.is_set()]:
            self.waiting.remove(sequence)
            self._finish(sequence, "cancelled")
        self._admit()
        if not self.running:
            return bool(self.waiting)
        for sequence in [s for s in self.running if s.channel.cancelled.is_set()]:
            self._finish(sequence, "cancelled")
        prefilling = [s for s in self.running if not s.decoding]
        if prefilling:
            self._prefill(prefilling[0], whole=len(prefilling) == len(self.running))
        decoding = [s for s in self.running if s.decoding and not s.output.done]
        if decoding:
            self._decode(decoding)
        return True

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            sequence = self.waiting[0]
            longest = max((s.reserved for s in self.running), default=0)
            # The rows take room for the longest sequence each (BatchCache's layout), unless they were allocated once.
            growing = self.kv_tokens is not None and self.runner.row_room() is None
            if growing and self.running and (len(self.running) + 1) * max(longest, sequence.reserved) > self.kv_tokens:
                return
            self.waiting.popleft()
            self._start(sequence, max(longest, sequence.reserved))

    def _start(self, sequence: Sequence, longest: int) -> None:
        sequence.started = time.perf_counter()
        sequence.stats.queue_s = sequence.started - sequence.submitted
        request = sequence.request
        try:
            # At least the prompt's last token is fed: its logits give the first new token.
            reused = self.runner.add(sequence.key, request.prompt_ids[:-1], longest)
            sequence.prefilled = reused.tokens
            self.running.append(sequence)
            sequence.stats.cached_prompt_tokens, sequence.stats.disk_cached_prompt_tokens = reused.tokens, reused.disk
            sequence.stats.verification = "tree" if self.runner.tree_mode(sequence.key) else "chain"
            costs = self.costs()
            setup_started = time.perf_counter()
            sequence.drafter = self._idle_drafters.pop() if self._idle_drafters else self.drafter.fork()
            sequence.drafter.start(DraftContext(request.prompt_ids, request.document_ids, self.vocab_size, costs))
            sequence.stats.draft_setup_s = time.perf_counter() - setup_started
        except Exception as error:  # noqa: BLE001 - this sequence's failure, handed to its reader
            self._fail(sequence, error)

    def _prefill(self, sequence: Sequence, whole: bool) -> None:
        prompt = sequence.request.prompt_ids
        end = len(prompt) if whole else min(len(prompt), sequence.prefilled + self.prefill_chunk)
        started = time.perf_counter()
        try:
            logits = self.runner.prefill(sequence.key, prompt[sequence.prefilled : end])
        except Exception as error:  # noqa: BLE001
            self._fail(sequence, error)
            return
        sequence.prefilled = end
        stats = sequence.stats
        if end < len(prompt):
            stats.prefill_s += time.perf_counter() - started
            return
        # Timed up to the first token: sampling reads it back, so a GPU's prefill has then finished.
        first = sample_token(logits, sequence.request.sampling, sequence.generator)
        stats.prefill_s += time.perf_counter() - started
        self.runner.prompt_cache.observe_prefill(len(prompt) - stats.cached_prompt_tokens, stats.prefill_s)
        stats.target_forwards = 1
        stats.time_to_first_token_s = time.perf_counter() - sequence.submitted
        sequence.tokens = [*prompt, first]
        sequence.output.extend([first])
        sequence.decode_started = time.perf_counter()
        self._emit(sequence)
        if sequence.output.done:
            self._finish(sequence, None)

    def _decode(self, decoding: list[Sequence]) -> None:
        costs = self.costs()
        steps: list[tuple[Sequence, DraftTree]] = []
        for sequence in decoding:
            try:
                steps.append((sequence, self._draft(sequence)))
            except Exception as error:  # noqa: BLE001
                self._fail(sequence, error)
        if not steps:
            return
        scored = [tree.scores for _, tree in steps if tree.scores]
        least = 1 + max((len(tree) for _, tree in steps if not tree.scores), default=0)
        width = batch_width(scored + [[]] * (len(steps) - len(scored)), costs, self.draft_budget, least)
        steps = [(s, tree.truncated(width - 1) if tree.scores else tree) for s, tree in steps]
        started = time.perf_counter()
        try:
            logits = self.runner.verify([(s.key, s.tokens[-1], tree) for s, tree in steps], width)
            choices = greedy_choices(logits)
            verifications = [accept(tree, rows, s.request.sampling, s.generator, chosen)
                             for (s, tree), rows, chosen in zip(steps, logits, choices)]  # fmt: skip
            self.runner.keep({s.key: [0] + [i + 1 for i in v.accepted_nodes] for (s, _), v in zip(steps, verifications)})
        except Exception as error:  # noqa: BLE001 - the forward failed: every row in it
            for sequence, _ in steps:
                self._fail(sequence, error)
            return
        elapsed = time.perf_counter() - started
        fed = len(steps) * width
        costs.observe(fed, elapsed)
        for (sequence, tree), verification in zip(steps, verifications):
            self._advance(sequence, verification, len(steps), fed)

    def _draft(self, sequence: Sequence) -> DraftTree:
        started = time.perf_counter()
        # A draft longer than the tokens left could only be cut: don't pay to draft it.
        budget = min(self.draft_budget, sequence.request.max_new_tokens - len(sequence.output.token_ids) - 1)
        # Best first, so every prefix is a tree and the budget keeps the likeliest nodes.
        tree = sequence.drafter.propose(sequence.tokens, budget).best_first().truncated(budget)
        if tree.tokens and not 0 <= min(tree.tokens) <= max(tree.tokens) < self.vocab_size:
            raise RagSpeculateError(f"drafter {sequence.drafter.name!r} proposed a token outside [0, {self.vocab_size})")
        if not self.runner.tree_mode(sequence.key):
            tree = tree.longest_branch()
        sequence.stats.drafting_s += time.perf_counter() - started
        return tree

    def _advance(self, sequence: Sequence, verification: Verification, rows: int, fed: int) -> None:
        stats, tree = sequence.stats, verification.tree
        stats.target_forwards += 1
        stats.forward_sizes[len(tree) + 1] += 1
        stats.batch_sizes[rows] += 1
        stats.step_tokens[fed] += 1
        started = time.perf_counter()
        try:
            sequence.drafter.observe(verification)
        except Exception as error:  # noqa: BLE001
            self._fail(sequence, error)
            return
        stats.drafting_s += time.perf_counter() - started
        taken = sequence.output.extend(verification.accepted_tokens)
        sequence.tokens.extend(verification.accepted_tokens[:taken])
        for i in range(len(tree)):
            stats.drafted_tokens[tree.source(i) or sequence.drafter.name] += 1
        for i in verification.accepted_nodes[:taken]:
            stats.accepted_tokens[tree.source(i) or sequence.drafter.name] += 1
        self._emit(sequence)
        if sequence.output.done:
            self._finish(sequence, None)

    def _emit(self, sequence: Sequence) -> None:
        delta = sequence.output.delta()
        if delta:
            sequence.channel.delta(delta)

    def _finish(self, sequence: Sequence, reason: str | None) -> None:
        """The sequence leaves: its entries to the prompt cache, its drafter back, its result out."""
        stats, output = sequence.stats, sequence.output
        if sequence in self.running:
            self.running.remove(sequence)
            # The entries hold its tokens in order (and, where a stop string cut an accepted draft
            # short, a few more); a prompt not yet wholly fed gives what it fed.
            held = self.runner.held(sequence.key)
            self.runner.remove(sequence.key, (sequence.tokens or sequence.request.prompt_ids)[:held])
            self._idle_drafters.append(sequence.drafter)
        if sequence.decode_started:
            stats.decode_s = time.perf_counter() - sequence.decode_started
        stats.new_tokens = len(output.token_ids)
        self._emit(sequence)
        finish = output.finish_reason or reason or "cancelled"
        sequence.channel.finish(GenerationResult(output.text, output.token_ids, finish, stats))

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        if sequence in self.running:
            self.running.remove(sequence)
            self.runner.remove(sequence.key, None)  # nothing of a failed generation is kept
            # Its drafter's state may be half-changed by the failure: the next sequence gets a fork.
        sequence.channel.fail(error)


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
