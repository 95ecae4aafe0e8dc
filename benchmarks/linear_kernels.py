"""Milliseconds per pass of a few-row fp32 (or bf16) product over several weight matrices, by kernel.

Decoding and verification multiply 1-17 rows by every weight of the model; this times the
kernels rag_speculate/cpu/linear.py chooses between on matrices of one layer's shape (by default
six of the 1.5B Qwen's MLP, 330 MB, more than the caches hold), rows interleaved so machine noise
hits every kernel alike. Prints a markdown table.

    python3 benchmarks/linear_kernels.py --rows 1 2 5 9 16 24 33
    python3 benchmarks/linear_kernels.py --dtype bfloat16 --rows 1 2 3 5 9 17   # torch's bf16 product and ours
    python3 benchmarks/linear_kernels.py --variant before=OLD.c   # another version of small_linear.c beside it
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from rag_speculate.cpu import linear as cpu_linear


def kernels(weights: list[torch.Tensor], rows: list[int], variants: dict[str, Path]) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    """Kernels by name, each called with the input and the index of its weight; `variants`: other
    versions of `rag_speculate/cpu/small_linear.c` by name, built with the same flags."""
    dtype = weights[0].dtype
    found = {"torch": lambda x, i: F.linear(x, weights[i])}
    if dtype == torch.float32:  # in bf16 torch's product is oneDNN's, and MKL has none
        # MKL with the weights packed once per row count (a copy of every weight): measured to show
        # that packing ahead does not rescue MKL at these sizes; not a kernel the engine uses.
        packed = {r: [torch.ops.mkl._mkl_reorder_linear_weight(w, r) for w in weights] for r in rows}
        found["MKL prepacked"] = lambda x, i: torch.ops.mkl._mkl_linear(x, packed[x.shape[0]][i], weights[i], None, x.shape[0])
        found["oneDNN"] = lambda x, i: cpu_linear._onednn_linear(x, weights[i], None)
    if cpu_linear.small_linear_library(dtype)[0] is not None:
        found["small_linear.c"] = lambda x, i: cpu_linear._small_linear(x, weights[i], None)
    for name, source in variants.items():
        library, reason = cpu_linear.build_small_linear(source, dtype)
        if library is None:
            raise SystemExit(f"--variant {name}: {reason}")
        found[name] = lambda x, i, library=library: cpu_linear.run_small_linear(library, x, weights[i], None)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9, 16, 24, 33])
    parser.add_argument("--shape", type=int, nargs=2, default=[8960, 1536], help="out and in features")
    parser.add_argument("--matrices", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=9, help="timed passes per kernel and row count (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                        help="also time another version of rag_speculate/cpu/small_linear.c (e.g. `git show REV:rag_speculate/cpu/small_linear.c`)")
    args = parser.parse_args()
    variants = {}
    for assignment in args.variant:
        name, sep, file = assignment.partition("=")
        if not (sep and name and Path(file).is_file()):
            raise SystemExit(f"--variant takes NAME=FILE with an existing FILE, got {assignment!r}")
        variants[name] = Path(file)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [torch.randn(*args.shape, dtype=dtype) for _ in range(args.matrices)]
    by_kernel = kernels(weights, args.rows, variants)
    if "small_linear.c" not in by_kernel:
        print(f"(small-row kernel unavailable: {cpu_linear.small_linear_library(dtype)[1]})")
    times: dict[tuple[str, int], list[float]] = {(k, r): [] for k in by_kernel for r in args.rows}
    with torch.inference_mode():
        inputs = {r: torch.randn(r, args.shape[1], dtype=dtype) for r in args.rows}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            for r, x in inputs.items():
                for name, kernel in by_kernel.items():
                    started = time.perf_counter()
                    for i in range(len(weights)):
                        kernel(x, i)
                    times[name, r].append(time.perf_counter() - started)
    megabytes = args.matrices * args.shape[0] * args.shape[1] * dtype.itemsize / 1e6
    print(f"\n{args.matrices} matrices of {args.shape[0]} x {args.shape[1]} {args.dtype} ({megabytes:.0f} MB), "
          f"{args.threads} threads, ms per pass, median of {args.repeats}\n")
    print("| rows | " + " | ".join(by_kernel) + " |")
    print("|---:|" + "---:|" * len(by_kernel))
    for r in args.rows:
        cells = [f"{statistics.median(times[k, r][1:]) * 1000:.1f}" for k in by_kernel]
        print(f"| {r} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
