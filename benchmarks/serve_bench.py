"""The OpenAI-compatible server under 1, 2 and 4 concurrent clients, with speculation and without.

Two servers run in this process on 127.0.0.1, sharing one model's weights: "speculative" drafts from
each request's documents (the n-gram trie, plus a draft model with --draft-model), "plain" has
drafting off (draft_budget=0), so it decodes one token per forward through the same engine, kernels
and HTTP stack. Both have the prompt cache off: the same prompts are sent at every level, and a
cached prefill would favour whichever ran second. Clients are threads streaming through the
`openai` client, each sending its share of the Spec-Bench `rag` items (retrieved passages in the
prompt, the same passages as `documents`); for every level the two servers take turns, in rotating
order. Printed per setting: requests per minute, generated tokens per second, p50/p95 latency and
time to first token; the answers of the two servers are compared token for token (greedy).

    python3 benchmarks/serve_bench.py --model smollm2-135m-instruct --dtype float32 --n 8
    python3 benchmarks/serve_bench.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16 --n 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import torch
from gpu_check import device_name

from rag_speculate import SpeculativeEngine
from rag_speculate.entrypoints.engines import DTYPES, rag_drafters
from rag_speculate.models.loading import load_model
from rag_speculate.entrypoints.openai import Server
from rag_speculate.entrypoints.openai.app import create_app
from rag_speculate.entrypoints.openai.background import running

DATA = Path(__file__).resolve().parent / "data" / "spec_bench_dev.jsonl"
SETTINGS = ("speculative", "plain")


def rag_items(n: int) -> list[dict]:
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    items = [r["turns"][0] for r in rows if r["category"] == "rag"][:n]
    return [{"messages": [{"role": "user", "content": text}], "documents": text.split("\n")[:-1]} for text in items]


def engines(model: str, dtype: str, draft_model: str | None) -> dict[str, SpeculativeEngine]:
    # Two engines over one model's weights: the baseline is ours without drafting, in the same process.
    target, tokenizer = load_model(model, dtype=DTYPES[dtype], device="cpu")
    drafters = rag_drafters(target, tokenizer, draft_model=draft_model)
    return {
        "speculative": SpeculativeEngine(target, tokenizer, drafters, name=model, prompt_cache_bytes=0),
        "plain": SpeculativeEngine(target, tokenizer, draft_budget=0, name=model, prompt_cache_bytes=0),
    }


def one_request(client: openai.OpenAI, model: str, item: dict, max_tokens: int) -> dict:
    started = time.perf_counter()
    first, text, usage = None, [], None
    stream = client.chat.completions.create(
        model=model, messages=item["messages"], max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"documents": item["documents"]},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    done = time.perf_counter()
    return {"latency_s": done - started, "ttft_s": (first or done) - started, "tokens": usage.completion_tokens, "text": "".join(text)}


def run_level(url: str, model: str, items: list[dict], clients: int, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(lambda item: one_request(client, model, item, max_tokens), items))
    wall = time.perf_counter() - started
    latencies = sorted(r["latency_s"] for r in runs)
    return {
        "clients": clients, "requests": len(runs), "wall_s": wall,
        "requests_per_min": 60 * len(runs) / wall,
        "tokens_per_s": sum(r["tokens"] for r in runs) / wall,
        "p50_latency_s": statistics.median(latencies),
        "p95_latency_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
        "p50_ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "texts": [r["text"] for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--n", type=int, default=8, help="rag items sent at each level")
    parser.add_argument("--clients", default="1,2,4")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    items = rag_items(args.n)
    served = engines(args.model, args.dtype, args.draft_model)
    results: list[dict] = []
    with running(create_app(Server(served["speculative"], args.model))) as spec_url, \
            running(create_app(Server(served["plain"], args.model))) as plain_url:
        urls = {"speculative": spec_url, "plain": plain_url}
        for setting in SETTINGS:  # warm-up: first forwards, kernels, the cost curve
            run_level(urls[setting], args.model, items[:1], 1, 8)
        for turn, clients in enumerate(int(c) for c in args.clients.split(",")):
            order = SETTINGS if turn % 2 == 0 else SETTINGS[::-1]
            level = {s: run_level(urls[s], args.model, items, clients, args.max_tokens) for s in order}
            same = sum(a == b for a, b in zip(level["speculative"]["texts"], level["plain"]["texts"]))
            for setting in SETTINGS:
                row = {k: v for k, v in level[setting].items() if k != "texts"} | {"setting": setting, "identical": f"{same}/{len(items)}"}
                results.append(row)
                print(f"{setting:12s} clients={clients}  {row['requests_per_min']:6.1f} req/min  {row['tokens_per_s']:6.1f} tok/s  "
                      f"p50 {row['p50_latency_s']:6.2f} s  p95 {row['p95_latency_s']:6.2f} s  TTFT p50 {row['p50_ttft_s']:5.2f} s  "
                      f"identical {row['identical']}", flush=True)
            spec, plain = level["speculative"], level["plain"]
            print(f"{'':12s} clients={clients}  speculative/plain throughput {spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x", flush=True)
    if args.out:
        meta = {"model": args.model, "dtype": args.dtype, "draft_model": args.draft_model, "n": args.n,
                "max_tokens": args.max_tokens, "threads": args.threads, "cpu": device_name(torch.device("cpu"))}
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
