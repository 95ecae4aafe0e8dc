"""Cost of one forward pass over q new tokens on top of a long KV cache.

Speculative decoding trades one target forward of q tokens against q forwards
of one token; this measures how the forward time grows with q, after a
realistic prefill. Prints a markdown table (ms and ratio to the smallest q).

    python benchmarks/forward_cost.py --model qwen2.5-coder-1.5b-instruct \\
        --dtype bfloat16 --context 1000 --sizes 1 2 4 8 16 32
    python benchmarks/forward_cost.py --model qwen2.5-coder-0.5b-instruct --dtype float32 --int8 --context 500
    python benchmarks/forward_cost.py --model qwen2.5-coder-0.5b-instruct --dtype float32 --int8 --lean --context 500
    python benchmarks/forward_cost.py --model qwen2.5-coder-1.5b-instruct --dtype float32 --fast --context 500
    python benchmarks/forward_cost.py --model qwen2.5-coder-1.5b-instruct --dtype float32 --fast --tree --context 500
    python benchmarks/forward_cost.py ... --fast --kernel-variant OLD.c   # another linear.c, timed in the same rounds
    python benchmarks/forward_cost.py ... --fast --torch-attention   # also with attention left to torch's kernel
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from rag_speculate.cpu import kernels as fast_kernels
from rag_speculate.cpu import linear as cpu_linear
from rag_speculate.cpu.kernels import FastKernels
from rag_speculate.decoding.forward import TreeForward
from rag_speculate.decoding.kv_cache import cache_keyword
from rag_speculate.decoding.tree import DraftTree
from rag_speculate.drafters.ouroboros.draft_model import head_ids
from rag_speculate.drafters.ouroboros.int8 import int8_draft_model
from rag_speculate.drafters.ouroboros.draft_forward import DraftForward, draft_forward
from rag_speculate.models.packaged import is_packaged_model, load_packaged_model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="packaged model name or local HF folder")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--context", type=int, default=1000, help="prefilled tokens in the KV cache")
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="new-token counts q")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per q (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefills", type=int, default=1, help="prefills timed in a row (the first pays one-off allocations)")
    parser.add_argument("--int8", action="store_true", help="linear layers in int8, as for a draft model (int8_draft_model, rag_speculate/drafters/ouroboros/int8.py)")
    parser.add_argument("--fast", action="store_true", help="forwards through the engine's CPU kernels (FastKernels: rag_speculate/cpu/linear.py and cpu/attention.py), the prefill too")
    parser.add_argument("--lean", action="store_true", help="through the lean forward Ouroboros drafts with (rag_speculate/drafters/ouroboros/draft_forward.py)")
    parser.add_argument("--tree", action="store_true",
                        help="as the engine verifies a draft: the q tokens as a chain-shaped tree with its 4D mask (TreeForward, rag_speculate/decoding/forward.py)")
    parser.add_argument("--head-vocabulary", type=int, default=None, metavar="N",
                        help="with --lean: also, in the same rounds, with the head scoring only the N lowest ids and the "
                             "context's (OuroborosDrafter's head_vocabulary)")
    parser.add_argument("--kernel-variant", type=Path, default=None, metavar="FILE",
                        help="with --fast: also time every q with another version of rag_speculate/cpu/linear.c serving the linear layers")
    parser.add_argument("--torch-attention", action="store_true",
                        help="with --fast: also time every q with the attention left to torch's kernel (rag_speculate/cpu/attention.py off)")
    args = parser.parse_args()
    if args.kernel_variant and not (args.fast and args.kernel_variant.is_file()):
        parser.error("--kernel-variant needs --fast and an existing file")
    if args.torch_attention and not (args.fast and not args.kernel_variant and args.head_vocabulary is None):
        parser.error("--torch-attention needs --fast, and no other variant")
    if args.head_vocabulary is not None and not (args.lean and args.head_vocabulary > 0 and not args.kernel_variant):
        parser.error("--head-vocabulary needs --lean, a positive N and no --kernel-variant")
    return args


@contextlib.contextmanager
def variant_kernel(library) -> None:
    """The fast kernels' linear layers served by `library` (another build of the kernel, to compare)."""
    saved = cpu_linear.linear_library
    cpu_linear.linear_library = lambda dtype=None: (library, "")
    try:
        yield
    finally:
        cpu_linear.linear_library = saved


def load(model_name: str, dtype: torch.dtype, device: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if is_packaged_model(model_name):
        return load_packaged_model(model_name, dtype=dtype, device=device)
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype, local_files_only=True).to(device).eval()
    return model, AutoTokenizer.from_pretrained(model_name, local_files_only=True)


@contextlib.contextmanager
def torch_attention() -> None:
    """The fast kernels' mode with the attention left to torch's kernel (the linear kernels only)."""
    saved = fast_kernels.attention
    fast_kernels.attention = lambda *args, **kwargs: None
    try:
        yield
    finally:
        fast_kernels.attention = saved


@contextlib.contextmanager
def restricted_head(lean: DraftForward, groups: tuple[torch.Tensor, ...]) -> None:
    """The lean forward's head scoring only the ids of `groups`, as OuroborosDrafter restricts it."""
    lean.restrict_head(*groups)
    try:
        yield
    finally:
        lean.restrict_head()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_forward(
    model: PreTrainedModel, cache: DynamicCache, tokens: torch.Tensor, fast: bool = False, lean: DraftForward | None = None,
    verifier: TreeForward | None = None,
) -> float:
    """Seconds for one forward of ``tokens`` on top of ``cache``; leaves the cache as it was."""
    keyword = cache_keyword(model)  # read off the class hierarchy: outside the timed forward
    synchronize(tokens.device)
    start = time.perf_counter()
    with FastKernels() if fast else contextlib.nullcontext():
        if verifier is not None:
            ids = tokens[0].tolist()
            verifier.tree(cache, ids[0], DraftTree.chain(ids[1:]))
        elif lean is not None:
            lean(tokens, cache, logits_to_keep=tokens.shape[1])
        else:
            model(input_ids=tokens, **{keyword: cache}, use_cache=True, logits_to_keep=tokens.shape[1])
    synchronize(tokens.device)
    elapsed = time.perf_counter() - start
    # transformers 5 only accepts a negative count: the number of tokens to drop.
    cache.crop(-tokens.shape[1])
    return elapsed


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load(args.model, DTYPES[args.dtype], args.device)
    if args.int8:
        model = int8_draft_model(model)
    lean = None
    if args.lean:
        lean, reason = draft_forward(model)
        if lean is None:
            sys.exit(f"no lean forward for {args.model}: {reason}")
    # time_forward already runs it inside the fast kernels' mode where asked.
    verifier = TreeForward(model, forward=lean) if args.tree else None
    device = model.device
    # Token identity does not affect the cost; avoid the special tokens at the top of the vocab.
    vocab = model.config.vocab_size - 1000
    prompt = torch.randint(0, vocab, (1, args.context), device=device)

    for _ in range(args.prefills):
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        with torch.inference_mode(), FastKernels() if args.fast else contextlib.nullcontext():
            model(input_ids=prompt, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1)
        print(f"prefill of {args.context} tokens: {time.perf_counter() - start:.2f} s", file=sys.stderr)

    inputs = {q: torch.randint(0, vocab, (1, q), device=device) for q in args.sizes}
    kernels = {"": contextlib.nullcontext}
    if args.kernel_variant:
        library, reason = cpu_linear.build_linear(args.kernel_variant, DTYPES[args.dtype], torch.backends.cpu.get_cpu_capability())
        if library is None:
            sys.exit(f"--kernel-variant: {reason}")
        kernels["variant"], variant = (lambda: variant_kernel(library)), args.kernel_variant.name
    if args.torch_attention:
        kernels["variant"], variant = torch_attention, "torch's attention"
    if args.head_vocabulary:
        groups = head_ids(tokenizer, args.head_vocabulary, model.config.vocab_size, prompt[0].tolist())
        kernels["variant"], variant = (lambda: restricted_head(lean, groups)), f"head of {sum(map(len, groups))} ids"
        another_context = torch.randint(0, vocab, (args.context,)).tolist()
        print_head_building(lean, groups, head_ids(tokenizer, args.head_vocabulary, model.config.vocab_size, another_context))
    for tokens in inputs.values():
        for kernel in kernels.values():
            with kernel():
                time_forward(model, cache, tokens, args.fast, lean, verifier)  # warm-up: allocator, kernel selection
    # Rounds over all sizes rather than all repeats of one size, so a burst of
    # load from another process hits every size alike instead of skewing one.
    runs: dict[tuple[str, int], list[float]] = {(k, q): [] for k in kernels for q in args.sizes}
    for round_index in range(args.repeats):
        for q, tokens in inputs.items():
            for name, kernel in kernels.items():
                with kernel():
                    runs[name, q].append(time_forward(model, cache, tokens, args.fast, lean, verifier))
        print(f"round {round_index + 1}/{args.repeats} done", file=sys.stderr)
    assert cache.get_seq_length() == args.context
    rows = [(q, statistics.median(runs["", q]) * 1000, min(runs["", q]) * 1000) for q in args.sizes]

    base, base_min = rows[0][1], rows[0][2]
    # Other processes on a small machine distort timings; the load average shows it.
    load_average = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n{args.model}, {args.dtype}{' (linear layers int8)' if args.int8 else ''}{' (fast kernels)' if args.fast else ''}{' (lean forward)' if args.lean else ''}{' (tree-shaped, as verified)' if args.tree else ''}, {args.device}, {args.threads} threads, "
        f"context {args.context}, median of {args.repeats}, load average {load_average}\n"
    )
    # The minimum is the least disturbed run; a large gap to the median means noise.
    print(f"| q | median ms | ms per token | ratio to q={rows[0][0]} | min ms | min ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for q, ms, fastest in rows:
        print(f"| {q} | {ms:.1f} | {ms / q:.1f} | {ms / base:.2f} | {fastest:.1f} | {fastest / base_min:.2f} |")
    if "variant" in kernels:
        print(f"\n| q | as is, median ms | {variant}, median ms | ratio |\n|---:|---:|---:|---:|")
        for q, ms, _ in rows:
            other = statistics.median(runs["variant", q]) * 1000
            print(f"| {q} | {ms:.1f} | {other:.1f} | {ms / other:.2f} |")
    if args.fast:
        print_rounding(model, cache, torch.randint(0, vocab, (1, 16), device=device))
    if lean is not None:
        print_lean_difference(model, lean, cache, inputs)


def print_head_building(lean: DraftForward, groups: tuple[torch.Tensor, ...], others: tuple[torch.Tensor, ...]) -> None:
    """What restricting the head costs, as OuroborosDrafter does it: at attach, per generation, and
    all its rows packed anew (what each generation would pay without the common group kept)."""
    def seconds(*restriction: torch.Tensor) -> float:
        started = time.perf_counter()
        lean.restrict_head(*restriction)
        return time.perf_counter() - started

    first = seconds(*groups)
    another = seconds(*others)
    whole = seconds(torch.cat(others).sort().values)
    lean.restrict_head()
    print(f"head restriction: first {first:.2f} s (the head unpacked, {len(groups[0])} common rows packed), "
          f"another context's {len(others[1])} ids {another * 1000:.1f} ms, all {sum(map(len, others))} rows anew {whole:.2f} s")


@torch.inference_mode()
def print_lean_difference(model: PreTrainedModel, lean: DraftForward, cache: DynamicCache, inputs: dict[int, torch.Tensor]) -> None:
    """How far the lean forward's logits land from the model's own, for each timed q on the same cache."""
    for q, tokens in inputs.items():
        own = model(input_ids=tokens, **{cache_keyword(model): cache}, use_cache=True).logits
        cache.crop(-q)
        difference = (lean(tokens, cache) - own).abs().max().item()
        cache.crop(-q)
        print(f"max |logit difference| of the lean forward from the model's own, q={q}: {difference:.2e}")


@torch.inference_mode()
def print_rounding(model: PreTrainedModel, cache: DynamicCache, tokens: torch.Tensor) -> None:
    """How far the logits land from `model.generate`'s (token by token, torch's kernel), by kernel and feeding."""
    def logits(fast: bool, one_by_one: bool) -> torch.Tensor:
        with FastKernels() if fast else contextlib.nullcontext():
            chunks = tokens.split(1, dim=1) if one_by_one else [tokens]
            out = torch.cat([model(input_ids=c, **{cache_keyword(model): cache}, use_cache=True).logits for c in chunks], dim=1)
        cache.crop(-tokens.shape[1])
        return out

    reference = logits(False, True)
    for fast, one_by_one, what in ((False, False, "torch's kernel, one forward"), (True, False, "fast kernels, one forward"),
                                   (True, True, "fast kernels, token by token")):
        print(f"max |logit difference| over {tokens.shape[1]} tokens from torch's kernel token by token, {what}: "
              f"{(logits(fast, one_by_one) - reference).abs().max().item():.2e}")
    # bf16 through the fast kernels: each row as alone, so 0 (rag_speculate/cpu/attention.py).
    print(f"max |logit difference| over {tokens.shape[1]} tokens, fast kernels, one forward from token by token: "
          f"{(logits(True, False) - logits(True, True)).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
