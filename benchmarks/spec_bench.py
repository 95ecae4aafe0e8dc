"""Spec-Bench items: transformers' greedy and prompt-lookup decoders against ours, one process, interleaved.

    python3 benchmarks/spec_bench.py --n 4 --max-new-tokens 256 --out benchmarks/results/spec_bench

For every item the methods run back to back in a rotating order after a warm-up, so machine
noise hits all of them alike. Decode-only speed counts the tokens after the first over the time
after the first token: prefill is the same work for every method and speculation cannot touch it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rag_speculate import SpeculativeEngine

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_dev.jsonl"
CATEGORIES = ["summarization", "rag", "qa", "math_reasoning", "translation"]
METHODS = ["hf-greedy", "hf-pld", "ours"]


class FirstTokenClock(BaseStreamer):
    """Records when `generate` produced its first new token (its first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(engine: SpeculativeEngine, ids: list[int], max_new_tokens: int, **kwargs) -> dict:
    inputs = torch.tensor([ids], device=engine.model.device)
    clock = FirstTokenClock()
    started = time.perf_counter()
    with torch.inference_mode():
        out = engine.model.generate(
            inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=max_new_tokens, streamer=clock, **kwargs
        )
    ended = time.perf_counter()
    tokens = out[0, len(ids) :].tolist()
    return {"tokens": tokens, "total_s": ended - started, "decode_s": ended - (clock.first_token_at or ended), "forwards": None}


def run_ours(engine: SpeculativeEngine, ids: list[int], max_new_tokens: int, documents: list[str] | None, budget: int) -> dict:
    engine.draft_budget = budget
    started = time.perf_counter()
    result = engine.generate(ids, documents=documents, max_new_tokens=max_new_tokens)
    total = time.perf_counter() - started
    s = result.stats
    return {"tokens": result.token_ids, "total_s": total, "decode_s": s.decode_s, "forwards": s.target_forwards,
            "drafting_s": s.drafting_s, "text": result.text}


def load_items(path: Path, categories: list[str], n: int) -> list[dict]:
    items, seen = [], defaultdict(int)
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row["category"] in categories and seen[row["category"]] < n:
            seen[row["category"]] += 1
            items.append(row)
    return items


def documents_of(row: dict) -> list[str] | None:
    """What a RAG pipeline would hand the drafter: the retrieved passages (all but the question line)."""
    if row["category"] == "rag":
        return row["turns"][0].split("\n")[:-1]
    return None


def _budget(method: str, default: int) -> int:
    """`ours` drafts with the engine's default budget, `ours@B` with B nodes."""
    return int(method.split("@")[1]) if "@" in method else default


def measure(engine: SpeculativeEngine, items: list[dict], methods: list[str], max_new_tokens: int) -> list[dict]:
    runs = []
    default_budget = engine.draft_budget
    for i, row in enumerate(items):
        ids = engine.encode_prompt(row["turns"][0], chat=True)
        order = methods[i % len(methods) :] + methods[: i % len(methods)]
        for method in order:
            if method.startswith("ours"):
                out = run_ours(engine, ids, max_new_tokens, documents_of(row), _budget(method, default_budget))
            else:
                out = run_hf(engine, ids, max_new_tokens, **({"prompt_lookup_num_tokens": 10} if method == "hf-pld" else {}))
            out.update(item=row["question_id"], category=row["category"], method=method, prompt_tokens=len(ids))
            runs.append(out)
            print(f"[{i + 1}/{len(items)}] {row['category']:<15} {method:<10} {len(out['tokens']):>4} tok "
                  f"{out['total_s']:6.2f} s  decode {out['decode_s']:6.2f} s", file=sys.stderr, flush=True)
        reference = [r for r in runs[-len(methods) :] if r["method"] == "hf-greedy"]
        for r in runs[-len(methods) :]:
            r["identical"] = bool(reference) and r["tokens"] == reference[0]["tokens"]
            r["answer_found"] = _answer_found(engine, row, r["tokens"])
    return runs


def _answer_found(engine: SpeculativeEngine, row: dict, tokens: list[int]) -> bool | None:
    if row["category"] != "rag" or not row.get("reference"):
        return None
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True).lower()
    return any(answer.lower() in text for answer in row["reference"][0])


def summarize(runs: list[dict], methods: list[str]) -> dict:
    by = defaultdict(dict)
    for r in runs:
        by[(r["category"], r["item"])][r["method"]] = r
    summary = {}
    for category in dict.fromkeys(r["category"] for r in runs):
        items = [m for (c, _), m in by.items() if c == category]
        row = {}
        for method in methods:
            rs = [m[method] for m in items]
            tokens = sum(len(r["tokens"]) for r in rs)
            row[method] = {
                "e2e_tok_s": tokens / sum(r["total_s"] for r in rs),
                "decode_tok_s": sum(len(r["tokens"]) - 1 for r in rs) / sum(r["decode_s"] for r in rs),
                "identical_to_greedy": statistics.mean(r["identical"] for r in rs),
                # transformers does not report its forwards; plain greedy is 1 by definition.
                "tokens_per_forward": tokens / sum(r["forwards"] for r in rs) if rs[0]["forwards"] else None,
            }
            if rs[0].get("drafting_s") is not None:
                row[method]["drafting_share_of_decode"] = sum(r["drafting_s"] for r in rs) / sum(r["decode_s"] for r in rs)
            if category == "rag":
                row[method]["answer_found"] = statistics.mean(bool(r["answer_found"]) for r in rs)
            for base in ("hf-greedy", "hf-pld"):
                if base in methods and method != base:
                    for kind, key in (("decode", "decode_s"), ("e2e", "total_s")):
                        ratios = [m[base][key] / m[method][key] * len(m[method]["tokens"]) / len(m[base]["tokens"]) for m in items]
                        row[method][f"{kind}_speedup_vs_{base}_mean"] = statistics.mean(ratios)
                        row[method][f"{kind}_speedup_vs_{base}_median"] = statistics.median(ratios)
        summary[category] = {"items": len(items), "methods": row}
    return summary


def markdown(summary: dict, methods: list[str]) -> str:
    lines = [
        ("| category | method | e2e tok/s | decode tok/s | decode x greedy (mean / median) | decode x pld (mean / median) "
        "| tokens/forward | drafting / decode | identical to greedy | answer found |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for category, block in summary.items():
        for method in methods:
            m = block["methods"][method]

            found = f"{m['answer_found']:.0%}" if "answer_found" in m else "-"
            per_forward = f"{m['tokens_per_forward']:.2f}" if m["tokens_per_forward"] else "-"
            drafting = f"{m['drafting_share_of_decode']:.1%}" if "drafting_share_of_decode" in m else "-"
            lines.append(
                f"| {category} (n={block['items']}) | {method} | {m['e2e_tok_s']:.2f} | {m['decode_tok_s']:.2f} | {_ratio(m, 'hf-greedy')} | "
                f"{_ratio(m, 'hf-pld')} | {per_forward} | {drafting} | {m['identical_to_greedy']:.0%} | {found} |"
            )
    return "\n".join(lines)


def _ratio(method_summary: dict, base: str) -> str:
    key = f"decode_speedup_vs_{base}"
    if key + "_mean" not in method_summary:
        return "-"
    return f"{method_summary[key + '_mean']:.2f} / {method_summary[key + '_median']:.2f}"


def plot(summary: dict, methods: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(summary)
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(9, 4))
    for j, method in enumerate(methods):
        values = [summary[c]["methods"][method]["decode_tok_s"] for c in categories]
        ax.bar([i + j * width for i in range(len(categories))], values, width, label=method)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(categories))], categories)
    ax.set_ylabel("decode tokens / s")
    ax.set_title("Decode speed on Spec-Bench (higher is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--n", type=int, default=4, help="items per category")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=int, default=None, help="draft budget (default: the engine's)")
    parser.add_argument("--methods", default=",".join(METHODS), help="also ours@B: our engine with a draft budget of B")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/spec_bench"))
    parser.add_argument("--from-json", type=Path, help="only re-render the table and plot of an earlier run")
    args = parser.parse_args()
    if args.from_json:
        runs = json.loads(args.from_json.read_text())["runs"]
        methods = list(dict.fromkeys(r["method"] for r in runs))
        summary = summarize(runs, methods)
        plot(summary, methods, args.from_json.with_suffix(".png"))
        print(markdown(summary, methods))
        return

    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    engine = SpeculativeEngine.from_pretrained(args.model, dtype=getattr(torch, args.dtype), draft_budget=args.budget)
    items = load_items(args.data, args.categories.split(","), args.n)
    measure(engine, items[:1], methods, 8)  # warm-up: first calls pay one-off allocation and dispatch costs
    runs = measure(engine, items, methods, args.max_new_tokens)
    summary = summarize(runs, methods)
    table = markdown(summary, methods)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) for k, v in vars(args).items()} | {"draft_budget": engine.draft_budget, "torch": torch.__version__}
    args.out.with_suffix(".json").write_text(json.dumps({"config": config, "summary": summary, "runs": runs}, indent=1))
    args.out.with_suffix(".md").write_text(table + "\n")
    plot(summary, methods, args.out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
