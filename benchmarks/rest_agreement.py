"""How often a REST datastore's best continuation is the model's next token, by match length.

Replays the greedy answers of an earlier Spec-Bench run (no model forward): at every answer
position, the datastore is searched with the prompt plus the answer so far, and the first token
of its most frequent continuation is compared with the answer's next token. The rates are what
`RESTDrafter`'s priors (rag_speculate/drafters/rest.py) are set from.

    python3 benchmarks/rest_agreement.py --results benchmarks/results/zen5_fp32_n8.json \\
        --datastore ~/.cache/rag-speculate/indexes/nq-qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

from spec_bench import CATEGORIES, DEFAULT_DATA, load_items, open_datastore

from rag_speculate import SpeculativeEngine

LONGEST = 4  # longer matches are counted with 4, as the drafters' priors are


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, required=True, help="a spec_bench.py JSON with hf-greedy runs")
    parser.add_argument("--datastore", type=Path, required=True)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="for its tokenizer and chat template")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args()

    run = json.loads(args.results.read_text())
    answers = {r["item"]: r["tokens"] for r in run["runs"] if r["method"] == "hf-greedy"}
    engine = SpeculativeEngine.from_pretrained(args.model, draft_budget=0)
    store = open_datastore(args.datastore, engine.tokenizer)
    items = [i for i in load_items(engine, args.data, CATEGORIES, int(run["config"]["n"])) if i.id in answers]

    counts: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for item in items:
        answer = answers[item.id]
        for position in range(1, len(answer)):
            found = store.retrieve(item.prompt_ids + answer[:position])
            firsts = Counter(c[0] for c in found.continuations if c)
            if not firsts:
                continue
            best = firsts.most_common(1)[0][0]
            for key in ((item.category, min(found.match_length, LONGEST)), ("all", min(found.match_length, LONGEST))):
                counts[key][0] += best == answer[position]
                counts[key][1] += 1

    print(f"{len(items)} answers, datastore {args.datastore}\n")
    print("| category | match length | positions | agreed | rate |")
    print("|---|---:|---:|---:|---:|")
    for (category, length), (agreed, total) in sorted(counts.items(), key=lambda kv: (kv[0][0] != "all", kv[0])):
        label = f"{length}+" if length == LONGEST else str(length)
        print(f"| {category} | {label} | {total} | {agreed} | {agreed / total:.2f} |")


if __name__ == "__main__":
    main()
