"""Build, save, load and retrieval cost of the REST datastore.

Corpora: random token ids with a Zipf distribution (exponent 1.1) over a 151,936-id vocabulary
(Qwen's), cut into documents of 100-2,000 tokens, at each of `--sizes`; and, with `--texts`, the
real token ids of a JSONL file's texts under `--tokenizer`. Prints a markdown table.

- build: from lists of Python ints (what a tokenizer returns) to the finished index, in a fresh
  process. Peak memory, per token: the growth of that process's ru_maxrss over the build, its
  high-water mark first reset to the current resident set (Linux: /proc/self/clear_refs); and the
  peak of a second build under tracemalloc, which also counts memory the allocator reused.
- load: `Datastore.load` of the saved folder (memory-mapped), without and with sha256 verification.
- retrieval: `RESTDrafter.propose` (retrieval, frequency trie, top-`budget` selection) on the
  loaded datastore, for contexts copied from the corpus (long matches, few occurrences) and fresh
  contexts drawn from the same distribution (short matches, many occurrences, `max_matches` read):
  wall-clock p50 and p99, and the p99 of the thread's CPU time, which other processes cannot
  inflate by preempting the benchmark on a shared machine.

    python benchmarks/datastore_bench.py --sizes 1000000 10000000
    python benchmarks/datastore_bench.py --sizes 1000000 --texts corpus.jsonl --tokenizer path/to/model
    python benchmarks/datastore_bench.py --sizes 1000000 10000000 --nq --tokenizer smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import resource
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from rag_speculate import Datastore, RESTDrafter

QWEN_VOCAB = 151_936
CONTEXT_TOKENS = 32


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000], help="Zipf corpus sizes in tokens"
    )
    parser.add_argument("--vocab", type=int, default=QWEN_VOCAB)
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the random corpora")
    parser.add_argument("--texts", type=Path, help="JSONL (or .jsonl.gz) of real texts to tokenize and index too")
    parser.add_argument("--text-field", default="text", help="field of each JSONL record holding its text")
    parser.add_argument("--nq", action="store_true", help="index the shipped NQ passages (rag_speculate/retrieval/nq.py) too")
    parser.add_argument("--tokenizer", help="local tokenizer folder or packaged model name, for --texts and --nq")
    parser.add_argument("--queries", type=int, default=1000, help="timed proposals per context kind")
    parser.add_argument("--budget", type=int, default=16, help="draft budget of each proposal")
    parser.add_argument("--max-matches", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class ZipfTokens:
    """Token ids whose frequency falls as 1 / rank ** exponent, frequent ids spread over the vocabulary."""

    def __init__(self, vocab: int, exponent: float, rng: np.random.Generator):
        weights = 1.0 / np.arange(1, vocab + 1) ** exponent
        self.cdf = np.cumsum(weights / weights.sum())
        self.ids = rng.permutation(vocab).astype(np.int32)

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        return self.ids[np.minimum(np.searchsorted(self.cdf, rng.random(count)), len(self.ids) - 1)]


def document_lengths(total: int, rng: np.random.Generator) -> np.ndarray:
    lengths = rng.integers(100, 2001, size=total // 100 + 1)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), total) + 1]
    lengths[-1] -= lengths.sum() - total
    return lengths[lengths > 0]


def read_texts(path: Path, field: str) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        return [json.loads(line)[field] for line in lines if line.strip()]


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_build(tokens_file: str, lengths_file: str, vocab: int, store: str) -> dict:
    """In a fresh process: build from Python lists, then save."""
    # Memory-mapped, so reading the corpus leaves no freed heap block behind to blur the measure.
    tokens = np.load(tokens_file, mmap_mode="r")
    documents = [chunk.tolist() for chunk in np.split(tokens, np.cumsum(np.load(lengths_file))[:-1])]
    del tokens
    import pydivsufsort  # noqa: F401  (its shared libraries are a fixed cost, not a per-token one)

    # Start the high-water mark at the current resident set: the imports' transient peak is not the build's.
    Path("/proc/self/clear_refs").write_text("5")
    before = max_rss_bytes()
    started = time.perf_counter()
    datastore = Datastore.build(documents, vocab_size=vocab)
    built = time.perf_counter()
    peak = max_rss_bytes() - before
    datastore.save(store)
    saved = time.perf_counter()
    # Again under tracemalloc, which counts allocations whether or not the allocator had to ask
    # the system for them (small builds fit in memory the process already holds).
    del datastore
    tracemalloc.start()
    Datastore.build(documents, vocab_size=vocab)
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"build_s": built - started, "save_s": saved - built, "peak_bytes": peak, "traced_bytes": traced}


def percentiles_ms(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e3, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3


def time_proposals(drafter: RESTDrafter, contexts: list[list[int]], budget: int) -> str:
    """Wall-clock p50 / p99 and thread CPU time p99 of one proposal, in ms."""
    for context in contexts[:20]:
        drafter.propose(context, budget)
    wall, cpu = [], []
    for context in contexts:
        started, started_cpu = time.perf_counter(), time.thread_time()
        drafter.propose(context, budget)
        wall.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - started_cpu)
    (p50, p99), (_, cpu_p99) = percentiles_ms(wall), percentiles_ms(cpu)
    return f"{p50:.3f} / {p99:.3f} / {cpu_p99:.3f}"


def corpus_contexts(tokens: np.ndarray, lengths: np.ndarray, count: int, rng: np.random.Generator) -> list[list[int]]:
    """Windows of the corpus that end before a document's last token, so a continuation exists."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    usable = np.flatnonzero(lengths > CONTEXT_TOKENS + 1)
    out = []
    for doc in rng.choice(usable, size=count):
        end = starts[doc] + rng.integers(CONTEXT_TOKENS, lengths[doc] - 1)
        out.append(tokens[end - CONTEXT_TOKENS : end].tolist())
    return out


def run_corpus(
    name: str, tokens: np.ndarray, lengths: np.ndarray, vocab: int, fresh_contexts: list[list[int]], args
) -> dict:
    rng = np.random.default_rng(args.seed + 1)
    with tempfile.TemporaryDirectory() as folder:
        np.save(f"{folder}/tokens.npy", tokens)
        np.save(f"{folder}/lengths.npy", lengths)
        store = f"{folder}/store"
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            build = pool.apply(measure_build, (f"{folder}/tokens.npy", f"{folder}/lengths.npy", vocab, store))
        load_times = {}
        for verify in (False, True):
            started = time.perf_counter()
            datastore = Datastore.load(store, verify=verify)
            load_times[verify] = time.perf_counter() - started
        disk = sum(f.stat().st_size for f in Path(store).iterdir())
        drafter = RESTDrafter(datastore, max_matches=args.max_matches)
        copied_times = time_proposals(drafter, corpus_contexts(tokens, lengths, args.queries, rng), args.budget)
        fresh_times = time_proposals(drafter, fresh_contexts, args.budget)
    n = len(tokens)
    return {
        "corpus": name,
        "tokens": f"{n:,}",
        "build s": f"{build['build_s']:.2f}",
        "build Mtok/s": f"{n / build['build_s'] / 1e6:.2f}",
        "peak B/tok maxrss / tracemalloc": f"{build['peak_bytes'] / n:.1f} / {build['traced_bytes'] / n:.1f}",
        "save s": f"{build['save_s']:.2f}",
        "disk B/tok": f"{disk / n:.2f}",
        "load ms": f"{load_times[False] * 1e3:.1f}",
        "load+sha256 ms": f"{load_times[True] * 1e3:.0f}",
        "copied ctx ms p50 / p99 / cpu p99": copied_times,
        "fresh ctx ms p50 / p99 / cpu p99": fresh_times,
    }


def print_table(rows: list[dict]) -> None:
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        print("| " + " | ".join(row[c] for c in columns) + " |")


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(args.seed)
    zipf = ZipfTokens(args.vocab, args.zipf, rng)
    fresh = [zipf.sample(CONTEXT_TOKENS, rng).tolist() for _ in range(args.queries)]
    rows = []
    for size in args.sizes:
        tokens, lengths = zipf.sample(size, rng), document_lengths(size, rng)
        rows.append(run_corpus(f"Zipf {args.zipf}", tokens, lengths, args.vocab, fresh, args))
    corpora = real_corpora(args)
    tokenizer = load_tokenizer(args.tokenizer) if corpora else None
    for name, texts in corpora:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        tokens = np.fromiter((t for doc in ids for t in doc), dtype=np.int32)
        lengths = np.array([len(doc) for doc in ids])
        # Unigram draws from the corpus: real token frequencies in sequences it does not hold.
        fresh = [tokens[rng.integers(0, len(tokens), CONTEXT_TOKENS)].tolist() for _ in range(args.queries)]
        rows.append(run_corpus(name, tokens, lengths[lengths > 0], len(tokenizer), fresh, args))
    print_table(rows)


def real_corpora(args) -> list[tuple[str, list[str]]]:
    corpora = []
    if args.texts:
        corpora.append((args.texts.name, read_texts(args.texts, args.text_field)))
    if args.nq:
        from rag_speculate.retrieval.nq import nq_documents

        corpora.append(("NQ passages (shipped)", [d.text for d in nq_documents()]))
    if corpora and not args.tokenizer:
        raise SystemExit("--texts and --nq need --tokenizer")
    return corpora


def load_tokenizer(name: str):
    from rag_speculate.models.packaged import is_packaged_model, load_packaged_model

    if is_packaged_model(name):
        import torch

        return load_packaged_model(name, dtype=torch.float32)[1]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, local_files_only=True)


if __name__ == "__main__":
    main()
