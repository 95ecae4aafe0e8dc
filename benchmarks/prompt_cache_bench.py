"""The prompt cache on second turns: time to first token and end to end, against stock `generate`
and our engine without the cache, one process, methods interleaved per item.

Two kinds of conversation, each a first turn answered by ours with the cache (it fills the cache),
then a second turn timed for every method:
- MT-bench (`benchmarks/data/mt_bench_dev.jsonl`): turn 2 sent with turn 1 and its answer in the history;
- Natural Questions: two questions whose gold passage comes from the same article; the first is
  answered over the passages the shipped index retrieves for it, the second asked as a follow-up
  over the same passages.
The first turns also price a miss: ours with an emptied cache against ours without one. "ours, disk"
is a restarted process: an engine with no memory tier, reading the blocks the cached engine wrote
through to the shared `--disk` folder (`prompt_cache_dir`).

    python3 benchmarks/prompt_cache_bench.py --n 4 --max-new-tokens 64 --out benchmarks/results/prompt_cache
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from rag_speculate import NGramTrieDrafter, SpeculativeEngine
from rag_speculate.decoding.baseline import timed_generate
from rag_speculate.entrypoints.prompt import drafting_documents, rag_messages
from rag_speculate.files.cache import cache_dir
from rag_speculate.retrieval.corpus import CorpusIndex
from rag_speculate.retrieval.nq import nq_documents, nq_questions

MT_BENCH = Path(__file__).resolve().parent / "data" / "mt_bench_dev.jsonl"
METHODS = ("generate", "ours, no cache", "ours, cache", "ours, disk")


def conversations(index: CorpusIndex, n: int) -> list[dict]:
    """n MT-bench and n NQ conversations: first-turn messages, the second user turn, drafting documents."""
    out = []
    for line in MT_BENCH.read_text(encoding="utf-8").splitlines()[:n]:
        row = json.loads(line)
        out.append({"id": f"mt-{row['question_id']}", "kind": "mt-bench", "first": [{"role": "user", "content": row["turns"][0]}],
                    "second": row["turns"][1], "documents": None})
    by_title = defaultdict(list)
    for q in nq_questions():
        by_title[q.title].append(q.question)
    pairs = [questions[:2] for title, questions in by_title.items() if title and len(questions) >= 2][:n]
    for first, second in pairs:
        chunks = index.search(first, 5)
        out.append({"id": f"nq-{first[:30]}", "kind": "nq follow-up", "first": rag_messages(first, chunks), "second": second,
                    "documents": drafting_documents(chunks)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--n", type=int, default=4, help="conversations of each kind")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prompt_cache"))
    parser.add_argument("--disk", type=Path, default=None, help="the disk tier's folder (default: a new temporary one)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    folder = args.disk or Path(tempfile.mkdtemp(prefix="prompt-cache-"))
    cached = SpeculativeEngine.from_pretrained(args.model, dtype=getattr(torch, args.dtype), device="cpu", prompt_cache_dir=folder)
    uncached = SpeculativeEngine(cached.model, cached.tokenizer, NGramTrieDrafter(), prompt_cache_bytes=0)
    restarted = SpeculativeEngine(cached.model, cached.tokenizer, NGramTrieDrafter(), prompt_cache_bytes=0, prompt_cache_dir=folder)
    index = CorpusIndex.build(nq_documents(), cache_dir() / "indexes" / f"nq-{Path(args.model).name}", tokenizer=cached.tokenizer)
    items = conversations(index, args.n)
    for engine in (cached, uncached, restarted):  # warm-up: cost curves and one-off allocations
        engine.generate([1, 2, 3, 4], max_new_tokens=4)

    rows = []
    for i, item in enumerate(items):
        # The first turn, cold in both of ours: what a miss costs against no cache at all.
        cached.prompt_cache.clear()
        first_ids = cached.encode_prompt(item["first"], chat=True)
        miss = {}
        for name, engine in _rotated([("ours, cache", cached), ("ours, no cache", uncached)], i):
            result = engine.generate(first_ids, documents=item["documents"], max_new_tokens=args.max_new_tokens)
            miss[name] = result
        answer = miss["ours, cache"].text
        second = [*item["first"], {"role": "assistant", "content": answer}, {"role": "user", "content": item["second"]}]
        second_ids = cached.encode_prompt(second, chat=True)
        cached.prompt_cache.store.flush()  # the first turn's blocks on disk, as a restarted process finds them
        runs = {}
        for name in _rotated(list(METHODS), i):
            if name == "generate":
                runs[name] = _stock(cached, second_ids, args.max_new_tokens)
            else:
                engine = {"ours, cache": cached, "ours, no cache": uncached, "ours, disk": restarted}[name]
                runs[name] = _ours(engine, second_ids, item["documents"], args.max_new_tokens)
        rows.append({"item": item["id"], "kind": item["kind"], "prompt_tokens": len(second_ids),
                     "reused": runs["ours, cache"]["reused"], "reused_from_disk": runs["ours, disk"]["reused"],
                     "miss_ttft": {k: r.stats.time_to_first_token_s for k, r in miss.items()},
                     "miss_total": {k: r.stats.time_to_first_token_s + r.stats.decode_s for k, r in miss.items()},
                     "runs": runs,
                     "warm_equals_cold": runs["ours, cache"]["tokens"] == runs["ours, disk"]["tokens"] == runs["ours, no cache"]["tokens"]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs"} | {m: {k: round(v, 3) for k, v in r.items() if k in ("ttft_s", "total_s")} for m, r in runs.items()}), flush=True)
    table = markdown(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) for k, v in vars(args).items()} | {"torch": torch.__version__}
    args.out.with_suffix(".json").write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


def _rotated(values: list, i: int) -> list:
    return values[i % len(values):] + values[: i % len(values)]


def _stock(engine: SpeculativeEngine, ids: list[int], max_new_tokens: int) -> dict:
    """transformers' `generate` as shipped: its time to the first token is its prefill's."""
    run = timed_generate(engine.model, ids, max_new_tokens)
    return {"tokens": run.token_ids, "ttft_s": run.total_s - run.decode_s, "total_s": run.total_s, "reused": 0}


def _ours(engine: SpeculativeEngine, ids: list[int], documents, max_new_tokens: int) -> dict:
    started = time.perf_counter()
    result = engine.generate(ids, documents=documents, max_new_tokens=max_new_tokens)
    total = time.perf_counter() - started
    return {"tokens": result.token_ids, "ttft_s": result.stats.time_to_first_token_s, "total_s": total,
            "reused": result.stats.cached_prompt_tokens}


def markdown(rows: list[dict]) -> str:
    """Per kind: median second-turn prompt, tokens reused, TTFT and end-to-end per method, the miss's cost."""
    lines = ["| conversations | prompt tokens | reused: memory / disk | TTFT: generate / no cache / cache / disk (s) "
             "| end to end: generate / no cache / cache / disk (s) | TTFT vs no cache: cache / disk "
             "| miss: cache vs no cache (end to end) | warm = disk = cold |",
             "|---|---|---|---|---|---|---|---|"]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]

        def med(method: str, key: str) -> float:
            return statistics.median(r["runs"][method][key] for r in mine)

        ttft = " / ".join(f"{med(m, 'ttft_s'):.2f}" for m in METHODS)
        total = " / ".join(f"{med(m, 'total_s'):.2f}" for m in METHODS)
        ratio = " / ".join(
            f'{statistics.median(r["runs"][m]["ttft_s"] / r["runs"]["ours, no cache"]["ttft_s"] for r in mine):.2f}x'
            for m in ("ours, cache", "ours, disk")
        )
        miss = statistics.median(r["miss_total"]["ours, cache"] / r["miss_total"]["ours, no cache"] for r in mine)
        lines.append(
            f"| {kind} ({len(mine)}) | {statistics.median(r['prompt_tokens'] for r in mine):.0f} | "
            f"{statistics.median(r['reused'] for r in mine):.0f} / {statistics.median(r['reused_from_disk'] for r in mine):.0f} | "
            f"{ttft} | {total} | {ratio} | {miss:.3f}x | "
            f"{sum(r['warm_equals_cold'] for r in mine)}/{len(mine)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
