"""How often a draft model's next token is the target's, by category and by how the draft computes.

Teacher-forced on the target's own greedy outputs (the `hf-greedy` runs of a spec_bench.py results
file): the draft model reads each prompt plus the target's output in one forward, and at every output
position its argmax is compared with the target's next token. Speed does not enter; this isolates
what a draft model's arithmetic costs in agreement. Variants: the draft in fp32, in int8 with
torch.ao's defaults (one scale per tensor, 7-bit activations), and in int8 as
`int8_draft_model` (rag_speculate/drafters/ouroboros/int8.py) makes it (one scale per output channel, 8-bit activations
where VNNI allows).

    python3 benchmarks/draft_agreement.py --results benchmarks/results/zen5_fp32_n8.json
    python3 benchmarks/draft_agreement.py --results benchmarks/results/zen5_fp32_n8.json --stepwise   # as drafting feeds tokens
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path

import torch
from spec_bench import DEFAULT_DATA, load_items
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rag_speculate import SpeculativeEngine
from rag_speculate.decoding.kv_cache import cache_keyword
from rag_speculate.drafters.ouroboros.draft_model import head_ids
from rag_speculate.drafters.ouroboros.int8 import cpu_has_vnni, int8_draft_model
from rag_speculate.models.loading import load_model


def torch_ao_int8(model: torch.nn.Module) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True).eval()


@torch.inference_mode()
def agreeing(model: torch.nn.Module, prompt: list[int], output: list[int], head: torch.Tensor | None = None,
             stepwise: bool = False) -> int:
    """Output positions where the draft's argmax, reading the target's tokens before, is the target's token;
    `head`: the ids its output head scores (OuroborosDrafter's `head_vocabulary`), or None for all.
    `stepwise`: the output fed one token per forward after the prompt's prefill, as drafting feeds it;
    else prompt and output in one forward (an int8 draft then quantizes all their activations together)."""
    if stepwise:
        cache, keyword = DynamicCache(config=model.config), cache_keyword(model)
        steps = [model(input_ids=torch.tensor([prompt]), **{keyword: cache}).logits[0, -1]]
        steps += [model(input_ids=torch.tensor([[t]]), **{keyword: cache}).logits[0, -1] for t in output[:-1]]
        logits = torch.stack(steps)
    else:
        logits = model(input_ids=torch.tensor([prompt + output]), logits_to_keep=len(output) + 1).logits[0, :-1]
    chosen = logits.argmax(-1) if head is None else head[logits[:, head].argmax(-1)]
    return int((chosen == torch.tensor(output)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, required=True, help="a spec_bench.py results file with hf-greedy runs")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the target (for its tokenizer and chat template)")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--head-vocabulary", type=int, nargs="*", default=[],
                        help="also the int8 draft with its head scoring only the N lowest ids and the prompt's (OuroborosDrafter)")
    parser.add_argument("--stepwise", action="store_true",
                        help="feed each output token in a forward of its own after the prompt's prefill, as drafting does "
                             "(slower); by default the prompt and the whole output go in one forward")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    greedy = {(r["category"], r["item"]): r["tokens"] for r in json.loads(args.results.read_text())["runs"] if r["method"] == "hf-greedy"}
    if not greedy:
        raise SystemExit(f"{args.results} has no hf-greedy runs")
    engine = SpeculativeEngine.from_pretrained(args.model, dtype=torch.float32)
    items = [it for it in load_items(engine, DEFAULT_DATA, sorted({c for c, _ in greedy}), 10**6) if (it.category, it.id) in greedy]
    fp32, _ = load_model(args.draft_model, dtype=torch.float32)
    drafts = {"fp32": fp32, "int8, torch.ao's defaults": torch_ao_int8(copy.deepcopy(fp32)),
              "int8, int8_draft_model": int8_draft_model(copy.deepcopy(fp32))}
    heads = {f"int8, head of {n} ids and the prompt's": n for n in args.head_vocabulary}
    counts = {(it.category, name): [0, 0] for it in items for name in [*drafts, *heads]}
    for item in items:
        output = greedy[item.category, item.id]
        runs = [(name, model, None) for name, model in drafts.items()]
        runs += [(name, drafts["int8, int8_draft_model"], torch.cat(head_ids(engine.tokenizer, n, fp32.config.vocab_size, item.prompt_ids))) for name, n in heads.items()]
        for name, model, head in runs:
            counts[item.category, name][0] += agreeing(model, item.prompt_ids, output, head, args.stepwise)
            counts[item.category, name][1] += len(output)
    categories = list(dict.fromkeys(it.category for it in items))
    fed = "one output token per forward" if args.stepwise else "prompt and output in one forward"
    print(f"\nDraft argmax = target's greedy token, {len(items)} items ({args.results.name}), {fed}; VNNI: {cpu_has_vnni()}\n")
    print("| draft | " + " | ".join(categories) + " |\n|---|" + "---:|" * len(categories))
    for name in [*drafts, *heads]:
        print(f"| {name} | " + " | ".join(f"{counts[c, name][0] / counts[c, name][1]:.3f} ({counts[c, name][1]})" for c in categories) + " |")


if __name__ == "__main__":
    main()
