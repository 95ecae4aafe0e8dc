"""Retrieval-fed RAG: real Natural Questions queries against the shipped NQ corpus, top-k chunks in
the prompt and in the drafters; transformers' decoders against ours, interleaved (see harness.py).

    python3 benchmarks/rag_bench.py --n 4 --max-new-tokens 128 --out benchmarks/results/rag_bench_fp32

The corpus index (MiniLM embeddings, FAISS, REST datastore over all 2,600 passages) is the one
`rag-speculate demo` builds, kept in the model cache. Questions are every `len/n`-th of the file,
never chosen by their results. After the timed runs, a replay (harness.replay) measures how the
REST datastore's size changes tokens per forward, the paper's Table 2 here: datastores over the
first 10%, 30% and 100% of the passages, and all of them plus earlier outputs of this project's
benchmarks (`--earlier-outputs`, runs of other prompts), each replayed against the same greedy outputs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from harness import Item, build_methods, measure, replay
from spec_bench import write

from rag_speculate import Datastore, RESTDrafter, SpeculativeEngine
from rag_speculate.entrypoints.cli import DEFAULT_MODEL
from rag_speculate.entrypoints.prompt import prepare
from rag_speculate.files.cache import cache_dir
from rag_speculate.retrieval.corpus import CorpusIndex
from rag_speculate.retrieval.nq import nq_documents, nq_questions

METHODS = ["hf-greedy", "hf-pld", "trie", "rest", "trie+rest"]
SIZES = (0.1, 0.3, 1.0)


def load_items(engine: SpeculativeEngine, index: CorpusIndex, n: int, k: int) -> list[Item]:
    questions = nq_questions()
    items = []
    for number in range(0, len(questions), len(questions) // n)[:n]:
        question = questions[number]
        chunks = index.search(question.question, k)
        request = prepare(engine, question.question, chunks=chunks, max_new_tokens=1).request
        items.append(Item(f"nq-{number}", "nq-rag", request.prompt_ids, request.document_ids, question.answers))
    return items


def datastore_sizes(engine: SpeculativeEngine, items: list[Item], runs: list[dict], earlier: Path | None) -> list[dict]:
    """Replayed tokens per forward of REST (and trie + REST) as the datastore grows."""
    tokenizer = engine.tokenizer
    passages = tokenizer([d.text for d in nq_documents()], add_special_tokens=False)["input_ids"]
    greedy = {r["item"]: r["tokens"] for r in runs if r["method"] == "hf-greedy"}
    stores = {f"NQ {fraction:.0%}": passages[: int(len(passages) * fraction)] for fraction in SIZES}
    if earlier:
        previous = json.loads(earlier.read_text())
        if previous["config"]["model"] != engine.name:
            raise SystemExit(f"--earlier-outputs {earlier} holds another model's outputs ({previous['config']['model']})")
        outputs = [r["tokens"] for r in previous["runs"] if r["method"] == "hf-greedy"]
        stores["NQ 100% + earlier outputs"] = passages + outputs
    rows = []
    for name, documents in stores.items():
        store = Datastore.build(documents, vocab_size=engine.traits.vocab_size)
        per_forward = [replay(RESTDrafter(store), item, greedy[item.id], engine.draft_budget, engine.cost_model, engine.traits.vocab_size, tokenizer)
                       for item in items]
        rows.append({"datastore": name, "tokens": store.num_tokens, "rest_tokens_per_forward": sum(per_forward) / len(per_forward)})
        print(f"{name}: {store.num_tokens} tokens, REST {rows[-1]['rest_tokens_per_forward']:.3f} tokens/forward (replayed)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4, help="questions")
    parser.add_argument("-k", "--top-k", type=int, default=5, help="chunks retrieved per question")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--earlier-outputs", type=Path, default=None, help="a spec_bench/rag_bench .json of the same model")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rag_bench"))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    engine = SpeculativeEngine.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    index = CorpusIndex.build(nq_documents(), cache_dir() / "indexes" / f"nq-{Path(args.model).name}", tokenizer=engine.tokenizer, progress=True)
    methods = build_methods(args.methods.split(","), engine, datastore=index.datastore)
    items = load_items(engine, index, args.n, args.top_k)
    measure(items[:1], methods, 8, engine.tokenizer)  # warm-up
    runs = measure(items, methods, args.max_new_tokens, engine.tokenizer)
    sizes = datastore_sizes(engine, items, runs, args.earlier_outputs)
    write(args, engine, runs, list(methods), "Decode speed, retrieval-fed RAG over NQ (higher is better)", {"datastore_sizes": sizes})
    print("\n| datastore | tokens | REST tokens/forward (replayed) |\n|---|---|---|")
    for row in sizes:
        print(f"| {row['datastore']} | {row['tokens']:,} | {row['rest_tokens_per_forward']:.3f} |")


if __name__ == "__main__":
    main()
