"""One command for a bare CUDA machine: the tests on the GPU, forward costs, engine overhead, real-weight speed.

    python3 benchmarks/gpu_check.py --out gpu_check_results              # cuda where available, bf16
    python3 benchmarks/gpu_check.py --device cpu --quick --out /tmp/gc   # seconds, tiny models

It needs torch, transformers and numpy only (pytest for section 1, pydivsufsort for REST, a
SmolLM2-135M-Instruct folder or the packaged one for section 4; each missing piece skips its part
with a line in the summary). Runs from a checkout: the repo's source is imported, not installed.

1. tests: the CUDA test selection under RAG_SPECULATE_TEST_DEVICE=<device>, log in tests.log;
2. forward cost: the target's forward against tokens fed, tree (4D mask) and plain causal, for
   Qwen2.5-1.5B and 7B shapes at random weights (weights' values do not change a forward's time);
3. step overhead: the engine's time per decoding step outside the target's forward;
4. real weights: SmolLM2-135M-Instruct on the Spec-Bench dev items, ours against `generate`.

Each section writes a markdown table to --out, gpu_check.json holds every raw number, and the
summary is printed last on stdout (progress goes to stderr).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# No model hub on the machines this runs on: a download attempt should fail fast, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import importlib.util
import json
import platform
import re
import shlex
import statistics
import subprocess
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config

from rag_speculate import Datastore, DatastoreError, GenerationStats, NGramTrieDrafter, RESTDrafter, SpeculativeEngine
from rag_speculate.decoding.baseline import timed_generate
from rag_speculate.decoding.forward import ModelForward, TreeForward
from rag_speculate.decoding.kv_cache import keep_cache_entries, make_cache
from rag_speculate.decoding.lean_forward import lean_forward
from rag_speculate.decoding.probe import probe_ids
from rag_speculate.decoding.tree import DraftTree
from rag_speculate.models.gguf_file import dense_gguf

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
TESTS_TIMEOUT_S = 1800

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


def sync(device: torch.device) -> None:
    # CUDA runs asynchronously: without this a timer reads the kernel launches, not the work.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- 1. the tests on the device ------------------------------------------------------------


def run_tests(device: torch.device, quick: bool, out: Path) -> dict:
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
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as expired:  # a hung test must not hang the whole check
        returncode, stdout = -1, _text(expired.stdout) + f"\n[gpu_check] killed after {TESTS_TIMEOUT_S} s"
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
    or a batch's, the model's own forward or its lean one); a draft model's are not counted.
    Synchronized on CUDA, so the GPU's work is counted here and not in the read-back of the accepted
    tokens that follows it."""

    def __init__(self, engine: SpeculativeEngine):
        self.seconds: list[float] = []
        model, device = engine.model, engine.model.device
        inner = self._inner = ModelForward.logits

        def timed(forward: ModelForward, *args, **kwargs):
            if forward.model is not model:
                return inner(forward, *args, **kwargs)
            sync(device)
            started = time.perf_counter()
            output = inner(forward, *args, **kwargs)
            sync(device)
            self.seconds.append(time.perf_counter() - started)
            return output

        ModelForward.logits = timed

    def remove(self) -> None:
        ModelForward.logits = self._inner


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


def hf_method(model: PreTrainedModel, **kwargs: Any) -> Method:
    def run(item: Item, max_new_tokens: int) -> Run:
        out = timed_generate(model, item.prompt_ids, max_new_tokens, **kwargs)
        return Run(out.token_ids, out.decode_s, out.decode_tokens)

    return run


def engine_method(engine: SpeculativeEngine, totals: StepTotals | None = None) -> Method:
    """One of ours; with `totals`, its steps are clocked into them (section 3's real-weight row)."""

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


def real_weight_speed(engine: SpeculativeEngine, items: list[Item], max_new_tokens: int, notes: list[str]) -> tuple[dict, StepTotals]:
    """Every method on every item, in a rotating order per item so machine noise hits all alike.
    `engine`: ours with the trie; its steps are clocked for section 3."""
    model, tokenizer = engine.model, engine.tokenizer
    # Warm-up, on the shortest item: first calls pay one-off costs, and the engine times its forward
    # cost curve in its first generation.
    first = min(items, key=lambda item: len(item.prompt_ids))
    engine.generate(first.prompt_ids, documents=first.documents, max_new_tokens=4)
    for kwargs in ({}, {"prompt_lookup_num_tokens": 10}):
        timed_generate(model, first.prompt_ids, 4, **kwargs)
    engines = {"ours-trie": engine}
    store = nq_datastore(tokenizer)
    if isinstance(store, Datastore):
        engines["ours-trie+rest"] = rest = SpeculativeEngine(model, tokenizer, [NGramTrieDrafter(), RESTDrafter(store)])
        # One cost curve for all of ours, so they differ only in their drafters.
        rest.cost_model = engine.cost_model
        rest.generate(first.prompt_ids, documents=first.documents, max_new_tokens=4)
        notes.append(f"REST datastore: the shipped Natural Questions passages, {store.num_tokens} tokens")
    else:
        notes.append(f"ours-trie+rest skipped: {store}")
    trie_steps = StepTotals()
    methods: dict[str, Method] = {
        "hf-greedy": hf_method(model),
        "hf-pld": hf_method(model, prompt_lookup_num_tokens=10),
    } | {name: engine_method(e, trie_steps if name == "ours-trie" else None) for name, e in engines.items()}
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
    return runs, trie_steps


def speed_table(runs: dict[str, list[dict]]) -> dict[str, dict[str, dict]]:
    """{method: {category or "all": decode tokens/s over its items, ratio to hf-greedy, identical count}}."""
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
            base = table["hf-greedy"][key]["decode_tokens_per_s"]
            g["speedup"] = g["decode_tokens_per_s"] / base if base else 0.0
    return table


def real_weights_markdown(section: dict) -> str:
    lines = ["# Real weights: SmolLM2-135M-Instruct on the Spec-Bench dev items", ""]
    if section["status"] != "ran":
        return "\n".join(lines + [section["note"], ""])
    lines += [f"Model: {section['model']}; {section['max_new_tokens']} new tokens at most; decode tokens/s over all items "
              "(the tokens after the first, over the time after it); identical: token for token equal to hf-greedy's.", ""]
    lines += [f"- {note}" for note in section["notes"]] + [""]
    lines += ["| method | category | items | identical | decode tok/s | x hf-greedy |", "|---|---|---:|---:|---:|---:|"]
    for method, groups in section["table"].items():
        for key, g in groups.items():
            lines.append(f"| {method} | {key} | {g['items']} | {g['identical']}/{g['items']} | {g['decode_tokens_per_s']:.1f} | {g['speedup']:.2f} |")
    return "\n".join(lines) + "\n"


# --- the run: sections, files, summary -----------------------------------------------------------


@dataclass
class Check:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    results: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def write(self, name: str, text: str) -> None:
        (self.args.out / name).write_text(text)

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
    check.results["tests"] = run_tests(check.device, check.args.quick, check.args.out)
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


def section_real_weights(check: Check) -> None:
    args, section = check.args, {"status": "skipped"}
    check.results["real_weights"] = section
    loaded = load_smollm(args.smollm, check.device, check.dtype)
    if isinstance(loaded, str):
        section["note"] = f"skipped: {loaded}"
    elif not args.data.is_file():
        section["note"] = f"skipped: no dev items at {args.data} (--data)"
    else:
        model, tokenizer, source = loaded
        n, max_new = (1, 16) if args.quick else (args.n, args.max_new_tokens)
        engine = SpeculativeEngine(model, tokenizer, NGramTrieDrafter())
        items = load_items(engine, args.data, CATEGORIES, n)
        log(f"real weights: {source}, {len(items)} items, {max_new} new tokens at most")
        skipped = engine.traits.lean_forward.why_not
        notes = [f"the engine's target forward: the model's own ({skipped})" if skipped else "the engine's target forward: lean"]
        runs, trie_steps = real_weight_speed(engine, items, max_new, notes)
        section.update(status="ran", model=source, max_new_tokens=max_new, notes=notes, runs=runs, table=speed_table(runs))
        check.results.setdefault("step_overhead", {})["SmolLM2-135M, trie, dev items"] = trie_steps.as_dict()
        check.write("step_overhead.md", step_overhead_markdown(check.results["step_overhead"]))
    check.write("real_weights.md", real_weights_markdown(section))


SECTIONS: dict[str, tuple[str, Callable[[Check], None]]] = {
    "tests": ("tests", section_tests),
    "forward": ("forward cost / step overhead", section_forward_and_steps),
    "real": ("real weights", section_real_weights),
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
    real = r.get("real_weights", {})
    if real.get("status") == "ran":
        lines.append("real weights (decode speed-up vs hf-greedy, outputs identical to its): " + ", ".join(
            f"{m} {g['all']['speedup']:.2f}x {g['all']['identical']}/{g['all']['items']}" for m, g in real["table"].items()))
        lines += [f"  {note}" for note in real["notes"] if "skipped" in note or "forward" in note]
    elif real:
        lines.append(f"real weights: {real.get('note', 'failed')}")
    lines += [f"ERROR in {e}" for e in check.errors]
    lines.append(f"results: {check.args.out}/ (tests.md, forward_cost.md, step_overhead.md, real_weights.md, gpu_check.json)")
    return lines


def failed(check: Check) -> bool:
    """A crashed section, a test run that did not pass, or, in fp32, any output of ours that differs
    from greedy's (in bf16 a near-tie may round the other way, docs/design.md "Dtype", so there it is
    reported, not failed; transformers' prompt lookup is reported, never failed: not our code)."""
    tests, real = check.results.get("tests", {}), check.results.get("real_weights", {})
    ours = {m: g for m, g in real.get("table", {}).items() if m.startswith("ours")}
    differs = any(g["all"]["identical"] < g["all"]["items"] for g in ours.values())
    return bool(check.errors or tests.get("returncode") or (differs and check.dtype == torch.float32))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--quick", action="store_true", help="tiny models, the fast tests, 1 item per category, 16 new tokens")
    parser.add_argument("--sections", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS),
                        help="which to run (default all): tests, forward (sections 2 and 3), real (section 4)")
    parser.add_argument("--smollm", type=Path, default=None,
                        help="a SmolLM2-135M-Instruct folder (config.json, tokenizer, safetensors) or its GGUF file")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--n", type=int, default=4, help="dev items per category (rag, summarization, qa)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
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
        check.guarded(title, lambda: run(check))
    lines = summary(check)
    check.results["summary"] = lines
    (args.out / "gpu_check.json").write_text(json.dumps(check.results, indent=1, default=str))
    print("\n".join(lines), flush=True)
    return 1 if failed(check) else 0


if __name__ == "__main__":
    sys.exit(main())
