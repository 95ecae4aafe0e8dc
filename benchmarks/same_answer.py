"""Same request, same answer? Each Natural Questions prompt asked of an engine without a prompt cache,
then asked again of one with the default cache (the second time mostly from the cache), and as a
follow-up turn: how many warm answers differ from the cold ones, with the engine's CPU kernels and
with torch's (`fast_kernels=False`).

    python3 benchmarks/same_answer.py --model smollm2-135m-instruct --dtype bfloat16 --n 12
    python3 benchmarks/same_answer.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16 --n 12 --max-new-tokens 32

The prompts are what a RAG pipeline sends: a system line, the question's gold passage, the question.
"""

from __future__ import annotations

import argparse
import gzip
import json
from importlib.resources import files

import torch

from rag_speculate import SpeculativeEngine


def nq_prompts(n: int) -> list[list[dict]]:
    path = files("rag_speculate.retrieval") / "data" / "nq_open_oracle.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as rows:
        items = [json.loads(next(rows)) for _ in range(n)]
    return [
        [{"role": "system", "content": "Answer the question using the passage."},
         {"role": "user", "content": f"{item['ctxs'][0]['text']}\n\nQuestion: {item['question']}"}]
        for item in items
    ]  # fmt: skip


def differences(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, fast_kernels: bool) -> dict[str, int]:
    cold = SpeculativeEngine(model, tokenizer, fast_kernels=fast_kernels, prompt_cache_bytes=0)
    warm = SpeculativeEngine(model, tokenizer, fast_kernels=fast_kernels)
    counts = {"repeat": 0, "follow-up": 0}
    for messages in prompts:
        expected = cold.generate(messages, chat=True, max_new_tokens=max_new_tokens)
        warm.generate(messages, chat=True, max_new_tokens=max_new_tokens)  # fills the cache
        counts["repeat"] += warm.generate(messages, chat=True, max_new_tokens=max_new_tokens).token_ids != expected.token_ids
        follow_up = [*messages, {"role": "assistant", "content": expected.text}, {"role": "user", "content": "Why?"}]
        counts["follow-up"] += (
            warm.generate(follow_up, chat=True, max_new_tokens=max_new_tokens).token_ids
            != cold.generate(follow_up, chat=True, max_new_tokens=max_new_tokens).token_ids
        )
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--n", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = SpeculativeEngine.from_pretrained(args.model, dtype=getattr(torch, args.dtype), device="cpu")
    prompts = nq_prompts(args.n)
    print(f"{args.model}, {args.dtype}, {args.n} NQ prompts, {args.max_new_tokens} new tokens at most: warm answers that differ from cold ones")
    for fast, what in ((True, "the engine's CPU kernels"), (False, "torch's kernels (fast_kernels=False)")):
        counts = differences(base.model, base.tokenizer, prompts, args.max_new_tokens, fast)
        print(f"  {what}: asked again {counts['repeat']} of {args.n}, follow-up {counts['follow-up']} of {args.n}")


if __name__ == "__main__":
    main()
