"""Where decode time goes, by category and method, pooled over spec_bench.py results files.

For every method whose runs count their forwards (ours, and `hf-assisted` since harness.ForwardCounter):
decode tokens per target forward after the prefill, draft forwards per target forward, drafting's
share of decode, seconds per target forward and per draft forward. Then, for `--method` against
`--base`, by aggregate decode speed: what `--method` would reach with drafting free, and how much
drafting it could afford and still be `--ratio` x `--base`.

    python3 benchmarks/decode_breakdown.py benchmarks/results/zen5_verdict_next_off0.json \
        benchmarks/results/zen5_verdict_next_off8.json --base hf-assisted:fast
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def totals(paths: list[Path]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (category, method): decode tokens and seconds, drafting seconds, target and draft forwards."""
    sums: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for path in paths:
        for run in json.loads(path.read_text())["runs"]:
            if "forward_sizes" not in run:
                continue
            s = sums[run["category"], run["method"]]
            s["tokens"] += run["decode_tokens"]
            s["decode_s"] += run["decode_s"]
            s["drafting_s"] += run.get("drafting_s") or 0.0
            s["forwards"] += sum(run["forward_sizes"].values())
            s["draft_forwards"] += sum(run.get("draft_forward_sizes", {}).values())
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="spec_bench.py results files (.json)")
    parser.add_argument("--method", default="ouroboros")
    parser.add_argument("--base", default="hf-assisted")
    parser.add_argument("--ratio", type=float, default=1.3)
    args = parser.parse_args()
    sums = totals(args.results)
    print("| category | method | decode tokens / target forward | draft forwards / target forward | drafting / decode "
          "| s / target forward | ms / draft forward |\n|---|---|---:|---:|---:|---:|---:|")
    for (category, method), s in sums.items():
        target_s = s["decode_s"] - s["drafting_s"]
        per_draft = f"{1000 * s['drafting_s'] / s['draft_forwards']:.1f}" if s["draft_forwards"] else "-"
        print(f"| {category} | {method} | {s['tokens'] / s['forwards']:.2f} | {s['draft_forwards'] / s['forwards']:.1f} "
              f"| {s['drafting_s'] / s['decode_s']:.1%} | {target_s / s['forwards']:.3f} | {per_draft} |")
    print(f"\n| category | {args.method} x {args.base}, decode tok/s | with drafting free | drafting for {args.ratio}x, s "
          "(now) | ms / draft forward for it |\n|---|---:|---:|---:|---:|")
    for category in dict.fromkeys(c for c, _ in sums):
        ours, base = sums.get((category, args.method)), sums.get((category, args.base))
        if not (ours and base):
            continue
        base_speed, target_s = base["tokens"] / base["decode_s"], ours["decode_s"] - ours["drafting_s"]
        allowed = ours["tokens"] / (args.ratio * base_speed) - target_s
        print(f"| {category} | {ours['tokens'] / ours['decode_s'] / base_speed:.2f} | {ours['tokens'] / target_s / base_speed:.2f} "
              f"| {allowed:.1f} ({ours['drafting_s']:.1f}) | {1000 * allowed / ours['draft_forwards']:.1f} |")


if __name__ == "__main__":
    main()
