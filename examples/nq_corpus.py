"""What both RAG examples share: the NQ corpus shipped in examples/data, the packaged embedding model,
the command line and the printout."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

DATA = Path(__file__).parent / "data" / "nq_passages.jsonl"
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
SYSTEM_PROMPT = "Answer the question using the passages. Reply with one short sentence."


def load_passages(limit: int | None = None) -> list[dict]:
    """Rows with `id`, `title`, `text` (a Wikipedia passage), `question` and `answers` (its gold answers)."""
    with DATA.open(encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines]
    return rows[:limit]


def parse_args(description: str, argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"packaged model, .gguf, folder or HF id (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument(
        "--question", action="append", help="ask this (repeatable); default: the first corpus questions"
    )
    parser.add_argument("--questions", type=int, default=3, help="how many corpus questions to ask without --question")
    parser.add_argument("--passages", type=int, default=None, help="index only the first N passages (default: all 300)")
    parser.add_argument("--top-k", type=int, default=3, help="passages retrieved per question")
    parser.add_argument("--max-tokens", type=int, default=64)
    return parser.parse_args(argv)


def questions(args: argparse.Namespace, passages: list[dict]) -> list[tuple[str, list[str]]]:
    """(question, gold answers) pairs: the ones asked on the command line have no gold answers."""
    if args.question:
        return [(q, []) for q in args.question]
    return [(p["question"], p["answers"]) for p in passages[: args.questions]]


def report(question: str, answer: str, sources: list[str], stats: dict, gold: list[str]) -> dict:
    """Prints what one question got besides its (streamed) answer, and returns it all."""
    drafted, accepted = sum(stats["drafted_tokens"].values()), sum(stats["accepted_tokens"].values())
    if gold:
        print(f"   gold answers: {' | '.join(gold)}")
    print(f"   sources: {'; '.join(sources)}")
    print(
        f"   {stats['new_tokens']} tokens in {stats['target_forwards']} forwards "
        f"({stats['tokens_per_forward']:.2f} tokens/forward), {accepted}/{drafted} drafted tokens accepted, "
        f"{stats['decode_tokens_per_s']:.1f} tokens/s decoding, "
        f"first token after {stats['time_to_first_token_s']:.2f} s"
    )
    return {"question": question, "answer": answer, "sources": sources, "stats": stats, "gold": gold}
