"""One command for a bare CUDA machine: the tests on the GPU, forward costs eager and in CUDA graphs,
engine overhead, real-weight speed against transformers' compiled static cache, throughput.

    python3 benchmarks/gpu_check.py --out gpu_check_results              # cuda where available, bf16
    python3 benchmarks/gpu_check.py --device cpu --quick --out /tmp/gc   # tiny models, CUDA-only rows skipped

It needs torch, transformers and numpy only (pytest for section 1, pydivsufsort for REST, a
SmolLM2-135M-Instruct folder or the packaged one for sections 4 and 6; each missing piece skips its
part with a line in the summary). Runs from a checkout: the repo's source is imported, not installed.

1. tests: the CUDA test selection under RAG_SPECULATE_TEST_DEVICE=<device>, log in tests.log;
2. forward cost: the target's forward against tokens fed, tree (4D mask) and plain causal, for
   Qwen2.5-1.5B and 7B shapes at random weights (weights' values do not change a forward's time);
3. step overhead: the engine's time per decoding step outside the target's forward;
4. real weights: SmolLM2-135M-Instruct on the Spec-Bench dev items, ours (CUDA graphs, eager, fixed
   shapes eagerly) against `generate` (dynamic cache, prompt lookup, static cache compiled); and in
   fp32 on a subset, where the run is not fp32, ours against `generate` token for token;
5. the fixed-shape step's forward, eager against CUDA graphs, per bucket, beside the weight-read floor;
6. throughput: 1, 4, 16 and 64 requests run together through the engine's batching;
7. replayed acceptance: the 1.5B and 7B shapes at random weights end to end, ours (CUDA graphs,
   eager, fixed shapes eagerly) against `generate` (dynamic cache, static cache compiled), with a
   drafter that replays the acceptance the real 1.5B measured on the CPU per category
   (`replayed_acceptance.py`).

The sections run in the order replayed, real, fp32, graphs, batch, forward, tests (the newest
first), each timed. Each writes a markdown table to --out, gpu_check.json (rewritten after every section) holds
every raw number, and the summary is printed last on stdout (progress goes to stderr).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # replayed_acceptance.py, beside this file, when loaded from elsewhere
# No model hub on the machines this runs on: a download attempt should fail fast, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import contextlib
import importlib.util
import json
import platform
import re
import shlex
import statistics
import subprocess
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import (AutoModelForCausalLM, AutoTokenizer, CompileConfig, PreTrainedModel, PreTrainedTokenizerFast,
                          Qwen2Config)

from rag_speculate import (Datastore, DatastoreError, GenerationResult, GenerationStats, NGramTrieDrafter, RESTDrafter,
                           SpeculativeEngine)
# _timed_generate: timed_generate's body, called on a thread of our own (hf_methods says why).
from rag_speculate.decoding.baseline import _timed_generate, timed_generate
from rag_speculate.decoding.forward import ModelForward, TreeForward
from rag_speculate.decoding.kv_cache import keep_cache_entries, make_cache
from rag_speculate.decoding.lean_forward import lean_forward
from rag_speculate.decoding.probe import probe_ids
from rag_speculate.decoding.prompt_cache import kv_bytes_per_token
from rag_speculate.decoding.static import StaticStep
from rag_speculate.decoding.tree import DraftTree
from rag_speculate.engine.engine import DEFAULT_DRAFT_BUDGET, EngineStats
from rag_speculate.models.gguf_file import dense_gguf
from replayed_acceptance import Plan, ReplayedAcceptanceDrafter, continue_probability, measured_acceptance

# The dev items shipped with the benchmarks (benchmarks/data/README.md).
DEFAULT_DATA = REPO / "benchmarks" / "data" / "spec_bench_dev.jsonl"
CATEGORIES = ("rag", "summarization", "qa")
SMOLLM = "smollm2-135m-instruct"

TESTS = ["tests/engine/test_lossless.py", "tests/decoding/test_sampling.py", "tests/decoding/test_stop_and_stream.py",
         "tests/drafters/test_ouroboros.py", "tests/drafters/test_combined.py", "tests/engine/test_portable.py",
         "tests/decoding/test_tree.py", "tests/decoding/test_lean_forward.py",
         # The fixed-shape step and its CUDA graphs (issue 63): a replay's bits are the eager step's.
         "tests/cuda/test_graphs.py", "tests/decoding/test_static.py", "tests/engine/test_static_step.py",
         # Models quantized through transformers (torchao, bitsandbytes: each skips where it is not installed).
         "tests/quantization/test_layer.py::test_a_model_quantized_through_transformers_works_unchanged",
         "tests/quantization/test_layer.py::test_llm_int8_outlier_columns_are_named_as_rows_that_interact"]
QUICK_TESTS = ["tests/decoding/test_tree.py", "tests/engine/test_portable.py", "-k", "trie or test_tree.py"]

# Architectures as their config.json have them. Rope settings are left at the defaults: they do not
# change a forward's cost.
ARCHS: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False),
}
# --quick: the same code on two tiny shapes, one tied and one not, like the real pair.
TINY_ARCHS: dict[str, dict[str, Any]] = {
    "tiny-a": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True),
    "tiny-b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False),
}
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def noop() -> None:
    pass


def graphs_said(stats: EngineStats) -> str:
    """How an engine's step runs, as its stats() say."""
    if stats.cuda_graphs:
        return f"{stats.cuda_graphs} CUDA graphs, {stats.cuda_graph_bytes / 2**20:.0f} MiB"
    return "no CUDA graphs"


def sync(device: torch.device) -> None:
    # CUDA runs asynchronously: without this a timer reads the kernel launches, not the work.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- 1. the tests on the device ------------------------------------------------------------


def run_tests(device: torch.device, quick: bool, out: Path, timeout_s: int) -> dict:
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "note": "pytest is not installed here (pip install pytest, or copy a wheel)"}
    selection = QUICK_TESTS if quick else TESTS
    # Tiny models are launch-bound on a GPU: worker processes (pytest-xdist, where installed) share it.
    workers = ["-n", str(min(8, os.cpu_count() or 1))] if device.type == "cuda" and importlib.util.find_spec("xdist") else []
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *workers, *selection]
    # tests/conftest.py builds its tiny models on this device; the CPU kernels' tests skip elsewhere.
    env = os.environ | {"RAG_SPECULATE_TEST_DEVICE": str(device), "HF_HUB_OFFLINE": "1"}
    log(f"tests: {shlex.join(command[1:])} on {device}")
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as expired:  # a hung test must not hang the whole check
        returncode, stdout = -1, _text(expired.stdout) + f"\n[gpu_check] killed after {timeout_s} s"
        stderr = _text(expired.stderr)
    (out / "tests.log").write_text(f"$ RAG_SPECULATE_TEST_DEVICE={device} {shlex.join(command)}\n\n{stdout}\n{stderr}")
    counts = pytest_counts(stdout)
    return {"status": "ran", "command": command, "returncode": returncode, "seconds": time.perf_counter() - started, **counts}


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def pytest_counts(stdout: str) -> dict[str, int]:
    """passed/failed/skipped/errors from pytest's last line, e.g. '120 passed, 3 skipped in 61.2s'."""
    last = next((line for line in reversed(stdout.splitlines()) if re.search(r"\b(passed|failed|error|no tests ran)", line)), "")
    counts = {key: 0 for key in ("passed", "failed", "skipped", "errors", "deselected")}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", last):
        counts["errors" if word.startswith("error") else word] += int(number)
    return counts


def tests_markdown(result: dict) -> str:
    if result["status"] != "ran":
        return f"# Tests\n\n{result['note']}\n"
    line = ", ".join(f"{result[k]} {k}" for k in ("passed", "failed", "errors", "skipped", "deselected"))
    return f"# Tests\n\n`{shlex.join(['python3', *result['command'][1:]])}`: {line} (exit {result['returncode']}, {result['seconds']:.0f} s; log: tests.log)\n"


# --- 2. the target's forward cost against tokens fed ------------------------------------------


def random_model(shape: dict[str, Any], device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """A Qwen2 model of that shape at random weights, initialized directly on the device (a 7B model
    built on the CPU first would take minutes and 30 GB of host memory)."""
    torch.manual_seed(0)
    config = Qwen2Config(**shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # No EOS: every generation of section 3 runs to max_new_tokens.
    model.generation_config.eos_token_id = None
    return model.eval()


def median_seconds(run: Callable[[], None], after: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of `run` (synchronized), `after` called untimed after each call."""
    times = []
    for i in range(warmup + repeats):
        sync(device)
        started = time.perf_counter()
        run()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - started)
        after()
    return statistics.median(times)


def forward_costs(model: PreTrainedModel, contexts: list[int], sizes: tuple[int, ...], warmup: int, repeats: int) -> dict:
    """{context: {mode: {q: seconds}}}: one verification forward over q tokens after `context` cached ones.

    "tree" feeds a chain-shaped DraftTree with its additive 4D mask and depth positions, as the engine
    verifies; "chain" the same tokens under the model's own causal mask, as plain decoding (q = 1)
    and chain verification do. Both through the model's own forward and, where its probe admits
    it (as the engine decides), through the lean forward ("lean chain", "lean tree"). torch's own
    kernels on every device (the CPU kernels are not used).
    """
    forwards = {"": TreeForward(model)}
    lean, _ = lean_forward(model, exact=True)
    if lean is not None:
        forwards["lean "] = TreeForward(model, forward=lean)
    vocab = model.config.vocab_size
    ids = probe_ids(vocab, max(contexts) + max(sizes))
    out: dict = {}
    for context in contexts:
        cache = make_cache(model)
        forwards[""].prefill(cache, ids[:context])
        out[context] = {}
        for prefix, forward in forwards.items():
            for mode in ("chain", "tree"):
                step = forward.tree if mode == "tree" else forward.chain
                times = out[context][prefix + mode] = {}
                for q in sizes:
                    draft = DraftTree.chain(ids[context : context + q - 1])
                    # The fed entries are dropped after each forward, so every one sees the same context.
                    times[q] = median_seconds(
                        lambda: step(cache, ids[context], draft), lambda: keep_cache_entries(cache, q, []),
                        model.device, warmup, repeats,
                    )
        del cache
    return out


def forward_cost_markdown(costs: dict, dtype: torch.dtype, device_name: str) -> str:
    lines = [f"# Target forward cost against tokens fed ({dtype_name(dtype)}, {device_name}, random weights)", "",
             "t(q): median seconds of one forward over q tokens after the context; ratios are to t(1) of the plain "
             "causal forward, one plain decoding step. tree: chain-shaped draft with the engine's 4D additive mask; "
             "lean: the lean forward the engine runs where it gives the model's own logits bit for bit.", ""]
    for arch, by_context in costs.items():
        for context, modes in by_context.items():
            base = modes["chain"][1]
            lines += [f"## {arch}, context {context}", "", "| q | " + " | ".join(f"{m} s | {m} t(q)/t(1)" for m in modes) + " |",
                      "|---:|" + "---:|---:|" * len(modes)]
            for q in modes["chain"]:
                lines.append(f"| {q} | " + " | ".join(f"{t[q]:.5f} | {t[q] / base:.2f}" for t in modes.values()) + " |")
            lines.append("")
    return "\n".join(lines)


# --- 3. the engine's time per step outside the target's forward ---------------------------------


class ForwardClock:
    """Seconds inside each of an engine's target forwards (prefill first), read by wrapping
    `ModelForward.logits`, which every forward of the engine's model runs through (one sequence's
    or a batch's, the model's own forward or its lean one), and, where the engine verifies in fixed
    shapes, its step's `replay`, through which each verification runs (a CUDA graph's replay calls
    no `logits`); a draft model's are not counted. Synchronized on CUDA, so the GPU's work is
    counted here and not in the read-back of the accepted tokens that follows it."""

    def __init__(self, engine: SpeculativeEngine):
        self.seconds: list[float] = []
        model, device = engine.model, engine.model.device
        inner = self._inner = ModelForward.logits
        self._step = getattr(engine._runner, "step", None)
        replaying = False  # inside a replay, whose time is counted once, as one forward

        def clocked(run: Callable[[], torch.Tensor]) -> torch.Tensor:
            sync(device)
            started = time.perf_counter()
            output = run()
            sync(device)
            self.seconds.append(time.perf_counter() - started)
            return output

        def timed(forward: ModelForward, *args, **kwargs):
            if forward.model is not model or replaying:
                return inner(forward, *args, **kwargs)
            return clocked(lambda: inner(forward, *args, **kwargs))

        ModelForward.logits = timed
        if self._step is not None:
            replay = self._replay = self._step.replay

            def timed_replay(shape: tuple[int, int], run: Callable[[], torch.Tensor]) -> torch.Tensor:
                nonlocal replaying
                replaying = True
                try:
                    return clocked(lambda: replay(shape, run))
                finally:
                    replaying = False

            self._step.replay = timed_replay

    def remove(self) -> None:
        ModelForward.logits = self._inner
        if self._step is not None:
            self._step.replay = self._replay


@dataclass
class StepTotals:
    """One engine's decoding steps, summed over its generations."""

    generations: int = 0
    steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    forward_s: float = 0.0
    drafting_s: float = 0.0

    def add(self, stats: GenerationStats, forward_seconds: list[float]) -> None:
        # The first target forward is the prefill, outside decode_s; each later one is one step.
        if len(forward_seconds) != stats.target_forwards:
            raise RuntimeError(f"clocked {len(forward_seconds)} target forwards, the engine counted {stats.target_forwards}")
        self.generations += 1
        self.steps += stats.target_forwards - 1
        self.decode_tokens += stats.new_tokens - 1
        self.decode_s += stats.decode_s
        self.forward_s += sum(forward_seconds[1:])
        self.drafting_s += stats.drafting_s

    def as_dict(self) -> dict:
        per_step = 1e3 / max(self.steps, 1)
        return vars(self) | {
            "tokens_per_step": self.decode_tokens / max(self.steps, 1),
            "forward_ms_per_step": self.forward_s * per_step,
            # What speculation adds to every step on top of the forward: drafting, building the tree
            # and its mask, acceptance, the cache gather, the drafters' bookkeeping, the output's text.
            "overhead_ms_per_step": (self.decode_s - self.forward_s) * per_step,
            "drafting_ms_per_step": self.drafting_s * per_step,
        }


def id_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer with one word per token id, no EOS: random-weight models have no tokenizer of their own."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")


def step_overhead_random(model: PreTrainedModel, context: int, max_new_tokens: int) -> dict:
    """The engine with the n-gram trie on a random-weight model whose one document is its own greedy
    continuation, so the trie's drafts are accepted as a RAG answer's copied spans are, and steps
    verify full-sized trees. The first generation (no documents) makes that document and warms up."""
    engine = SpeculativeEngine(model, id_tokenizer(model.config.vocab_size), NGramTrieDrafter())
    capture_buckets(engine)
    prompt = [(11 * i + 5) % model.config.vocab_size for i in range(context)]
    continuation = engine.generate(prompt, max_new_tokens=max_new_tokens).token_ids
    clock, totals = ForwardClock(engine), StepTotals()
    try:
        for _ in range(2):
            clock.seconds.clear()
            stats = engine.generate(prompt, documents=[continuation], max_new_tokens=max_new_tokens).stats
            totals.add(stats, clock.seconds)
    finally:
        clock.remove()
    return totals.as_dict() | {"context": context, "max_new_tokens": max_new_tokens}


def step_overhead_markdown(rows: dict[str, dict]) -> str:
    lines = ["# Engine time per step outside the target's forward", "",
             "decode time minus the time inside the target's forwards (synchronized), per verification step; "
             "drafting is the drafter's share of it. Random-weight rows: one document, the model's own greedy "
             "continuation, so trees are full-sized; SmolLM2 rows: the trie on the real dev items.", "",
             "| engine | generations | steps | tokens/step | forward ms/step | outside forward ms/step | drafting ms/step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['generations']} | {r['steps']} | {r['tokens_per_step']:.2f} | {r['forward_ms_per_step']:.2f} "
                     f"| {r['overhead_ms_per_step']:.2f} | {r['drafting_ms_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


# --- 4. real weights: SmolLM2-135M-Instruct on the dev items --------------------------------------


@dataclass
class Item:
    id: str
    category: str
    prompt_ids: list[int]
    documents: list[str] | None


def load_items(engine: SpeculativeEngine, path: Path, categories: tuple[str, ...], n: int) -> list[Item]:
    """The first `n` items per category, as benchmarks/spec_bench.py's `load_items` makes them."""
    items, seen = [], defaultdict(int)
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        category = row["category"]
        if category in categories and seen[category] < n:
            seen[category] += 1
            prompt = row["turns"][0]
            # A rag item is passages, one per line, then the question: the passages are what a pipeline retrieved.
            documents = prompt.split("\n")[:-1] if category == "rag" else None
            items.append(Item(str(row["question_id"]), category, engine.encode_prompt(prompt, chat=True), documents))
    return items


def load_smollm(path: Path | None, device: torch.device, dtype: torch.dtype) -> tuple[PreTrainedModel, Any, str] | str:
    """(model, tokenizer, where from), or why none could be loaded."""
    if path is not None:
        # A GGUF file is the packaged one copied to a machine without the package (the gguf package reads it).
        folder, extra = (path.parent, dense_gguf(path.name)) if path.suffix == ".gguf" else (path, {})
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=extra.get("gguf_file"), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, **extra, dtype=dtype, local_files_only=True).to(device).eval()
        return model, tokenizer, str(path)
    try:
        from rag_speculate.models.packaged import load_packaged_model

        model, tokenizer = load_packaged_model(SMOLLM, dtype=dtype, device=str(device))
    except Exception as error:  # noqa: BLE001 - any failure (not installed, no GGUF reader) just skips the section
        return f"no --smollm folder and the packaged {SMOLLM} does not load here ({type(error).__name__}: {error})"
    return model, tokenizer, f"packaged {SMOLLM}"


def nq_datastore(tokenizer) -> Datastore | str:
    """REST's datastore over the shipped Natural Questions passages, or why it cannot be built."""
    from rag_speculate.retrieval.nq import nq_documents

    try:
        return Datastore.from_texts([document.text for document in nq_documents()], tokenizer)
    except DatastoreError as error:  # pydivsufsort missing
        return str(error)


@dataclass
class Run:
    tokens: list[int]
    decode_s: float
    decode_tokens: int


Method = Callable[[Item, int], Run]


def hf_method(model: PreTrainedModel, thread: ThreadPoolExecutor | None = None, **kwargs: Any) -> Method:
    """Greedy `generate` with `kwargs`, timed; every call on `thread` where one is given, else each on a
    thread of its own (`timed_generate`)."""

    def run(item: Item, max_new_tokens: int) -> Run:
        if thread is None:
            out = timed_generate(model, item.prompt_ids, max_new_tokens, **kwargs)
        else:
            args = (model, item.prompt_ids, max_new_tokens, contextlib.nullcontext, kwargs)
            out = thread.submit(_timed_generate, *args).result()
        return Run(out.token_ids, out.decode_s, out.decode_tokens)

    return run


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process: more after the warm-up means recompiles inside timed runs."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def hf_methods(model: PreTrainedModel, first: Item, max_new_tokens: int, cache_tokens: int, notes: list[str], *,
               lookup: bool, compiled: bool, thread: ThreadPoolExecutor) -> dict[str, Method]:
    """`generate` with transformers' dynamic cache, with prompt lookup (`lookup`) and with its static
    cache and compiled decoding forward (`compiled`), each warmed up on `first`."""
    methods = {"hf-greedy": hf_method(model)}
    if lookup:
        methods["hf-pld"] = hf_method(model, prompt_lookup_num_tokens=10)
    if compiled and model.device.type != "cuda":
        notes.append("hf-static-compiled skipped: transformers compiles generate's forward on a GPU only")
    elif compiled:
        # transformers' fastest documented path: on a static cache, generate compiles its decoding forward
        # (mode reduce-overhead: CUDA graphs). One cache length for every item, so a new prompt's length
        # recompiles nothing; one thread for every call, as torch keeps its CUDA graph trees per thread.
        methods["hf-static-compiled"] = hf_method(
            model, thread, cache_implementation="static", max_cache_len=cache_tokens,
            compile_config=CompileConfig(mode="reduce-overhead"),
        )
    for name, method in methods.items():
        started = time.perf_counter()
        method(first, 4)  # first calls pay one-off costs
        if name == "hf-static-compiled":
            method(first, max_new_tokens)
            notes.append(f"hf-static-compiled: generate(cache_implementation=\"static\", "
                         f"max_cache_len={cache_tokens}), its decoding forward compiled by torch.compile (mode "
                         f"reduce-overhead); warm-up {time.perf_counter() - started:.1f} s (compiling, capturing), "
                         "untimed")
    return methods


# Ours with the trie: as the engine runs by default (on a GPU: CUDA graphs replaying the fixed-shape
# step), eagerly on the growing cache, and in fixed shapes eagerly.
OURS: dict[str, dict[str, bool]] = {"ours-trie": {}, "ours-trie-eager": {"cuda_graphs": False},
                                    "ours-trie-static": {"cuda_graphs": False, "static_step": True}}


def sized_engine(
    model: PreTrainedModel, tokenizer, drafter, row_tokens: int, max_batch: int = 1, **options: Any
) -> SpeculativeEngine:
    """An engine of `max_batch` rows of `row_tokens` KV entries each: the fixed-shape step reads a row's
    whole capacity, so rows are sized to the items, not to the default 8,192 tokens. Its graphs are
    captured now (`capture_buckets`), before anything is timed."""
    engine = SpeculativeEngine(model, tokenizer, drafter, max_batch=max_batch,
                               kv_cache_bytes=kv_bytes_per_token(model) * max_batch * row_tokens, **options)
    capture_buckets(engine)
    return engine


def capture_buckets(engine: SpeculativeEngine) -> None:
    """Every bucket of the engine's fixed-shape step captured in its CUDA graph, where graphs replay it
    (a capture costs a few forwards, once: not inside a timed run). Only before the engine's first
    step: a bucket run alone must find its buffers as padding, and a step leaves them filled."""
    if engine._graphs is None:
        return
    step = engine._runner.step
    with torch.inference_mode():
        for shape in step.shapes():
            step.bucket(shape)()


def our_engines(model: PreTrainedModel, tokenizer, eager: SpeculativeEngine, row_tokens: int, notes: list[str], *,
                rest: bool) -> dict[str, SpeculativeEngine]:
    """`OURS`, one stream each (`eager`: an engine without graphs, which the items were tokenized
    with), and (`rest`) the trie with REST, with the engine's defaults."""
    on_cuda = model.device.type == "cuda"
    engines = {"ours-trie": sized_engine(model, tokenizer, NGramTrieDrafter(), row_tokens) if on_cuda else eager}
    if on_cuda:
        engines["ours-trie-eager"] = eager
    else:
        notes.append("ours-trie-eager not run apart: on a CPU the engine's default (ours-trie) is the eager one")
    static = OURS["ours-trie-static"]
    engines["ours-trie-static"] = sized_engine(model, tokenizer, NGramTrieDrafter(), row_tokens, **static)
    if rest:
        store = nq_datastore(tokenizer)
        if isinstance(store, Datastore):
            drafters = [NGramTrieDrafter(), RESTDrafter(store)]
            engines["ours-trie+rest"] = sized_engine(model, tokenizer, drafters, row_tokens)
            notes.append(f"REST datastore: the shipped Natural Questions passages, {store.num_tokens} tokens")
        else:
            notes.append(f"ours-trie+rest skipped: {store}")
    stats = engines["ours-trie"].stats()
    step = "the fixed-shape step" if stats.static_step else "the growing cache"
    notes.append(f"ours-trie, the engine's defaults here: {graphs_said(stats)}, {step}; rows of {row_tokens} tokens, "
                 "one stream (max_batch 1)")
    return engines


def engine_method(engine: SpeculativeEngine, totals: StepTotals | None = None) -> Method:
    """One of ours; with `totals`, its steps are clocked into them (section 3's real-weight rows)."""

    def run(item: Item, max_new_tokens: int) -> Run:
        clock = ForwardClock(engine) if totals is not None else None
        try:
            result = engine.generate(item.prompt_ids, documents=item.documents, max_new_tokens=max_new_tokens)
        finally:
            if clock is not None:
                clock.remove()
        if clock is not None:
            totals.add(result.stats, clock.seconds)
        stats = result.stats
        return Run(result.token_ids, stats.decode_s, max(stats.new_tokens - 1, 0))

    return run


def real_weight_methods(model: PreTrainedModel, tokenizer, items_from: Callable[[SpeculativeEngine], list[Item]],
                        max_new_tokens: int, notes: list[str], *, full: bool,
                        thread: ThreadPoolExecutor) -> tuple[list[Item], dict[str, Method], dict[str, StepTotals]]:
    """The items, every method warmed up on the shortest, and the step totals each of ours with the
    trie alone is clocked into. `full`: prompt lookup, the compiled static cache and trie+REST too."""
    eager = SpeculativeEngine(model, tokenizer, NGramTrieDrafter(), max_batch=1, **OURS["ours-trie-eager"])
    items = items_from(eager)
    why_not = eager.traits.lean_forward.why_not
    notes.append("the engine's target forward: " + (f"the model's own ({why_not})" if why_not else "lean"))
    first = min(items, key=lambda item: len(item.prompt_ids))
    row_tokens = max(len(item.prompt_ids) for item in items) + max_new_tokens + DEFAULT_DRAFT_BUDGET + 1
    hf = hf_methods(model, first, max_new_tokens, row_tokens, notes, lookup=full, compiled=full, thread=thread)
    engines = our_engines(model, tokenizer, eager, row_tokens, notes, rest=full)
    # Warm-up: the first generation times the engine's forward cost curve; ours share that one
    # curve, so they differ only in how the step runs and in their drafters.
    lead = engines["ours-trie"]
    lead.generate(first.prompt_ids, documents=first.documents, max_new_tokens=4)
    for engine in [engine for engine in engines.values() if engine is not lead]:
        engine.cost_model = lead.cost_model
        engine.generate(first.prompt_ids, documents=first.documents, max_new_tokens=4)
    steps = {name: StepTotals() for name in engines if name in OURS}
    return items, hf | {name: engine_method(e, steps.get(name)) for name, e in engines.items()}, steps


def real_weight_speed(methods: dict[str, Method], items: list[Item], max_new_tokens: int) -> dict[str, list[dict]]:
    """Every method on every item, in a rotating order per item so machine noise hits all alike."""
    runs: dict[str, list[dict]] = {name: [] for name in methods}
    names = list(methods)
    for i, item in enumerate(items):
        for name in names[i % len(names):] + names[: i % len(names)]:
            run = methods[name](item, max_new_tokens)
            runs[name].append({"item": item.id, "category": item.category, "tokens": run.tokens,
                               "decode_s": run.decode_s, "decode_tokens": run.decode_tokens})
        reference = runs["hf-greedy"][-1]["tokens"]
        for name in names:
            runs[name][-1]["identical"] = runs[name][-1]["tokens"] == reference
        log(f"real weights [{i + 1}/{len(items)}] {item.category}: " + ", ".join(
            f"{n} {runs[n][-1]['decode_tokens'] / max(runs[n][-1]['decode_s'], 1e-9):.1f} tok/s" for n in names))
    return runs


def speed_table(runs: dict[str, list[dict]]) -> dict[str, dict[str, dict]]:
    """{method: {category or "all": decode tokens/s over its items, ratio to hf-greedy (and to
    hf-static-compiled where it ran), identical count}}."""
    def group(rows: list[dict]) -> dict:
        seconds = sum(r["decode_s"] for r in rows)
        return {"items": len(rows), "identical": sum(r["identical"] for r in rows),
                "decode_tokens_per_s": sum(r["decode_tokens"] for r in rows) / seconds if seconds else 0.0}

    table: dict[str, dict[str, dict]] = {}
    for method, rows in runs.items():
        categories = sorted({r["category"] for r in rows})
        table[method] = {c: group([r for r in rows if r["category"] == c]) for c in categories} | {"all": group(rows)}
    for method, groups in table.items():
        for key, g in groups.items():
            for name, peer in (("speedup", "hf-greedy"), ("vs_compiled", "hf-static-compiled")):
                if peer in table:
                    base = table[peer][key]["decode_tokens_per_s"]
                    g[name] = g["decode_tokens_per_s"] / base if base else 0.0
    return table


def real_weights_markdown(section: dict, title: str) -> str:
    lines = [f"# {title}", ""]
    if section["status"] != "ran":
        return "\n".join(lines + [section["note"], ""])
    compiled = "hf-static-compiled" in section["table"]
    lines += [f"Model: {section['model']}, {section['dtype']}; {section['max_new_tokens']} new tokens at most; "
              "decode tokens/s over all items (the tokens after the first, over the time after it); identical: "
              "token for token equal to hf-greedy's.", ""]
    lines += [f"- {note}" for note in section["notes"]] + [""]
    lines += ["| method | category | items | identical | decode tok/s | x hf-greedy |"
              + " x hf-static-compiled |" * compiled,
              "|---|---|---:|---:|---:|---:|" + "---:|" * compiled]
    for method, groups in section["table"].items():
        for key, g in groups.items():
            lines.append(f"| {method} | {key} | {g['items']} | {g['identical']}/{g['items']} "
                         f"| {g['decode_tokens_per_s']:.1f} | {g['speedup']:.2f} |"
                         + (f" {g['vs_compiled']:.2f} |" if compiled else ""))
    return "\n".join(lines) + "\n"


# --- 5. the fixed-shape step's forward, eager against CUDA graphs -------------------------------------


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes a second the device's memory moves, from a copy of `nbytes` (each byte read once and written once)."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), noop, device, warmup=2, repeats=5)
    return 2 * nbytes / seconds


def weight_bytes(model: PreTrainedModel) -> int:
    """The weights one forward reads: every parameter but an untied input embedding, of which a forward
    reads only the fed tokens' rows."""
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = embedding is model.get_output_embeddings().weight
    return total if tied else total - embedding.numel() * embedding.element_size()


def graph_forward_costs(model: PreTrainedModel, contexts: list[int], warmup: int, repeats: int) -> dict:
    """{context: {"capacity", "eager": {q: s}, "graphs": {q: s} or None, "graph_count", "graph_bytes"}}:
    one forward of the engine's fixed-shape step over one row of q tokens (q = 1, 2, 4, ... 64, its
    buckets at a draft budget of 63), run eagerly and replayed from its CUDA graph (CUDA only). The
    step reads a row's whole capacity whatever the row holds, so the context is the capacity: the
    engine's `kv_cache_bytes` sized to it (rounded up to 64). Its buckets run alone, so padding is fed,
    in the shapes and kernels a step runs."""
    on_cuda = model.device.type == "cuda"
    out: dict = {}
    for context in contexts:
        engine = SpeculativeEngine(
            model, id_tokenizer(model.config.vocab_size), NGramTrieDrafter(), max_batch=1, draft_budget=63,
            kv_cache_bytes=kv_bytes_per_token(model) * context, static_step=True, cuda_graphs=on_cuda,
        )
        runner = engine._runner
        # The same step without graphs, on the same cache and forward, beside the one they replay.
        eager = StaticStep(runner.forward, runner.cache, runner.step.tokens)
        row = out[context] = {"capacity": runner.cache.capacity, "eager": {}, "graphs": {} if on_cuda else None}
        with torch.inference_mode():
            for shape in eager.shapes():
                row["eager"][shape[1]] = median_seconds(eager.bucket(shape), noop, model.device, warmup, repeats)
                if on_cuda:
                    replayed = runner.step.bucket(shape)
                    replayed()  # its capture
                    row["graphs"][shape[1]] = median_seconds(replayed, noop, model.device, warmup, repeats)
        stats = engine.stats()
        row.update(graph_count=stats.cuda_graphs, graph_bytes=stats.cuda_graph_bytes)
        del engine, runner, eager
        if on_cuda:
            torch.cuda.empty_cache()
    return out


def graph_forward_markdown(section: dict, dtype: torch.dtype, device_name: str) -> str:
    bandwidth = section["bandwidth_bytes_per_s"]
    lines = [f"# The fixed-shape step's forward, eager against CUDA graphs ({dtype_name(dtype)}, {device_name}, "
             "random weights)", "",
             "t(q): median seconds of one forward of the engine's fixed-shape step over one row of q tokens "
             "(`StaticStep.bucket`), eager and replayed from its CUDA graph; the context is the row's capacity, "
             "all of which the step reads. floor: the weights one forward reads at the memory bandwidth a "
             f"{section['copy_bytes'] / 2**30:.2f} GiB device copy measured ({bandwidth / 1e9:.0f} GB/s).", ""]
    if not section["cuda"]:
        lines += ["CUDA graphs: not on this device (CUDA only); eager rows alone.", ""]
    for arch, r in section["archs"].items():
        floor = r["weight_bytes"] / bandwidth
        for context, c in r["contexts"].items():
            graphs = c["graphs"]
            base = graphs[1] if graphs else c["eager"][1]
            lines += [f"## {arch}, context {context} (row capacity {c['capacity']}; {r['weight_bytes'] / 1e9:.2f} GB "
                      f"of weights, floor {floor * 1e3:.3f} ms; {c['graph_count']} graphs, "
                      f"{c['graph_bytes'] / 2**20:.0f} MiB)", "",
                      "| q | eager s | graphs s | graphs / eager | t(q)/t(1) | x floor |",
                      "|---:|---:|---:|---:|---:|---:|"]
            for q, eager in c["eager"].items():
                t = graphs[q] if graphs else eager  # t(q)/t(1) and the floor's multiple: the graphs' where they ran
                cells = f"{t:.5f} | {t / eager:.2f}" if graphs else "- | -"
                lines.append(f"| {q} | {eager:.5f} | {cells} | {t / base:.2f} | {t / floor:.1f} |")
            lines.append("")
    return "\n".join(lines)


# --- 6. throughput: concurrent requests through the engine's batching ------------------------------


def run_together(engine: SpeculativeEngine, items: list[Item], max_new_tokens: int) -> list[GenerationResult]:
    """The items submitted together and run as one batch (`generate_batch`, each with its own documents)."""
    requests = [engine.prepare(i.prompt_ids, documents=i.documents, max_new_tokens=max_new_tokens) for i in items]
    return [stream.collect() for stream in [engine.stream_request(request) for request in requests]]


def throughput(
    engine: SpeculativeEngine, items: list[Item], concurrencies: list[int], max_new_tokens: int
) -> dict[int, dict]:
    """For each concurrency c, c requests (the items in turn) run together: new tokens over the wall
    time from submitting them to the last one's end, prefills included (the engine's prompt cache is
    off, so each request prefills its prompt)."""
    batch = [items[i % len(items)] for i in range(max(concurrencies))]
    run_together(engine, batch[:1], 4)  # the first generation times the engine's cost curve
    run_together(engine, batch, 4)  # the largest batch's memory allocated once, untimed
    out: dict[int, dict] = {}
    for c in concurrencies:
        sync(engine.model.device)
        started = time.perf_counter()
        results = run_together(engine, batch[:c], max_new_tokens)
        wall = time.perf_counter() - started
        tokens = sum(r.stats.new_tokens for r in results)
        decode = [(r.stats.new_tokens - 1) / r.stats.decode_s for r in results if r.stats.decode_s > 0]
        out[c] = {"requests": c, "distinct_items": min(c, len(items)), "wall_s": wall, "new_tokens": tokens,
                  "tokens_per_s": tokens / wall, "per_stream_tokens_per_s": tokens / wall / c,
                  "decode_tokens_per_s_mean": statistics.mean(decode) if decode else 0.0}
        log(f"throughput: {c} requests, {tokens / wall:.1f} tok/s together, {tokens / wall / c:.1f} a stream")
    return out


def throughput_markdown(section: dict) -> str:
    lines = ["# Throughput: requests run together through the engine's batching (SmolLM2-135M-Instruct)", ""]
    if section["status"] != "ran":
        return "\n".join(lines + [section["note"], ""])
    lines += [f"Model: {section['model']}, {section['dtype']}; ours with the trie, the engine's defaults "
              f"({section['graphs']}), max_batch {section['max_batch']}, rows of {section['row_tokens']} tokens, the "
              f"prompt cache off; the dev items in turn; {section['max_new_tokens']} new tokens at most. tok/s: new "
              "tokens over the wall time from submitting every request to the last one's end (prefills included); "
              "decode tok/s: each request's own (its tokens after the first over the time after it), averaged.", "",
              "| requests | distinct items | new tokens | wall s | tok/s | tok/s a stream | x the fewest | "
              "decode tok/s a request |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = section["runs"]
    one = rows[min(rows)]["tokens_per_s"]
    for c, r in rows.items():
        lines.append(f"| {c} | {r['distinct_items']} | {r['new_tokens']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.1f} "
                     f"| {r['per_stream_tokens_per_s']:.1f} | {r['tokens_per_s'] / one:.2f} "
                     f"| {r['decode_tokens_per_s_mean']:.1f} |")
    return "\n".join(lines) + "\n"


# --- 7. the 1.5B and 7B shapes end to end, with replayed acceptance -----------------------------------

# Ours with the replaying drafter, as OURS runs the trie: the engine's defaults, eager, fixed shapes eagerly.
REPLAYED: dict[str, dict[str, bool]] = {"ours-replayed": {}, "ours-replayed-eager": {"cuda_graphs": False},
                                        "ours-replayed-static": {"cuda_graphs": False, "static_step": True}}


def replayed_items(vocab: int, n: int, context: int) -> list[Item]:
    """`n` prompts a category of `context` token ids each, every one its own (a random-weight model
    reads no text, and what it accepts is replayed: only the lengths matter)."""
    categories = list(enumerate(CATEGORIES))
    return [Item(f"{c}-{i}", c, probe_ids(vocab, context, start=context * (i * len(categories) + j)), None)
            for i in range(n) for j, c in categories]


def replayed_speed(model: PreTrainedModel, measured: dict[str, float], n: int, context: int, max_new_tokens: int,
                   thread: ThreadPoolExecutor) -> dict:
    """`generate` (dynamic cache, static cache compiled) and ours (`REPLAYED`) on `replayed_items`, ours
    drafting the target's own greedy continuation of each (plain decoding, once) so that each step it
    accepts the tokens the replay draws from the category's `measured` tokens per forward. Each of
    ours times its own cost curve (each step has its own: the budget acts on the costs of the step
    that runs)."""
    items, notes = replayed_items(model.config.vocab_size, n, context), []
    budget = DEFAULT_DRAFT_BUDGET
    plans = {}
    for seed, item in enumerate(items):
        continuation = timed_generate(model, item.prompt_ids, max_new_tokens).token_ids
        r = continue_probability(measured[item.category] - 1, budget)
        plans[tuple(item.prompt_ids)] = Plan(continuation, r, seed, item.category)
    row_tokens = context + max_new_tokens + budget + 1
    methods = hf_methods(model, items[0], max_new_tokens, row_tokens, notes, lookup=False, compiled=True, thread=thread)
    tokenizer, on_cuda, tallies = id_tokenizer(model.config.vocab_size), model.device.type == "cuda", {}
    for name, options in REPLAYED.items():
        if name == "ours-replayed-eager" and not on_cuda:
            notes.append("ours-replayed-eager not run apart: on a CPU the engine's default (ours-replayed) is eager")
            continue
        tally = tallies[name] = Counter()
        engine = sized_engine(model, tokenizer, ReplayedAcceptanceDrafter(plans, tally), row_tokens, **options)
        engine.generate(items[0].prompt_ids, max_new_tokens=4)  # times its cost curve, untimed
        tally.clear()
        methods[name] = engine_method(engine)
        notes.append(f"{name}: {graphs_said(engine.stats())}, "
                     f"{'the fixed-shape step' if engine.stats().static_step else 'the growing cache'}")
    runs = real_weight_speed(methods, items, max_new_tokens)
    acceptance = {name: {c: {"replayed": measured[c] - 1, "steps": t[c, "steps"]}
                         | {f"{k}_per_step": t[c, k] / max(t[c, "steps"], 1) for k in ("drawn", "planned", "accepted")}
                         for c in CATEGORIES} for name, t in tallies.items()}  # fmt: skip
    return {"status": "ran", "max_new_tokens": max_new_tokens, "context": context, "notes": notes, "runs": runs,
            "table": speed_table(runs), "acceptance": acceptance}


def replayed_markdown(section: dict, dtype: torch.dtype) -> str:
    lines = [f"# Replayed acceptance: the 1.5B and 7B shapes end to end ({dtype_name(dtype)}, random weights)", "",
             "Every table here is of **replayed acceptance**: the models are Qwen2.5 shapes at random weights, and "
             "ours draft with a drafter that replays the acceptance the real Qwen2.5-Coder-1.5B-Instruct measured on "
             f"the CPU at draft budget {section['budget']} ({section['source']}: {section['measured_said']} decode "
             "tokens per forward). That file keeps each item's mean, not per-step traces, so each step's accepted "
             "count is drawn (fixed seeds) from a truncated geometric of that mean; the drafter proposes the target's "
             "own greedy continuation (plain decoding, once per prompt) for that many tokens, then wrong ones. The "
             "engine's whole loop runs for real at real shapes; only the target's agreement is replayed. "
             f"Prompts of {section['context']} token ids, {section['n']} a category.", ""]
    for arch, a in section["archs"].items():
        a = a | {"model": f"{arch}, random weights", "dtype": dtype_name(dtype)}
        lines.append(real_weights_markdown(a, f"{arch}, replayed acceptance").replace("# ", "## ", 1))
        lines += [f"Replayed against achieved ({arch}, replayed acceptance): draft tokens accepted a step, the real "
                  "1.5B's mean; the replay's draws (few steps: noisy); of them those the engine verified (its budget "
                  "may cut a draft); those the target accepted (fewer only where its choices differ from plain "
                  "decoding's, as bf16's near-ties may).", "",
                  "| engine | category | steps | the 1.5B's | drawn | verified | accepted |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for name, by_category in a.get("acceptance", {}).items():
            for c, r in by_category.items():
                lines.append(f"| {name} | {c} | {r['steps']} | {r['replayed']:.2f} | {r['drawn_per_step']:.2f} "
                             f"| {r['planned_per_step']:.2f} | {r['accepted_per_step']:.2f} |")
        lines.append("")
    return "\n".join(lines)


# --- the run: sections, files, summary -----------------------------------------------------------


@dataclass
class Check:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    results: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # SmolLM2 by dtype, loaded once for the sections that use it (or why it could not be).
    models: dict[torch.dtype, tuple[PreTrainedModel, Any, str] | str] = field(default_factory=dict)
    # generate's compiled calls: torch keeps its CUDA graph trees per thread, so all run on this one.
    thread: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=1))

    def write(self, name: str, text: str) -> None:
        (self.args.out / name).write_text(text)

    def save(self) -> None:
        """gpu_check.json as it stands: after every section, so a run cut short keeps what it measured."""
        (self.args.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str))

    def smollm(self, dtype: torch.dtype) -> tuple[PreTrainedModel, Any, str] | str:
        if dtype not in self.models:
            self.models[dtype] = load_smollm(self.args.smollm, self.device, dtype)
        return self.models[dtype]

    def items(self, n: int) -> Callable[[SpeculativeEngine], list[Item]]:
        """The first `n` dev items per category, tokenized by the engine given."""
        return lambda engine: load_items(engine, self.args.data, CATEGORIES, n)

    def guarded(self, section: str, body: Callable[[], None]) -> None:
        """Run one section; a failure (an out-of-memory 7B, a missing file) is recorded, not fatal."""
        try:
            body()
        except Exception:  # noqa: BLE001 - reported in the summary and the JSON, the next section still runs
            text = traceback.format_exc()
            log(f"{section} failed:\n{text}")
            self.results.setdefault("errors", {})[section] = text
            self.errors.append(f"{section}: {text.strip().splitlines()[-1]}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return f"{names[0] if names else platform.processor() or 'CPU'} ({os.cpu_count()} cores)"


def section_tests(check: Check) -> None:
    check.results["tests"] = run_tests(check.device, check.args.quick, check.args.out, check.args.tests_timeout)
    check.write("tests.md", tests_markdown(check.results["tests"]))


def section_forward_and_steps(check: Check) -> None:
    """Sections 2 and 3 share each random-weight model: one model in memory at a time."""
    quick = check.args.quick
    archs, contexts = (TINY_ARCHS, [32, 64]) if quick else (ARCHS, [500, 2000])
    warmup, repeats = (1, 3) if quick else (3, 7)
    costs, steps = check.results.setdefault("forward_cost", {}), check.results.setdefault("step_overhead", {})
    for arch, shape in archs.items():
        log(f"forward cost: {arch} at random weights on {check.device}")
        model = random_model(shape, check.device, check.dtype)
        costs[arch] = forward_costs(model, contexts, SIZES, warmup, repeats)
        check.write("forward_cost.md", forward_cost_markdown(costs, check.dtype, check.results["environment"]["device_name"]))
        log(f"step overhead: {arch}")
        steps[f"{arch} (random weights)"] = step_overhead_random(model, contexts[0], 16 if quick else 128)
        check.write("step_overhead.md", step_overhead_markdown(steps))
        del model
        if check.device.type == "cuda":
            torch.cuda.empty_cache()


def smollm_unavailable(check: Check, dtype: torch.dtype) -> str | None:
    """Why SmolLM2 and the dev items cannot be had, or None."""
    loaded = check.smollm(dtype)
    if isinstance(loaded, str):
        return f"skipped: {loaded}"
    return None if check.args.data.is_file() else f"skipped: no dev items at {check.args.data} (--data)"


def real_weights(check: Check, dtype: torch.dtype, key: str, n: int, full: bool) -> dict:
    """The methods on `n` dev items per category in `dtype`, into results[key]; their steps clocked into
    section 3's table."""
    section: dict = {"status": "skipped", "dtype": dtype_name(dtype)}
    check.results[key] = section
    why_not = smollm_unavailable(check, dtype)
    if why_not:
        section["note"] = why_not
        return section
    model, tokenizer, source = check.smollm(dtype)
    max_new = 16 if check.args.quick else check.args.max_new_tokens
    notes: list[str] = []
    items, methods, steps = real_weight_methods(model, tokenizer, check.items(n), max_new, notes, full=full,
                                                thread=check.thread)
    log(f"real weights ({dtype_name(dtype)}): {source}, {len(items)} items, {max_new} new tokens at most")
    compiled = compiled_graphs() if "hf-static-compiled" in methods else None
    runs = real_weight_speed(methods, items, max_new)
    if compiled is not None and compiled_graphs() > compiled:
        notes.append(f"hf-static-compiled recompiled inside timed runs: {compiled_graphs() - compiled} graphs more")
    section.update(status="ran", model=source, max_new_tokens=max_new, notes=notes, runs=runs, table=speed_table(runs))
    for name, totals in steps.items():
        row = f"SmolLM2-135M {dtype_name(dtype)}, {name}, dev items"
        check.results.setdefault("step_overhead", {})[row] = totals.as_dict()
    check.write("step_overhead.md", step_overhead_markdown(check.results["step_overhead"]))
    return section


def section_real_weights(check: Check) -> None:
    n = 1 if check.args.quick else check.args.n
    section = real_weights(check, check.dtype, "real_weights", n, full=True)
    title = "Real weights: SmolLM2-135M-Instruct on the Spec-Bench dev items"
    check.write("real_weights.md", real_weights_markdown(section, title))


def section_fp32(check: Check) -> None:
    """Greedy answers in fp32, ours with graphs and without against `generate`'s, where the main run
    was in another dtype: there a near-tie may round the other way, in fp32 nothing may differ."""
    title = "Real weights in fp32: ours against generate, token for token"
    if check.args.fp32_n == 0:
        section = check.results["real_weights_fp32"] = {"status": "skipped", "note": "skipped: --fp32-n 0"}
    elif check.dtype == torch.float32:
        note = "skipped: the real-weights section ran in fp32, its identical counts are this check"
        section = check.results["real_weights_fp32"] = {"status": "skipped", "note": note}
    else:
        section = real_weights(check, torch.float32, "real_weights_fp32", check.args.fp32_n, full=False)
    check.write("real_weights_fp32.md", real_weights_markdown(section, title))


def section_graphs(check: Check) -> None:
    """Section 5, one random-weight model in memory at a time."""
    quick = check.args.quick
    archs, contexts = (TINY_ARCHS, [32, 64]) if quick else (ARCHS, [500, 2000])
    warmup, repeats = (1, 3) if quick else (3, 10)
    copy_bytes = 2**31 if check.device.type == "cuda" and not quick else 2**24
    section = check.results["graphs"] = {"cuda": check.device.type == "cuda", "copy_bytes": copy_bytes,
                                         "bandwidth_bytes_per_s": copy_bandwidth(check.device, copy_bytes), "archs": {}}
    for arch, shape in archs.items():
        log(f"graphs: {arch} at random weights on {check.device}")
        model = random_model(shape, check.device, check.dtype)
        costs = graph_forward_costs(model, contexts, warmup, repeats)
        section["archs"][arch] = {"weight_bytes": weight_bytes(model), "contexts": costs}
        name = check.results["environment"]["device_name"]
        check.write("forward_graphs.md", graph_forward_markdown(section, check.dtype, name))
        del model
        if check.device.type == "cuda":
            torch.cuda.empty_cache()


def section_throughput(check: Check) -> None:
    args = check.args
    section: dict = {"status": "skipped", "dtype": dtype_name(check.dtype)}
    check.results["throughput"] = section
    why_not = smollm_unavailable(check, check.dtype)
    if why_not:
        section["note"] = why_not
    else:
        model, tokenizer, source = check.smollm(check.dtype)
        concurrencies, max_new = ([1, 2], 8) if args.quick else (sorted(args.concurrency), args.max_new_tokens)
        encoder = SpeculativeEngine(model, tokenizer, NGramTrieDrafter(), max_batch=1, **OURS["ours-trie-eager"])
        items = check.items(-(-max(concurrencies) // len(CATEGORIES)))(encoder)
        del encoder
        row_tokens = max(len(item.prompt_ids) for item in items) + max_new + DEFAULT_DRAFT_BUDGET + 1
        engine = sized_engine(model, tokenizer, NGramTrieDrafter(), row_tokens, max_batch=max(concurrencies),
                              prompt_cache_bytes=0)
        section.update(status="ran", model=source, max_batch=max(concurrencies), row_tokens=row_tokens,
                       max_new_tokens=max_new, graphs=graphs_said(engine.stats()))
        section["runs"] = throughput(engine, items, concurrencies, max_new)
    check.write("throughput.md", throughput_markdown(section))


def section_replayed(check: Check) -> None:
    """Section 7, one random-weight model in memory at a time."""
    args = check.args
    archs = TINY_ARCHS if args.quick else {arch: ARCHS[arch] for arch in args.replay_archs}
    n, context, max_new = (1, 32, 16) if args.quick else (args.replay_n, args.replay_context,
                                                          args.replay_max_new_tokens)
    measured = measured_acceptance(DEFAULT_DRAFT_BUDGET)
    section = check.results["replayed"] = {
        "budget": DEFAULT_DRAFT_BUDGET, "source": "benchmarks/results/acceptance_fp32.json", "context": context, "n": n,
        "measured_said": ", ".join(f"{c} {measured[c]:.2f}" for c in CATEGORIES), "archs": {},
    }  # fmt: skip
    for arch, shape in archs.items():
        log(f"replayed acceptance: {arch} at random weights on {check.device}")
        model = random_model(shape, check.device, check.dtype)
        section["archs"][arch] = replayed_speed(model, measured, n, context, max_new, check.thread)
        check.write("replayed.md", replayed_markdown(section, check.dtype))
        del model
        if check.device.type == "cuda":
            torch.cuda.empty_cache()


# Run in this order: the newest measurements first, so that a run cut short (a machine's time limit)
# has them; the tests last, bounded by --tests-timeout.
SECTIONS: dict[str, tuple[str, Callable[[Check], None]]] = {
    "replayed": ("the 1.5B and 7B shapes, replayed acceptance", section_replayed),
    "real": ("real weights", section_real_weights),
    "fp32": ("real weights in fp32", section_fp32),
    "graphs": ("forward cost, eager against CUDA graphs", section_graphs),
    "batch": ("throughput", section_throughput),
    "forward": ("forward cost / step overhead", section_forward_and_steps),
    "tests": ("tests", section_tests),
}


def summary(check: Check) -> list[str]:
    r, env = check.results, check.results["environment"]
    lines = [f"== gpu_check summary: {env['device_name']}, {env['device']}, {env['dtype']}, torch {env['torch']}, "
             f"transformers {env['transformers']}{', cuDNN attention off' if not env['cudnn_attention'] else ''} =="]
    tests = r.get("tests", {})
    if tests.get("status") == "ran":
        lines.append(f"tests: {tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, "
                     f"{tests['skipped']} skipped (exit {tests['returncode']}; tests.log)")
    elif tests:
        lines.append(f"tests: skipped ({tests['note']})")
    for arch, by_context in r.get("forward_cost", {}).items():
        parts = [f"ctx {c}: tree {m['tree'][64] / m['chain'][1]:.2f}, chain {m['chain'][64] / m['chain'][1]:.2f}"
                 + (f", lean t(1) {m['lean chain'][1] / m['chain'][1]:.2f}" if "lean chain" in m else ", no lean forward")
                 for c, m in by_context.items()]
        lines.append(f"t(64)/t(1) {arch}: " + "; ".join(parts))
    for name, s in r.get("step_overhead", {}).items():
        lines.append(f"step overhead {name}: {s['overhead_ms_per_step']:.2f} ms/step outside the forward "
                     f"(forward {s['forward_ms_per_step']:.2f} ms, {s['tokens_per_step']:.2f} tokens/step)")
    for key in ("real_weights", "real_weights_fp32"):
        real = r.get(key, {})
        if real.get("status") == "ran":
            parts = [f"{m} {g['speedup']:.2f}x" + (f" [{g['vs_compiled']:.2f}x]" if "vs_compiled" in g else "")
                     + f" {g['identical']}/{g['items']}" for m, g in ((m, t["all"]) for m, t in real["table"].items())]
            lines.append(f"{key.replace('_', ' ')} ({real['dtype']}; decode speed-up vs hf-greedy "
                         "[vs hf-static-compiled], outputs identical to its): " + ", ".join(parts))
            lines += [f"  {note}" for note in real["notes"]
                      if any(word in note for word in ("skipped", "forward", "recompiled"))]
        elif real:
            lines.append(f"{key.replace('_', ' ')}: {real.get('note', 'failed')}")
    for arch, a in r.get("replayed", {}).get("archs", {}).items():
        for m, t in ((m, t) for m, t in a["table"].items() if m.startswith("ours")):
            compiled = {c: f" [{g['vs_compiled']:.2f}x]" if "vs_compiled" in g else "" for c, g in t.items()}
            ratios = ", ".join(f"{c} {g['speedup']:.2f}x{compiled[c]}" for c, g in t.items() if c != "all")
            lines.append(f"replayed acceptance {arch}, {m} (decode vs hf-greedy [vs hf-static-compiled]): {ratios}; "
                         f"{t['all']['identical']}/{t['all']['items']} identical to hf-greedy")
    for arch, a in r.get("graphs", {}).get("archs", {}).items():
        floor = a["weight_bytes"] / r["graphs"]["bandwidth_bytes_per_s"]
        for c, m in a["contexts"].items():
            graphs = m["graphs"]
            said = "no CUDA graphs"
            if graphs:
                said = f"graphs {graphs[1] * 1e3:.2f} ms, graphs t(64)/t(1) {graphs[64] / graphs[1]:.2f}"
            lines.append(f"fixed-shape step {arch}, ctx {c}: t(1) eager {m['eager'][1] * 1e3:.2f} ms, {said}; "
                         f"weight-read floor {floor * 1e3:.3f} ms")
    batch = r.get("throughput", {})
    if batch.get("status") == "ran":
        one = batch["runs"][min(batch["runs"])]["tokens_per_s"]
        lines.append(f"throughput ({batch['graphs']}): " + ", ".join(
            f"{c} at once {t['tokens_per_s']:.1f} tok/s ({t['tokens_per_s'] / one:.2f}x)"
            for c, t in batch["runs"].items()
        ))
    elif batch:
        lines.append(f"throughput: {batch.get('note', 'failed')}")
    lines += [f"ERROR in {e}" for e in check.errors]
    lines.append("elapsed: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in r.get("elapsed_s", {}).items()))
    lines.append(f"results: {check.args.out}/ (tests.md, forward_cost.md, step_overhead.md, real_weights.md, "
                 "real_weights_fp32.md, forward_graphs.md, throughput.md, replayed.md, gpu_check.json)")
    return lines


def failed(check: Check) -> bool:
    """A crashed section, a test run that did not pass, or, in fp32, any output of ours that differs
    from greedy's (in bf16 a near-tie may round the other way, docs/design.md "Dtype", so there it is
    reported, not failed; transformers' prompt lookup is reported, never failed: not our code)."""
    tests = check.results.get("tests", {})
    fp32 = [check.results.get("real_weights_fp32", {})]
    if check.dtype == torch.float32:
        fp32 += [check.results.get("real_weights", {}), *check.results.get("replayed", {}).get("archs", {}).values()]
    differs = any(g["all"]["identical"] < g["all"]["items"]
                  for section in fp32 for m, g in section.get("table", {}).items() if m.startswith("ours"))
    return bool(check.errors or tests.get("returncode") or differs)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--quick", action="store_true", help="tiny models, the fast tests, 1 item per category, 16 new tokens")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                        help="which to run, in this order (default all): replayed (7), real, fp32 (section 4), "
                             "graphs (5), batch (6), forward (2 and 3), tests (1)")
    parser.add_argument("--smollm", type=Path, default=None,
                        help="a SmolLM2-135M-Instruct folder (config.json, tokenizer, safetensors) or its GGUF file")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--n", type=int, default=2, help="dev items per category (rag, summarization, qa)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--fp32-n", type=int, default=1,
                        help="dev items per category of the fp32 identity check, where --dtype is not fp32 (0: none)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="requests run together (section 6)")
    parser.add_argument("--replay-archs", nargs="+", choices=list(ARCHS), default=list(ARCHS),
                        help="random-weight shapes of section 7 (replayed acceptance)")
    parser.add_argument("--replay-n", type=int, default=1, help="prompts per category of section 7")
    parser.add_argument("--replay-context", type=int, default=500, help="prompt tokens of section 7's prompts")
    parser.add_argument("--replay-max-new-tokens", type=int, default=32, help="new tokens at most in section 7")
    parser.add_argument("--tests-timeout", type=int, default=300,
                        help="seconds the tests may take before they are killed")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_results"))
    parser.add_argument("--no-cudnn-attention", action="store_true",
                        help="keep torch's SDPA off cuDNN attention (torch.backends.cuda.enable_cudnn_sdp(False)), "
                             "for everything the check runs")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.no_cudnn_attention:
        # A global switch, so generate's forwards and the engine's thread both run without it.
        torch.backends.cuda.enable_cudnn_sdp(False)
    check = Check(args, device, dtype)
    check.results["environment"] = {
        "device": str(device), "device_name": device_name(device), "dtype": dtype_name(dtype), "quick": args.quick,
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "python": platform.python_version(), "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled(),
    }
    for name in [name for name in SECTIONS if name in args.sections]:
        title, run = SECTIONS[name]
        started = time.perf_counter()
        check.guarded(title, lambda: run(check))
        elapsed = check.results.setdefault("elapsed_s", {})[name] = time.perf_counter() - started
        log(f"{title}: {elapsed:.0f} s")
        check.save()
    check.thread.shutdown()
    lines = summary(check)
    check.results["summary"] = lines
    check.save()
    print("\n".join(lines), flush=True)
    return 1 if failed(check) else 0


if __name__ == "__main__":
    sys.exit(main())
