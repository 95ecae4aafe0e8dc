"""Tokens accepted per target forward at GPU-sized draft budgets, on real prompts: what speculation
can gain where a forward over many tokens costs about what one over a single token costs.

The count does not depend on the hardware, only on the model, the drafter and the budget, so it is
measured here on the CPU: the engine's cost curve is pinned flat (every forward costs the same, as
on a GPU up to a few dozen tokens), so each step verifies up to the whole budget. Every output is
compared token for token with transformers' greedy `generate`.

    python3 benchmarks/acceptance.py --n 4 --budgets 8,16,32,64 --max-new-tokens 64 \
        --out benchmarks/results/acceptance_fp32
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from spec_bench import DEFAULT_DATA, load_items

from rag_speculate import NGramTrieDrafter, SpeculativeEngine
from rag_speculate.decoding.baseline import timed_generate
from rag_speculate.decoding.budget import CostModel

CATEGORIES = ["rag", "summarization", "qa"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--n", type=int, default=4, help="items per category")
    parser.add_argument("--budgets", default="8,16,32,64")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/acceptance"))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    engine = SpeculativeEngine.from_pretrained(args.model, dtype=getattr(torch, args.dtype), device="cpu")
    items = load_items(engine, args.data, args.categories.split(","), args.n)
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = []
    for item in items:
        reference = timed_generate(engine.model, item.prompt_ids, args.max_new_tokens).token_ids
        for budget in budgets:
            ours = SpeculativeEngine(engine.model, engine.tokenizer, NGramTrieDrafter(), draft_budget=budget)
            # Flat: every draft node that may be accepted is worth verifying, as on a GPU.
            ours.cost_model = CostModel({1: 1.0, budget + 1: 1.0}, learn=False)
            result = ours.generate(item.prompt_ids, documents=item.documents, max_new_tokens=args.max_new_tokens)
            stats = result.stats
            rows.append({
                "item": item.id, "category": item.category, "budget": budget, "new_tokens": stats.new_tokens,
                # Decode only: the prefill's forward emits one token whatever the budget.
                "tokens_per_forward": (stats.new_tokens - 1) / max(stats.target_forwards - 1, 1),
                "identical": result.token_ids == reference,
            })
            print(json.dumps(rows[-1]), flush=True)
    table = markdown(rows, budgets, args.categories.split(","))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) for k, v in vars(args).items()} | {"torch": torch.__version__}
    args.out.with_suffix(".json").write_text(json.dumps({"config": config, "runs": rows}, indent=1))
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


def markdown(rows: list[dict], budgets: list[int], categories: list[str]) -> str:
    """Mean decode tokens per target forward, per category and budget; outputs identical to generate."""
    lines = ["| category | " + " | ".join(f"budget {b}" for b in budgets) + " | identical outputs |",
             "|---|" + "---|" * (len(budgets) + 1)]
    for category in categories:
        mine = [r for r in rows if r["category"] == category]
        cells = [f"{statistics.mean(r['tokens_per_forward'] for r in mine if r['budget'] == b):.2f}" for b in budgets]
        lines.append(f"| {category} | " + " | ".join(cells) + f" | {sum(r['identical'] for r in mine)}/{len(mine)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
