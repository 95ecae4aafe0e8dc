"""Many users at once, in process: 1, 2, 4 and 8 concurrent clients (threads calling `generate`), three
engines on one model's weights taking turns at every level:

- "speculative batched": drafting from each request's documents and prompt (the n-gram trie), the
  generations in flight verified together in one forward per step (continuous batching);
- "plain batched": the same batching with drafting off (`draft_budget=0`): one token per row per forward;
- "one at a time": speculative, `max_batch=1`, one generation after another (the engine before batching).

Workloads: `rag` (the Spec-Bench rag items: about 700 prompt tokens, short answers), `mt-bench`
(the second turns of the MT-bench conversations, with turn 1 and its answer already in each
engine's prompt cache: decoding-bound) and `summarization`. Printed per workload, level and engine:
generated tokens per second over the level's wall time, p50 and p95 latency and time to first
token (both from the request, queue included); every answer is compared token for token with the
one-at-a-time answer (greedy).

    python3 benchmarks/batch_bench.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16 --n 8 \\
        --out benchmarks/results/batching_qwen15b
    python3 benchmarks/batch_bench.py --model smollm2-135m-instruct --dtype float32 --n 8 --clients 1 2 4 8
    python3 benchmarks/batch_bench.py --dtype float32 --quantization int8 --n 4 --clients 1 4 --workloads mt-bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from gpu_check import device_name

from rag_speculate import NGramTrieDrafter, SpeculativeEngine
from rag_speculate.decoding.result import GenerationResult

DATA = Path(__file__).resolve().parent / "data"
ENGINES = ("speculative batched", "plain batched", "one at a time")
WORKLOADS = ("rag", "mt-bench", "summarization")


def items(workload: str, n: int) -> list[dict]:
    """Each item: the measured request's messages and documents, and for mt-bench the first turn to warm with."""
    if workload == "mt-bench":
        rows = [json.loads(line) for line in (DATA / "mt_bench_dev.jsonl").read_text(encoding="utf-8").splitlines()[:n]]
        return [{"first": [{"role": "user", "content": r["turns"][0]}], "second": r["turns"][1], "documents": None} for r in rows]
    rows = [json.loads(line) for line in (DATA / "spec_bench_dev.jsonl").read_text(encoding="utf-8").splitlines()]
    texts = [r["turns"][0] for r in rows if r["category"] == workload][:n]
    # A rag item is passages, one per line, then the question: the passages are what a pipeline retrieved.
    return [{"messages": [{"role": "user", "content": t}], "documents": t.split("\n")[:-1] if workload == "rag" else None} for t in texts]


def build(model: str, dtype: torch.dtype, max_batch: int, quantization: str | None = None) -> dict[str, SpeculativeEngine]:
    base = SpeculativeEngine.from_pretrained(model, dtype=dtype, device="cpu", max_batch=1, quantization=quantization)
    m, tokenizer = base.model, base.tokenizer
    engines = {
        "speculative batched": SpeculativeEngine(m, tokenizer, NGramTrieDrafter(), name=model, max_batch=max_batch),
        "plain batched": SpeculativeEngine(m, tokenizer, draft_budget=0, name=model, max_batch=max_batch),
        "one at a time": SpeculativeEngine(m, tokenizer, NGramTrieDrafter(), name=model, max_batch=1),
    }
    for engine in engines.values():
        engine.generate("warm-up", max_new_tokens=4)  # the cost curve, one-off allocations
    return engines


def warm(engines: dict[str, SpeculativeEngine], batch: list[dict], max_new_tokens: int) -> None:
    """mt-bench: turn 1 answered by each engine, into its prompt cache (once, for every level)."""
    for item in batch:
        if "first" in item:
            item["answers"] = {name: e.generate(item["first"], chat=True, max_new_tokens=max_new_tokens).text for name, e in engines.items()}


def messages(item: dict, name: str, clients: int) -> list[dict]:
    if "first" not in item:
        return item["messages"]
    # Each level asks its own second turn (its number at the end), so only turn 1 is cached, at every level.
    second = f"{item['second']}\n\n(Reply {clients}.)"
    return [*item["first"], {"role": "assistant", "content": item["answers"][name]}, {"role": "user", "content": second}]


def level(engine: SpeculativeEngine, name: str, batch: list[dict], clients: int, max_new_tokens: int) -> tuple[dict, list[GenerationResult]]:
    def ask(item: dict) -> tuple[GenerationResult, float]:
        started = time.perf_counter()
        result = engine.generate(messages(item, name, clients), chat=True, documents=item["documents"], max_new_tokens=max_new_tokens)
        return result, time.perf_counter() - started

    if not any("first" in item for item in batch):
        engine.prompt_cache.clear()  # every level prefills its prompts whole, as the first did
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(ask, batch))
    wall = time.perf_counter() - started
    results = [r for r, _ in done]
    latencies = sorted(s for _, s in done)
    first = sorted(r.stats.time_to_first_token_s for r in results)
    tokens = sum(r.stats.new_tokens for r in results)
    return {
        "tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens,
        "p50_s": statistics.median(latencies), "p95_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
        "ttft_p50_s": statistics.median(first), "ttft_p95_s": first[min(len(first) - 1, round(0.95 * (len(first) - 1)))],
        "batch_max": max((b for r in results for b in r.stats.batch_sizes), default=1),
        "tokens_per_forward": sum(r.stats.tokens_per_forward for r in results) / len(results),
    }, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--n", type=int, default=8, help="items per workload")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", choices=["int8", "int4", "gguf"], default=None, help="the target's linear layers (from_pretrained's option)")
    parser.add_argument("--out", type=Path, default=None, help="write NAME.json and NAME.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = build(args.model, getattr(torch, args.dtype), args.max_batch, args.quantization)
    title = (f"{args.model}{', ' + args.quantization if args.quantization else ''}, {args.dtype}, {device_name(torch.device('cpu'))}, {args.threads} threads, "
             f"{args.n} items per workload, {args.max_new_tokens} new tokens at most")
    table = [title, "",
             "| workload | clients | engine | tokens/s | x one at a time | p50 latency s | p95 latency s | p50 TTFT s | p95 TTFT s | largest batch | identical |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    saved = []
    for workload in args.workloads:
        batch = items(workload, args.n)
        warm(engines, batch, args.max_new_tokens)
        for rotation, clients in enumerate(args.clients):
            order = ENGINES[rotation % 3 :] + ENGINES[: rotation % 3]  # taking turns, in rotating order
            rows, answers = {}, {}
            for name in order:
                rows[name], results = level(engines[name], name, batch, clients, args.max_new_tokens)
                answers[name] = [r.token_ids for r in results]
            for name in ENGINES:
                row = rows[name]
                same = sum(a == b for a, b in zip(answers[name], answers["one at a time"]))
                ratio = row["tokens_per_s"] / rows["one at a time"]["tokens_per_s"]
                table.append(f"| {workload} | {clients} | {name} | {row['tokens_per_s']:.2f} | {ratio:.2f} | {row['p50_s']:.1f} | "
                             f"{row['p95_s']:.1f} | {row['ttft_p50_s']:.1f} | {row['ttft_p95_s']:.1f} | {row['batch_max']} | {same}/{len(batch)} |")  # fmt: skip
                saved.append({"workload": workload, "clients": clients, "engine": name, "identical": same, **row})
                print(table[-1], flush=True)
    print("\n".join(table))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "rows": saved}, indent=1))
        args.out.with_suffix(".md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
