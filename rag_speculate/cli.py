"""The `rag-speculate` command line: the only place in the library that prints."""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources
from pathlib import Path

import torch

from .engine import SpeculativeEngine
from .result import GenerationResult

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rag-speculate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="answer a real RAG question, accelerated and plain, and compare")
    demo.add_argument("--model", default=DEFAULT_MODEL, help="packaged model name, .gguf file, folder or HF id")
    demo.add_argument("--max-new-tokens", type=int, default=256)
    demo.add_argument("--question", help="your own question (with --documents)")
    demo.add_argument("--documents", type=Path, help="text file of passages separated by blank lines")
    demo.add_argument("--item", type=int, default=0, help="which shipped Natural Questions item to answer (0-4)")
    demo.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return run_demo(args)


def _progress(message: str) -> None:
    print(f"[rag-speculate] {message}", file=sys.stderr, flush=True)


def _demo_item(args: argparse.Namespace) -> tuple[str, list[str], list[str]]:
    """(question, documents, reference answers) from the options or the shipped items."""
    if args.question or args.documents:
        if not (args.question and args.documents):
            sys.exit("--question and --documents go together")
        passages = [p.strip() for p in args.documents.read_text(encoding="utf-8").split("\n\n") if p.strip()]
        return args.question, passages, []
    lines = resources.files("rag_speculate.data").joinpath("demo_rag.jsonl").read_text(encoding="utf-8").splitlines()
    if not 0 <= args.item < len(lines):
        sys.exit(f"--item must be in [0, {len(lines) - 1}]")
    item = json.loads(lines[args.item])
    return item["question"], item["documents"], item["answers"]


def run_demo(args: argparse.Namespace) -> int:
    question, documents, answers = _demo_item(args)
    _progress(f"preparing {args.model} (the first run converts the packaged GGUF once)")
    engine = SpeculativeEngine.from_pretrained(args.model, progress=_progress)
    # Spec-Bench's RAG format: the passages, one per line, then the question.
    prompt = "\n".join([*documents, question])
    ids = engine.encode_prompt(prompt, chat=True)
    _progress("warming up")
    engine.generate(ids, max_new_tokens=4)

    _progress("answering with speculative decoding")
    fast = engine.generate(ids, documents=documents, max_new_tokens=args.max_new_tokens)
    _progress("answering with plain greedy decoding (model.generate)")
    plain_ids, plain_s = _plain_greedy(engine, ids, args.max_new_tokens)

    print(f"Question: {question}\n")
    print(f"Answer (speculative):\n{fast.text}\n")
    _print_stats(fast)
    fast_s = fast.stats.prefill_s + fast.stats.decode_s
    print(f"\nPlain greedy: {len(plain_ids)} tokens in {plain_s:.2f} s ({len(plain_ids) / plain_s:.2f} tok/s)")
    print(f"Speculative:  {fast.stats.new_tokens} tokens in {fast_s:.2f} s ({fast.stats.new_tokens / fast_s:.2f} tok/s)")
    print(f"Speed-up: {plain_s / fast_s:.2f}x, identical output: {plain_ids == fast.token_ids}")
    if answers:
        found = any(a.lower() in fast.text.lower() for a in answers)
        print(f"Reference answer{'s' if len(answers) > 1 else ''}: {answers} (found in the answer: {found})")
    return 0


def _plain_greedy(engine: SpeculativeEngine, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    inputs = torch.tensor([ids], device=engine.model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = engine.model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(ids) :].tolist(), time.perf_counter() - started


def _print_stats(result: GenerationResult) -> None:
    s = result.stats
    print(f"Stats: {s.new_tokens} new tokens from a {s.prompt_tokens}-token prompt in {s.target_forwards} target forwards "
          f"({s.tokens_per_forward:.2f} tokens/forward, {s.verification} verification)")
    print(f"  drafted {dict(s.drafted_tokens)}, accepted {dict(s.accepted_tokens)}")
    print(f"  time to first token {s.time_to_first_token_s:.2f} s, prefill {s.prefill_s:.2f} s, "
          f"decode {s.decode_s:.2f} s ({s.decode_tokens_per_s:.2f} tok/s), drafting {s.drafting_s * 1000:.1f} ms")
    print(f"  finish reason: {result.finish_reason}")


if __name__ == "__main__":
    sys.exit(main())
