"""Step by step, what the combined drafter asked, each drafter's calibration, what it verified (with the
sum of the estimates the engine saw) and got accepted, how long the step took besides drafting, and
its draft-model ledger.

    python3 benchmarks/combined_trace.py --categories translation --items 161,167 \
        --datastore ~/.cache/rag-speculate/indexes/nq-qwen2.5-coder-1.5b-instruct

The last lines total, over all items, each source's verified nodes, their estimates and its
accepted tokens, for Ouroboros alone and for the combined drafter, and the combined drafter's time
per step by drafter, and how often the target took Ouroboros' draft tokens by the draft model's
probability for them (per category, Ouroboros alone). Each item is answered by
Ouroboros alone, then by the combined drafter (documents' trie, REST,
Ouroboros; int8 0.5B draft, the 1.5B target in `--dtype`), as in spec_bench.py's `ouroboros` and `combined`.
A diagnostic: it reads the combined drafter's private ledger, which no API exposes.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import time
from collections import Counter
from pathlib import Path

import torch
from spec_bench import DEFAULT_DATA, load_items, open_datastore

from rag_speculate import CombinedDrafter, NGramTrieDrafter, OuroborosDrafter, RESTDrafter, SpeculativeEngine
from rag_speculate.drafters.base import Target
from rag_speculate.drafters.ouroboros.drafter import DRAFT_SOURCE
from rag_speculate.drafters.ouroboros.int8 import int8_draft_model
from rag_speculate.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--categories", default="translation")
    parser.add_argument("--items", required=True, help="question ids, comma-separated")
    parser.add_argument("--datastore", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the target's")
    args = parser.parse_args()
    torch.set_num_threads(2)
    engine = SpeculativeEngine.from_pretrained("qwen2.5-coder-1.5b-instruct", dtype=getattr(torch, args.dtype))
    draft, draft_tokenizer = load_model("qwen2.5-coder-0.5b-instruct", dtype=torch.float32)
    draft = int8_draft_model(draft)
    store = open_datastore(args.datastore, engine.tokenizer)
    ouroboros = OuroborosDrafter(draft, draft_tokenizer)
    combined = CombinedDrafter([NGramTrieDrafter(), RESTDrafter(store), OuroborosDrafter(draft, draft_tokenizer)])
    proposing = timed(combined)  # innermost: the trace's own logging is not counted
    steps = trace(combined)
    tallies = {"ouroboros": tally(ouroboros), "combined": tally(combined)}
    judged = by_probability(ouroboros)
    combined_steps = 0
    ids = set(args.items.split(","))
    items = [it for it in load_items(engine, DEFAULT_DATA, args.categories.split(","), 10**6) if it.id in ids]
    engine.generate([1, 2, 3, 4], max_new_tokens=4)  # one-off costs, the cost curve
    for item in items:
        judged.category = item.category
        for name, drafter in (("ouroboros", ouroboros), ("combined", combined)):
            drafter.attach(Target(engine.tokenizer, engine.traits.vocab_size, engine.model.device))
            engine.drafter = drafter
            steps.clear()
            s = engine.generate(item.prompt_ids, documents=item.documents, max_new_tokens=args.max_new_tokens).stats
            if name == "combined":
                combined_steps += s.target_forwards - 1
            print(f"{item.category} {item.id} {name}: {s.new_tokens} tokens in {s.target_forwards} forwards, decode "
                  f"{s.decode_s:.2f} s, drafting {s.drafting_s:.2f} s, accepted {dict(s.accepted_tokens)}, "
                  f"{(s.decode_s - s.drafting_s) / s.target_forwards * 1000:.0f} ms per step besides drafting")
            for k, line in enumerate(steps if name == "combined" else []):
                print(f"  {k:2d} {line}")
    for name, counts in tallies.items():
        print(f"{name}, all items: verified nodes / expected tokens / accepted tokens by source: "
              + ", ".join(f"{source} {n} / {expected:.2f} / {accepted}" for source, (n, expected, accepted) in sorted(counts.items())))
    for category, rows in judged.taken.items():
        print(f"ouroboros, {category}: draft tokens the target took / judged, by the draft model's probability: "
              + ", ".join(f"{lo}-{hi} {taken}/{n}" for (lo, hi), (taken, n) in zip(itertools.pairwise(BINS), rows) if n))
    bookkeeping = proposing.pop("combined") - sum(proposing.values())
    print("combined, all items: ms per step proposing and observing, by drafter: "
          + ", ".join(f"{n} {seconds / combined_steps * 1000:.2f}" for n, seconds in proposing.items())
          + f"; the combined drafter's own merging and bookkeeping {bookkeeping / combined_steps * 1000:.2f}")


def tally(drafter) -> dict[str, list]:
    """Wraps `drafter` to count, per source, the nodes verified, their estimates and those accepted."""
    counts: dict[str, list] = {}
    observe = drafter.observe

    def counted_observe(verification):
        tree, accepted = verification.tree, set(verification.accepted_nodes)
        for i in range(len(tree)):
            entry = counts.setdefault(tree.source(i), [0, 0.0, 0])
            entry[0] += 1
            entry[1] += tree.scores[i]
            entry[2] += i in accepted
        observe(verification)

    drafter.observe = counted_observe
    return counts


BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.97, 1.0)


class _Judged:
    category = ""

    def __init__(self) -> None:
        self.taken: dict[str, list[list[int]]] = {}


def by_probability(ouroboros: OuroborosDrafter) -> _Judged:
    """Wraps `ouroboros` to count, per category and bin of the draft model's probability, its chain
    tokens the target judged (up to the first rejected) and those it took."""
    judged = _Judged()
    observe = ouroboros.observe

    def counted_observe(verification):
        tree = verification.tree
        chain = [i for i in range(len(tree)) if tree.source(i) == DRAFT_SOURCE]
        agreed = sum(tree.source(i) == DRAFT_SOURCE for i in verification.accepted_nodes)
        rows = judged.taken.setdefault(judged.category, [[0, 0] for _ in BINS[1:]])
        for j, probability in enumerate(ouroboros._chain_confidence[: min(agreed + 1, len(chain))]):
            row = rows[min(bisect.bisect_right(BINS, probability), len(BINS) - 1) - 1]
            row[0] += j < agreed
            row[1] += 1
        observe(verification)

    ouroboros.observe = counted_observe
    return judged


def timed(combined: CombinedDrafter) -> dict[str, float]:
    """Wraps `combined` and each of its drafters to sum the seconds of their propose and observe calls."""
    seconds: dict[str, float] = {}
    for drafter in (*combined.drafters, combined):
        seconds[drafter.name] = 0.0
        for method in ("propose", "observe"):
            call = getattr(drafter, method)

            def timed_call(*args, _call=call, _name=drafter.name):
                started = time.perf_counter()
                try:
                    return _call(*args)
                finally:
                    seconds[_name] += time.perf_counter() - started

            setattr(drafter, method, timed_call)
    return seconds


def trace(combined: CombinedDrafter) -> list[str]:
    """Wraps `combined` to log a line per step; returns the log."""
    steps: list[str] = []
    propose, observe = combined.propose, combined.observe
    proposed_at = 0.0

    def logged_propose(tokens, budget):
        nonlocal proposed_at
        tree = propose(tokens, budget)
        ledger = combined._ledgers[OuroborosDrafter.name]
        sizes = {n: len(p.tree) for n, p in combined._proposals.items()}
        calibrations = {n: round(l.calibration.rate, 2) for n, l in combined._ledgers.items()}
        steps.append(f"proposed {sizes} | calibration {calibrations} | ouroboros ledger: samples {ledger.samples}, "
                     f"with {ledger.with_tokens:.2f}, without {ledger.without_tokens:.2f}, own {ledger.own_tokens:.2f}, "
                     f"{ledger.propose_s * 1000:.0f} ms")
        proposed_at = time.perf_counter()
        return tree

    def logged_observe(verification):
        tree = verification.tree
        verified = Counter(tree.source(i) for i in range(len(tree)))
        expected = Counter()
        for i in range(len(tree)):
            expected[tree.source(i)] += tree.scores[i]
        accepted = Counter(tree.source(i) for i in verification.accepted_nodes)
        elapsed = time.perf_counter() - proposed_at
        verified = {source: f"{n} ({expected[source]:.2f})" for source, n in verified.items()}
        steps[-1] += f" | verified (expected tokens) {verified} in {elapsed * 1000:.0f} ms, accepted {dict(accepted)}"
        observe(verification)

    combined.propose, combined.observe = logged_propose, logged_observe
    return steps


if __name__ == "__main__":
    main()
