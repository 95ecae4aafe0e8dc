"""What every decoding benchmark shares: the methods, the interleaved runs, the summary table and plot.

A method turns (prompt ids, drafting documents, max new tokens) into a run: the tokens, the
wall-clock time, the decode-only time and, for ours, the target forwards. For every item the
methods run back to back in a rotating order, so machine noise hits all of them alike. Decode-only
speed counts the tokens after the first step over the time after it: prefill is the same work for
every method. The first step is one token, except in transformers' assisted generation, which
verifies its first draft inside the prefill forward (up to 14 of 64 tokens here): those tokens
came with the prefill, not in decode time. Runs also count their forwards by size, so
decode time can be modeled from cost curves pinned at the start (`modeled_decode_s`): wall-clock
ratios show what a user gets, modeled ratios price the same forwards at a speed that does not drift.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rag_speculate import (
    Datastore,
    DraftContext,
    Drafter,
    NGramTrieDrafter,
    OuroborosConfig,
    OuroborosDrafter,
    PhrasePool,
    RESTDrafter,
    SpeculativeEngine,
    Verification,
)
from rag_speculate.cpu.kernels import FastKernels
from rag_speculate.cpu.linear import linear_unsupported
from rag_speculate.decoding import probe
from rag_speculate.decoding.baseline import timed_generate
from rag_speculate.decoding.budget import CostModel, best_prefix
from rag_speculate.decoding.forward import TreeForward
from rag_speculate.decoding.tree import ROOT
from rag_speculate.drafters.ouroboros.draft_forward import draft_forward
from rag_speculate.engine.traits import kernel_context

Method = Callable[[list[int], list | None, int], dict]
BASELINES = ("hf-greedy", "hf-greedy:fast", "hf-pld", "hf-assisted", "hf-assisted:fast")  # what the summary divides by


@dataclass
class Item:
    id: str
    category: str
    prompt_ids: list[int]
    documents: list | None  # what the drafters may use: retrieved passages (text or token ids)
    answers: list[str] = field(default_factory=list)


def hf_method(engine: SpeculativeEngine, fast: bool = False, **kwargs) -> Method:
    """transformers' own `generate`, greedy, with extra arguments (prompt lookup, an assistant model);
    `fast` runs its models' forwards through our engine's CPU kernels where our engine would
    (`fast_forwards`)."""

    assistant = kwargs.get("assistant_model")
    served = [m for m in (engine.model, assistant) if fast and m is not None and not linear_unsupported(m)]

    def run(ids: list[int], documents: list | None, max_new_tokens: int) -> dict:
        counted = ForwardCounter(engine.model, assistant) if assistant is not None else contextlib.nullcontext()
        with fast_forwards(served), counted:
            out = timed_generate(engine.model, ids, max_new_tokens, **kwargs)
        result = {"tokens": out.token_ids, "total_s": out.total_s, "decode_s": out.decode_s, "decode_tokens": out.decode_tokens,
                  "forwards": None}
        return result | (counted.counts() if assistant is not None else {})

    return run


@contextlib.contextmanager
def fast_forwards(models: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Within this context, the forwards of `models`, and nothing else, run inside `FastKernels`, as
    our engine runs its target's and draft model's. The mode costs every torch call a Python
    dispatch: around the whole of `generate` it slowed the int8 assistant's forward over one token,
    which no fast kernel serves, from 31 ms to 37."""
    own = [(m, m.__dict__.get("forward")) for m in models]
    for model, _ in own:
        forward = model.forward

        def fast(*args, forward=forward, **kwargs):
            with FastKernels():
                return forward(*args, **kwargs)

        model.forward = fast
    try:
        yield
    finally:
        for model, forward in own:
            if forward is None:
                del model.forward
            else:
                model.forward = forward


class ForwardCounter:
    """Within this context, the forwards of transformers' assisted generation, counted as ours are:
    the target's (its first, the prefill that also verifies the first draft, counted apart) and the
    assistant's by tokens fed, and the seconds inside the assistant's forwards after that prefill
    (its drafting during decode; transformers' own bookkeeping around them is left out)."""

    def __init__(self, target: torch.nn.Module, assistant: torch.nn.Module):
        self._models = {"target": target, "draft": assistant}
        self._sizes: dict[str, Counter[int]] = {"target": Counter(), "draft": Counter()}
        self._prefilled, self._drafting_s, self._started, self._handles = False, 0.0, 0.0, []

    def __enter__(self) -> Self:
        for name, model in self._models.items():
            self._handles += [model.register_forward_pre_hook(self._before, with_kwargs=True),
                              model.register_forward_hook(lambda m, a, k, out, name=name: self._after(name, a, k), with_kwargs=True)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._started = time.perf_counter()

    def _after(self, name: str, args: tuple, kwargs: dict) -> None:
        if name == "target" and not self._prefilled:
            self._prefilled = True
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._sizes[name][ids.shape[-1] if ids is not None else 1] += 1
        if name == "draft" and self._prefilled:
            self._drafting_s += time.perf_counter() - self._started

    def counts(self) -> dict:
        return {"forwards": sum(self._sizes["target"].values()) + self._prefilled, "forward_sizes": _by_size(self._sizes["target"]),
                "draft_forward_sizes": _by_size(self._sizes["draft"]), "drafting_s": self._drafting_s}


def engine_method(engine: SpeculativeEngine, drafter: Drafter | list[Drafter], budget: int | None = None,
                  before: Callable[[], None] | None = None, fast: bool = True) -> Method:
    """Our engine with `drafter` on the same model (and, with the same kernels, the same measured cost curve).

    Without a prompt cache: every method prefills every prompt whole, so the runs compare decoding
    alone (`prompt_cache_bench.py` measures the cache)."""
    ours = SpeculativeEngine(engine.model, engine.tokenizer, drafter, draft_budget=budget, name=engine.name,
                             fast_kernels=fast and bool(engine.traits.kernels), prompt_cache_bytes=0)
    if bool(ours.traits.kernels) == bool(engine.traits.kernels):
        ours.cost_model = engine.cost_model

    draft_models = _draft_counters(ours.drafter)

    def run(ids: list[int], documents: list | None, max_new_tokens: int) -> dict:
        if before:
            before()
        drafted_before = [Counter(d.draft_forward_sizes) for d in draft_models]
        started = time.perf_counter()
        result = ours.generate(ids, documents=documents, max_new_tokens=max_new_tokens)
        s = result.stats
        draft_sizes = sum((d.draft_forward_sizes - b for d, b in zip(draft_models, drafted_before)), Counter())
        return {"tokens": result.token_ids, "total_s": time.perf_counter() - started, "decode_s": s.decode_s,
                "decode_tokens": s.new_tokens - 1, "forwards": s.target_forwards, "drafting_s": s.drafting_s, "draft_setup_s": s.draft_setup_s,
                "accepted": dict(s.accepted_tokens), "forward_sizes": _by_size(s.forward_sizes),
                "draft_forward_sizes": _by_size(draft_sizes)}

    return run


def _draft_counters(drafter: Drafter) -> list:
    """What counts the draft model's forwards by tokens fed (`draft_forward_sizes`), for each drafter
    that runs one: Ouroboros (its `draft`), alone or inside the combined drafter."""
    found = []
    for d in getattr(drafter, "drafters", [drafter]):
        holder = d if hasattr(d, "draft_forward_sizes") else getattr(d, "draft", None)
        if hasattr(holder, "draft_forward_sizes"):
            found.append(holder)
    return found


def _by_size(counts: Counter[int]) -> dict[str, int]:
    # Sizes as JSON gives them back, so a summary reads a run the same before and after saving.
    return {str(q): n for q, n in counts.items()}


def build_methods(names: Sequence[str], engine: SpeculativeEngine, *, datastore: Datastore | None = None,
                  draft: tuple | None = None) -> dict[str, Method]:
    """Methods by name: hf-greedy, hf-pld, hf-assisted, trie, rest, trie+rest, ouroboros, ouroboros-warm,
    combined (every configured source); NAME@B for one of ours with a draft budget of B (trie@0: our
    engine decoding plainly); NAME:stock for one of ours with torch's own kernels, NAME:fast for one of
    transformers' with our engine's (`FastKernels`, rag_speculate/cpu/; by default ours use them and
    transformers' not)."""
    # One measured cost curve for all of ours, so they differ only in their drafters; a short
    # generation times it (and pays the first call's one-off costs).
    engine.generate([1, 2, 3, 4], max_new_tokens=4)
    methods = {}
    for name in names:
        rest, _, kernel = name.partition(":")
        base, _, budget = rest.partition("@")
        if kernel and kernel != ("fast" if base.startswith("hf-") else "stock"):
            raise SystemExit(f"method {name!r}: ':stock' applies to ours, ':fast' to transformers' methods")
        methods[name] = _method(base, int(budget) if budget else None, engine, datastore, draft, kernel)
    return methods


def _method(name: str, budget: int | None, engine: SpeculativeEngine, datastore: Datastore | None, draft: tuple | None,
            kernel: str) -> Method:
    def need(what, value):
        if value is None:
            raise SystemExit(f"method {name} needs {what}")
        return value

    def ours(drafter, before=None) -> Method:
        return engine_method(engine, drafter, budget, before, fast=kernel != "stock")

    if name.startswith("hf-"):
        fast = kernel == "fast"
        if name == "hf-greedy":
            return hf_method(engine, fast)
        if name == "hf-pld":
            return hf_method(engine, fast, prompt_lookup_num_tokens=10)
        if name == "hf-assisted":
            return hf_method(engine, fast, assistant_model=need("--draft-model", draft)[0])
    if name == "trie":
        return ours(NGramTrieDrafter())
    if name == "rest":
        return ours(RESTDrafter(need("--datastore", datastore)))
    if name == "trie+rest":
        return ours([NGramTrieDrafter(), RESTDrafter(need("--datastore", datastore))])
    if name in ("ouroboros", "ouroboros-warm", "combined"):
        ouroboros = OuroborosDrafter(*need("--draft-model", draft), OuroborosConfig(prompt_cache_bytes=0))

        def cold() -> None:
            # Without warm start every item starts from an empty pool; with it (the paper's Table 2
            # dagger rows) the pool carries over from item to item.
            ouroboros.pool = PhrasePool(ouroboros.pool.W, ouroboros.pool.beta)

        if name != "combined":
            return ours(ouroboros, before=cold if name == "ouroboros" else None)
        drafters = [NGramTrieDrafter(), *([RESTDrafter(datastore)] if datastore else []), ouroboros]
        return ours(drafters)
    raise SystemExit(f"unknown method {name!r}")


def measure(items: list[Item], methods: dict[str, Method], max_new_tokens: int, tokenizer, repeats: int = 1) -> list[dict]:
    """Every method on every item, `repeats` times in a row per item (`summarize` keeps each one's median)."""
    runs = []
    names = list(methods)
    for i, item in enumerate(items):
        for repeat in range(repeats):
            shift = (i + repeat) % len(names)
            batch = []
            for name in names[shift:] + names[:shift]:
                out = methods[name](item.prompt_ids, item.documents, max_new_tokens)
                out.update(item=item.id, category=item.category, method=name, prompt_tokens=len(item.prompt_ids), repeat=repeat)
                batch.append(out)
                print(f"[{i + 1}/{len(items)}{f' #{repeat + 1}' if repeats > 1 else ''}] {item.category:<15} {name:<15} "
                      f"{len(out['tokens']):>4} tok {out['total_s']:6.2f} s  decode {out['decode_s']:6.2f} s", file=sys.stderr, flush=True)
            _check_against_greedy(batch, item, tokenizer)
            runs.extend(batch)
    return runs


def _check_against_greedy(batch: list[dict], item: Item, tokenizer) -> None:
    # Greedy decoding through torch's kernels where it ran, else through ours: in fp32 both give the
    # same tokens, in bf16 only the latter sums each row as our verification does (docs/benchmarks.md, "Method").
    reference = next((r["tokens"] for greedy in ("hf-greedy", "hf-greedy:fast") for r in batch if r["method"] == greedy), None)
    for r in batch:
        r["identical"] = reference is not None and r["tokens"] == reference
        if item.answers:
            text = tokenizer.decode(r["tokens"], skip_special_tokens=True).lower()
            r["answer_found"] = any(a.lower() in text for a in item.answers)


def reference_costs(engine: SpeculativeEngine, draft_model=None, repeats: int = 3) -> dict[str, dict[int, float]]:
    """Seconds per forward by tokens fed, of the target (through the engine's kernels) and of the draft
    model, each the median of `repeats` timings: the pinned curves `modeled_decode_s` counts with."""

    def curve(forward: Callable[[int], None], max_q: int) -> dict[int, float]:
        tables = [CostModel.measure(forward, max_q).table() for _ in range(repeats)]
        return {q: statistics.median(t[q] for t in tables) for q in tables[0]}

    costs = {"target": curve(engine._runner.timed(), engine.draft_budget + 1)}  # as the engine runs it
    if draft_model is not None:
        # A draft forward feeds the output accepted since the last one, the root and the pool's tree.
        # As OuroborosDrafter runs it: through the lean forward where that fits and the CPU kernels
        # where they serve it, in tree mode where the drafting check passes (exact=False).
        context = kernel_context(draft_model)[0] or contextlib.nullcontext
        drafting = TreeForward(draft_model, context=context, forward=draft_forward(draft_model)[0])
        costs["draft"] = curve(probe.timed_tree(drafting, not probe.tree_attention(drafting, exact=False)), 33)
    return costs


def modeled_decode_s(run: dict, costs: dict[str, dict]) -> float | None:
    """Decode time as the pinned cost curves put it: the run's target and draft forwards by size.

    Free of the machine's speed drifting during a run (the same 18 forwards took 4.25 to 5.35 s),
    though most of the per-item spread between two drafting policies is in what they do, not in
    that. Left out: the drafters' lookups and bookkeeping (under 1 ms
    per step) and attention growing past the curves' 32 tokens of context (modeled over measured:
    0.83-0.93 on rag's long prompts, 0.92-1.09 elsewhere). Only for runs whose forwards are known:
    ours, and `hf-greedy:fast` (one single-token forward per token after the first).
    """
    target = CostModel({int(q): s for q, s in costs["target"].items()}, learn=False)
    if run["method"] == "hf-greedy:fast":
        return _decode_tokens(run) * target(1)
    if "forward_sizes" not in run or run["method"].startswith("hf-"):
        return None  # transformers' assistant drafts through its own forward, not the curve's
    total = sum(n * target(int(q)) for q, n in run["forward_sizes"].items())
    if run.get("draft_forward_sizes"):
        draft = CostModel({int(q): s for q, s in costs["draft"].items()}, learn=False)
        total += sum(n * draft(int(q)) for q, n in run["draft_forward_sizes"].items())
    return total


def with_modeled(runs: list[dict], costs: dict[str, dict] | None) -> list[dict]:
    """The runs, each with its `modeled_decode_s` on the curves of `reference_costs` (unchanged without them)."""
    return [{**r, "modeled_decode_s": modeled_decode_s(r, costs)} for r in runs] if costs else runs


def renamed(runs: list[dict], renames: dict[str, str]) -> list[dict]:
    """One saved run's results with methods renamed OLD -> NEW, to pool an A/B's variant with the
    method it was the code of in other runs; where a run has both, OLD's results replace NEW's."""
    replaced = {new for old, new in renames.items() if any(r["method"] == old for r in runs)}
    return [{**r, "method": renames.get(r["method"], r["method"])} for r in runs
            if r["method"] in renames or r["method"] not in replaced]


def summarize(runs: list[dict], methods: list[str], bases: Sequence[str] = BASELINES) -> dict:
    """Per category and method: speeds, and the mean, median and lowest of per-item decode speed ratios to each
    of `bases`, also of modeled decode times where the runs have them (`with_modeled`)."""
    repeated = defaultdict(list)
    for r in runs:
        repeated[(r["category"], r["item"], r["method"])].append(r)
    by = defaultdict(dict)
    for (category, item, method), rs in repeated.items():
        by[(category, item)][method] = _median_run(rs)
    summary = {}
    for category in dict.fromkeys(r["category"] for r in runs):
        items = [m for (c, _), m in by.items() if c == category]
        row = {}
        for method in methods:
            # Pooled runs (spec_bench --from-json A --from-json B) need not have run every method on every item.
            rs = [m[method] for m in items if method in m]
            if not rs:
                continue
            tokens = sum(len(r["tokens"]) for r in rs)
            row[method] = {
                "items": len(rs),
                "e2e_tok_s": tokens / sum(r["total_s"] for r in rs),
                "decode_tok_s": sum(_decode_tokens(r) for r in rs) / sum(r["decode_s"] for r in rs),
                "identical_to_greedy": statistics.mean(r["identical"] for r in rs),
                # transformers does not report its forwards; plain greedy is 1 by definition.
                "tokens_per_forward": tokens / sum(r["forwards"] for r in rs) if rs[0]["forwards"] else None,
            }
            if rs[0].get("drafting_s") is not None:
                row[method]["drafting_share_of_decode"] = sum(r["drafting_s"] for r in rs) / sum(r["decode_s"] for r in rs)
                accepted = defaultdict(int)
                for r in rs:
                    for source, n in r.get("accepted", {}).items():
                        accepted[source] += n
                row[method]["accepted_by_source"] = dict(accepted)
            if all("forward_sizes" in r for r in rs):
                # Target forwards that verified no draft are plain decoding steps: where drafting paused or did not pay.
                row[method]["forwards"] = {
                    "target": sum(sum(r["forward_sizes"].values()) for r in rs),
                    "without_draft": sum(r["forward_sizes"].get("1", 0) for r in rs),
                    "draft": sum(sum(r.get("draft_forward_sizes", {}).values()) for r in rs),
                }
            if all(r.get("modeled_decode_s") for r in rs):
                # How much of the measured decode time the cost curves account for.
                row[method]["modeled_share_of_decode"] = sum(r["modeled_decode_s"] for r in rs) / sum(r["decode_s"] for r in rs)
            if "answer_found" in rs[0]:
                row[method]["answer_found"] = statistics.mean(bool(r["answer_found"]) for r in rs)
            for base in bases:
                if base in methods and method != base:
                    # An answer that came whole with the prefill (transformers' first step verifies a
                    # draft there) decoded no tokens: it has no decode speed to compare.
                    pairs = [m for m in items if base in m and method in m and _decode_tokens(m[base]) and _decode_tokens(m[method])]
                    for kind, key in (("decode", "decode_s"), ("modeled", "modeled_decode_s")):
                        if not pairs or not all(m[k].get(key) for m in pairs for k in (base, method)):
                            continue
                        # Per token: a method may stop at another length than its base (never in greedy runs).
                        ratios = [m[base][key] / m[method][key] * _decode_tokens(m[method]) / _decode_tokens(m[base]) for m in pairs]
                        row[method][f"{kind}_speedup_vs_{base}_mean"] = statistics.mean(ratios)
                        row[method][f"{kind}_speedup_vs_{base}_median"] = statistics.median(ratios)
                        # The slowest item: the "never slower than hf-greedy" is per item.
                        row[method][f"{kind}_speedup_vs_{base}_lowest"] = min(ratios)
                        row[method][f"{kind}_speedup_vs_{base}_ci95"] = _ci95(ratios)
        summary[category] = {"items": len(items), "methods": row}
    return summary


def _median_run(runs: list[dict]) -> dict:
    """Of one method's runs of one item (`measure`'s repeats, or pooled files over the same items), the
    one with the median decode time per token (of two, the faster), identical only if all were."""
    ordered = sorted(runs, key=lambda r: r["decode_s"] / max(_decode_tokens(r), 1))
    return {**ordered[(len(ordered) - 1) // 2], "identical": all(r["identical"] for r in runs)}


def _decode_tokens(run: dict) -> int:
    """The tokens a run emitted within its decode time (runs saved before this was recorded: all but the first)."""
    return run.get("decode_tokens", len(run["tokens"]) - 1)


def _ci95(values: list[float]) -> float | None:
    """Half-width of the 95% confidence interval of the mean, items taken as independent samples (Student's t).

    Per-item ratios spread by 5-15% here (more from what the drafters do on each item than from the
    machine's speed), so a mean over four items can differ from
    another method's by that much with nothing changed; the interval says how far to trust a gap.
    """
    if len(values) < 2:
        return None
    from scipy.stats import t

    return float(t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)))


def markdown(summary: dict, methods: list[str], bases: Sequence[str] = BASELINES) -> str:
    bases = [b for b in bases if b in methods]
    rows = [m for block in summary.values() for m in block["methods"].values()]
    modeled = [b for b in bases if any(f"modeled_speedup_vs_{b}_mean" in m for m in rows)]
    lines = [
        "| category | method | decode tok/s | end to end tok/s | " + " | ".join(f"decode x {b} (mean ± 95% CI / median / lowest)" for b in bases)
        + "".join(f" | modeled x {b}" for b in modeled) + (" | modeled / measured" if modeled else "")
        + " | tokens/forward | forwards: target (without a draft) / draft model | drafting / decode | accepted by source"
        + " | identical to greedy | answer found |",
        "|---|---|---|---|" + "---|" * (len(bases) + len(modeled) + bool(modeled)) + "---|---|---|---|---|---|",
    ]
    for category, block in summary.items():
        for method in methods:
            if method not in block["methods"]:
                continue
            m = block["methods"][method]
            found = f"{m['answer_found']:.0%}" if "answer_found" in m else "-"
            per_forward = f"{m['tokens_per_forward']:.2f}" if m["tokens_per_forward"] else "-"
            drafting = f"{m['drafting_share_of_decode']:.1%}" if "drafting_share_of_decode" in m else "-"
            counts = m.get("forwards")
            forwards = f"{counts['target']} ({counts['without_draft']}) / {counts['draft']}" if counts else "-"
            sources = ", ".join(f"{k} {v}" for k, v in sorted(m.get("accepted_by_source", {}).items())) or "-"
            ratios = " | ".join([_ratio(m, "decode", b) for b in bases] + [_ratio(m, "modeled", b) for b in modeled])
            if modeled:
                ratios += f" | {m['modeled_share_of_decode']:.2f}" if "modeled_share_of_decode" in m else " | -"
            lines.append(f"| {category} (n={m['items']}) | {method} | {m['decode_tok_s']:.2f} | {m['e2e_tok_s']:.2f} | {ratios} | {per_forward} | {forwards} | "
                         f"{drafting} | {sources} | {m['identical_to_greedy']:.0%} | {found} |")
    return "\n".join(lines)


def _ratio(method_summary: dict, kind: str, base: str) -> str:
    key = f"{kind}_speedup_vs_{base}"
    if key + "_mean" not in method_summary:
        return "-"
    ci = method_summary.get(key + "_ci95")
    spread = f" ± {ci:.2f}" if ci is not None else ""
    return f"{method_summary[key + '_mean']:.2f}{spread} / {method_summary[key + '_median']:.2f} / {method_summary[key + '_lowest']:.2f}"


def plot(summary: dict, methods: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(summary)
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(10, 4))
    for j, method in enumerate(methods):
        values = [summary[c]["methods"][method]["decode_tok_s"] for c in categories]
        ax.bar([i + j * width for i in range(len(categories))], values, width, label=method)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(categories))], categories)
    ax.set_ylabel("decode tokens / s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replay(drafter: Drafter, item: Item, reference: list[int], budget: int, cost: CostModel, vocab_size: int, tokenizer) -> float:
    """Tokens per forward `drafter` would reach on `item`, from the target's known greedy output.

    Greedy verification accepts exactly the draft path that spells the reference, so a retrieval
    drafter's acceptance can be replayed without the model: the same truncation to the budget and
    to the best-paying prefix as the engine, the same walk. Only the target's choices off the
    accepted path are unknown (stand-ins), which retrieval drafters do not use.
    """
    documents = [d if not isinstance(d, str) else tokenizer.encode(d, add_special_tokens=False) for d in item.documents or []]
    drafter.start(DraftContext(item.prompt_ids, documents, vocab_size))
    tokens, position, forwards = [*item.prompt_ids, reference[0]], 1, 1
    while position < len(reference):
        step_budget = min(budget, len(reference) - position - 1)
        tree = drafter.propose(tokens, step_budget).truncated(step_budget)
        if tree.scores:
            tree = tree.truncated(best_prefix(tree.scores, cost))
        children, node, path = tree.children(), ROOT, []
        while (child := children.get(node, {}).get(reference[position + len(path)])) is not None:
            path.append(child)
            node = child
        accepted = reference[position : position + len(path) + 1]
        drafter.observe(Verification(tree, path, accepted, [accepted[-1]] * (len(tree) + 1)))
        tokens.extend(accepted)
        position += len(accepted)
        forwards += 1
    return len(reference) / forwards
