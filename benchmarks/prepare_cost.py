"""What the largest request the limits accept costs before its first step: tokenizing and checking it
(`engine.prepare`) and indexing its documents (the n-gram drafter's `start`), median of a few runs,
fresh text each run so the engine's document cache does not help.

    python3 benchmarks/prepare_cost.py --runs 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import time

from rag_speculate import NGramTrieDrafter, SpeculativeEngine
from rag_speculate.drafters import DraftContext
from rag_speculate.engine.inputs import MAX_DOCUMENT_BYTES


def requests(seed: int) -> dict[str, list[str]]:
    """The shapes of request at the documents' limits: one document of random printable ASCII (the most
    tokens a byte), and 256 documents of distinct random words."""
    rng = random.Random(seed)
    ascii_text = "".join(rng.choice(string.printable[:94] + " ") for _ in range(MAX_DOCUMENT_BYTES))
    word = lambda: "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))  # noqa: E731
    words = [" ".join(word() for _ in range(150))[: MAX_DOCUMENT_BYTES // 256] for _ in range(256)]
    return {"one 256 KiB document of random ASCII": [ascii_text], "256 documents of random words": words}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    engine = SpeculativeEngine.from_pretrained(args.model, device="cpu")
    seconds: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    for run in range(args.runs):
        for shape, documents in requests(run).items():
            started = time.perf_counter()
            request = engine.prepare("Summarize the documents.", documents=documents, max_new_tokens=4)
            NGramTrieDrafter().start(DraftContext(request.prompt_ids, request.document_ids, engine.traits.vocab_size))
            seconds.setdefault(shape, []).append(time.perf_counter() - started)
            tokens[shape] = sum(map(len, request.document_ids))
    for shape, times in seconds.items():
        print(f"{shape}: {tokens[shape]} tokens, prepared and indexed in {statistics.median(times):.2f} s (median of {len(times)})")


if __name__ == "__main__":
    main()
