"""Spec-Bench items: transformers' decoders against ours, one process, interleaved (see harness.py).

    python3 benchmarks/spec_bench.py --n 1 --max-new-tokens 256 --out benchmarks/results/spec_bench_fp32
    python3 benchmarks/spec_bench.py --n 8 --max-new-tokens 64 --dtype bfloat16 \
        --draft-model qwen2.5-coder-0.5b-instruct --draft-int8 --datastore DIR \
        --methods hf-greedy:fast,hf-assisted,hf-assisted:fast,ouroboros,combined \
        --bases hf-greedy:fast,hf-assisted,hf-assisted:fast,ouroboros --out benchmarks/results/NAME
    python3 benchmarks/spec_bench.py --from-json A.json --from-json B.json --bases hf-greedy:fast,ouroboros   # pooled

`rag` items hand their passages to the drafters as documents; the other categories have none.
`--datastore` (a folder written by `rag-speculate index`, or a saved REST datastore) enables the
`rest`, `trie+rest` and (with a draft model) `combined` methods.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from harness import (
    BASELINES,
    Item,
    build_methods,
    markdown,
    measure,
    plot,
    reference_costs,
    renamed,
    summarize,
    with_modeled,
)

from rag_speculate import Datastore, SpeculativeEngine
from rag_speculate.drafters.ouroboros.int8 import int8_draft_model
from rag_speculate.models.loading import load_model
from rag_speculate.quantization import METHODS as QUANTIZATIONS

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "spec_bench_dev.jsonl"
CATEGORIES = ["summarization", "rag", "qa", "math_reasoning", "translation"]
METHODS = ["hf-greedy", "hf-pld", "trie"]


def load_items(engine: SpeculativeEngine, path: Path, categories: list[str], n: int, offset: int = 0) -> list[Item]:
    items, seen = [], defaultdict(int)
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row["category"] in categories and seen[row["category"]] < offset + n:
            seen[row["category"]] += 1
            if seen[row["category"]] <= offset:
                continue
            prompt = row["turns"][0]
            # A rag item is passages, one per line, then the question: the passages are what a pipeline retrieved.
            documents = prompt.split("\n")[:-1] if row["category"] == "rag" else None
            answers = row["reference"][0] if row["category"] == "rag" and row.get("reference") else []
            items.append(Item(str(row["question_id"]), row["category"], engine.encode_prompt(prompt, chat=True), documents, answers))
    return items


def open_datastore(path: Path | None, tokenizer) -> Datastore | None:
    if path is None:
        return None
    # An index folder holds its datastore in `datastore/`.
    folder = path / "datastore" if (path / "manifest.json").is_file() else path
    return Datastore.load(folder, tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--n", type=int, default=4, help="items per category")
    parser.add_argument("--offset", type=int, default=0, help="skip the first items of each category (to run items another run did not)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft-model", default=None, help="for hf-assisted, ouroboros and combined")
    parser.add_argument("--draft-int8", action="store_true",
                        help="the draft model computes in int8 (int8_draft_model in rag_speculate/drafters/ouroboros/int8.py), for every method that uses it")
    parser.add_argument("--draft-quantization", choices=QUANTIZATIONS, default=None,
                        help="the draft model's linear layers quantized as from_pretrained's quantization= does them "
                             "(int8 or 4-bit weights, or a GGUF file's own tensors), instead of --draft-int8")
    parser.add_argument("--datastore", type=Path, default=None, help="for rest, trie+rest and combined")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every method per item, back to back; the summary keeps each method's median run per item")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/spec_bench"))
    parser.add_argument("--from-json", type=Path, action="append",
                        help="only re-render the table (and, for one file, the plot) of an earlier run; repeat to pool runs over other items")
    parser.add_argument("--bases", default=",".join(BASELINES),
                        help="methods the table divides by, where run (with --from-json e.g. `trie,ouroboros` to compare ours)")
    parser.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                        help="with --from-json: method OLD counts as NEW (runs that named the same code differently); "
                             "in a file with both, OLD's results replace NEW's")
    args = parser.parse_args()
    title = "Decode speed on Spec-Bench (higher is better)"
    if args.rename and not args.from_json:
        raise SystemExit("--rename renames methods of saved runs: it needs --from-json")
    if args.from_json:
        renames = _assignments(args.rename, "--rename", "OLD=NEW")
        runs = []
        for path in args.from_json:
            saved = json.loads(path.read_text())
            # Each run's modeled time from its own file's pinned curves.
            runs += renamed(with_modeled(saved["runs"], saved.get("reference_costs")), renames)
        methods = list(dict.fromkeys(r["method"] for r in runs))
        bases = args.bases.split(",")
        summary = summarize(runs, methods, bases)
        if len(args.from_json) == 1:
            plot(summary, methods, args.from_json[0].with_suffix(".png"), title)
        print(markdown(summary, methods, bases))
        return

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    engine = SpeculativeEngine.from_pretrained(args.model, dtype=dtype)
    if args.draft_int8 and args.draft_quantization:
        raise SystemExit("--draft-int8 and --draft-quantization are two ways to quantize the draft model: pass one")
    draft = load_model(args.draft_model, dtype=dtype, quantization=args.draft_quantization) if args.draft_model else None
    if draft and args.draft_int8:
        draft = (int8_draft_model(draft[0]), draft[1])
    methods = build_methods(args.methods.split(","), engine, datastore=open_datastore(args.datastore, engine.tokenizer), draft=draft)
    items = load_items(engine, args.data, args.categories.split(","), args.n, args.offset)
    measure(items[:1], methods, 8, engine.tokenizer)  # warm-up: first calls pay one-off allocation and dispatch costs
    costs = reference_costs(engine, draft[0] if draft else None)
    runs = measure(items, methods, args.max_new_tokens, engine.tokenizer, args.repeats)
    write(args, engine, runs, list(methods), title, {"reference_costs": costs}, bases=args.bases.split(","))


def _assignments(values: list[str], flag: str, form: str) -> dict[str, str]:
    if any("=" not in v for v in values):
        raise SystemExit(f"{flag} takes {form}, got {values}")
    return dict(v.split("=", 1) for v in values)


def write(args: argparse.Namespace, engine: SpeculativeEngine, runs: list[dict], methods: list[str], title: str,
          extra: dict | None = None, bases: Sequence[str] = BASELINES) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) for k, v in vars(args).items()} | {"draft_budget": engine.draft_budget, "torch": torch.__version__}
    saved = {"config": config, "runs": runs, **(extra or {})}
    # The runs first: they took the time, and --from-json can summarize them again.
    args.out.with_suffix(".json").write_text(json.dumps(saved, indent=1))
    summary = summarize(with_modeled(runs, (extra or {}).get("reference_costs")), methods, bases)
    table = markdown(summary, methods, bases)
    args.out.with_suffix(".json").write_text(json.dumps({"config": config, "summary": summary, **saved}, indent=1))
    args.out.with_suffix(".md").write_text(table + "\n")
    plot(summary, methods, args.out.with_suffix(".png"), title)
    print(table)


if __name__ == "__main__":
    main()
