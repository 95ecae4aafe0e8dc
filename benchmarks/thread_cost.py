"""What a decode step costs, by the thread that asked for the generation: one process, pinned, interleaved.

    python3 benchmarks/thread_cost.py --n 3 --max-new-tokens 64
    python3 benchmarks/thread_cost.py --model smollm2-135m-instruct --n 2     # seconds, for a quick look

Every generation runs on the engine's own thread (`rag_speculate/engine/thread.py`), whoever calls.
This runs the same rag items, the cost curve pinned (`learn=False`), no prompt cache, the order
rotated per item, through:

- `generate`: `engine.generate` from the main thread;
- `stream`: `engine.stream`, read to its end on the main thread;
- `worker-thread`: `engine.generate` from another thread (a thread pool's);
- `asyncio`: `await engine.stream(...).acollect()` in an event loop.

It prints ms per decode step (decode time over target forwards after the prefill) per way, its
ratio to `generate`, and checks that every way gave the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rag_speculate import SpeculativeEngine
from rag_speculate.decoding.result import GenerationResult
from rag_speculate.entrypoints.prompt import prepare

DATA = Path(__file__).resolve().parent / "data" / "spec_bench_dev.jsonl"


def rag_items(n: int) -> list[tuple[str, list[str]]]:
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    rag = [row["turns"][0] for row in rows if row["category"] == "rag"][:n]
    # A rag item is passages, one per line, then the question: the passages are what a pipeline retrieved.
    return [(prompt, prompt.split("\n")[:-1]) for prompt in rag]


def ways(engine: SpeculativeEngine) -> dict:
    pool = ThreadPoolExecutor(1)

    def read_deltas(request) -> GenerationResult:
        stream = engine.stream_request(request)
        for _ in stream:  # delta by delta, as a caller showing them would
            pass
        return stream.result

    return {
        "generate": lambda request: engine.stream_request(request).collect(),
        "stream": read_deltas,
        "worker-thread": lambda request: pool.submit(lambda: engine.stream_request(request).collect()).result(),
        "asyncio": lambda request: asyncio.run(engine.stream_request(request).acollect()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--n", type=int, default=3, help="rag items")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = SpeculativeEngine.from_pretrained(args.model, dtype=getattr(torch, args.dtype), prompt_cache_bytes=0)
    engine.generate("warm-up", max_new_tokens=4)  # times the cost curve once
    engine.cost_model.learn = False
    run = ways(engine)
    steps: dict[str, list[float]] = {name: [] for name in run}
    for i, (prompt, passages) in enumerate(rag_items(args.n)):
        request = prepare(engine, prompt, documents=passages, max_new_tokens=args.max_new_tokens).request
        names = list(run)[i % len(run):] + list(run)[: i % len(run)]
        tokens = {}
        for name in names:
            started = time.perf_counter()
            result = run[name](request)
            s = result.stats
            steps[name].append(1000 * s.decode_s / max(s.target_forwards - 1, 1))
            tokens[name] = result.token_ids
            print(f"item {i} {name:15s} {steps[name][-1]:7.1f} ms/step, {s.target_forwards} forwards, "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
        assert len({tuple(t) for t in tokens.values()}) == 1, f"item {i}: the ways gave different tokens"
    base = statistics.mean(steps["generate"])
    print(f"\n{'way':15s} ms per decode step (mean over {args.n} items)   x generate")
    for name, values in steps.items():
        print(f"{name:15s} {statistics.mean(values):8.1f}                               {statistics.mean(values) / base:.3f}")
    print("every way gave the same tokens on every item")


if __name__ == "__main__":
    main()
