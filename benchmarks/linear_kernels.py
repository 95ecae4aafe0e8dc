"""Milliseconds per pass of a few-row product over several weight matrices, by kernel and weight format.

Decoding and verification multiply 1-17 rows by every weight of the model; this times the kernels
rag_speculate/cpu/linear.py runs (plain fp32 or bf16 weights, int8 weights with int8 activations,
and 4-bit weights: rag_speculate/quantization) beside what torch and torchao ship for CPUs, on matrices of one layer's
shape (by default six of the 1.5B Qwen's MLP, 330 MB in fp32, more than the caches hold), rows
interleaved so machine noise hits every kernel alike. Prints a markdown table and the CPU.

    python3 benchmarks/linear_kernels.py --rows 1 2 5 9 17
    python3 benchmarks/linear_kernels.py --dtype bfloat16 --rows 1 2 3 5 9 17
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gpu_check import device_name

from rag_speculate.cpu.linear import linear_library, run_linear, run_quantized
from rag_speculate.quantization.formats import quantize


def kernels(weights: list[torch.Tensor]) -> dict[str, Callable[[torch.Tensor, int], torch.Tensor]]:
    """Kernels by name, each called with the input and the index of its weight."""
    dtype = weights[0].dtype
    found: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {"torch": lambda x, i: F.linear(x, weights[i])}
    library, reason = linear_library(dtype)
    if library is None:
        print(f"(our kernel is unavailable: {reason})")
    else:
        found["ours"] = lambda x, i, lib=library: run_linear(lib, x, weights[i], None)
    # int8 in our groups (128), in Q8_0's (32) and in 16 (a scale per half-step, lane by lane): what a block's scaling costs.
    settings = (("int8", "int8", "q8", None), ("int8 g32", "int8", "q8", 32), ("int8 g16", "int8", "q8", 16), ("int4", "int4", "q4", None))
    for name, method, fmt, group in settings:
        quantized_library, reason = linear_library(dtype, fmt)
        if quantized_library is None:
            print(f"(our {method} kernel is unavailable: {reason})")
            continue
        quantized = [quantize(w, method, group) for w in weights]
        found[f"ours {name}"] = lambda x, i, q=quantized, lib=quantized_library: run_quantized(
            lib, x, q[i].values, q[i].scale, q[i].offset, q[i].group_shift, q[i].shape[0], None, q[i].sub
        )
    # torch's int8 weight-only product for CPUs (what torchao's int8 weight-only layers call there): a scale per row.
    scales = [w.float().abs().amax(dim=1) / 127 for w in weights]
    int8 = [torch.round(w.float() / s[:, None]).to(torch.int8) for w, s in zip(weights, scales)]
    found["torch _weight_int8pack_mm"] = lambda x, i: torch.ops.aten._weight_int8pack_mm(x, int8[i], scales[i].to(x.dtype))
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        layers = [torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype) for w in weights]
        for layer, w in zip(layers, weights):
            layer.weight.data.copy_(w)
            quantize_(layer, Int8WeightOnlyConfig())
        found["torchao int8 weight-only"] = lambda x, i: layers[i](x)
    except ImportError:
        print("(torchao is not installed)")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9, 17])
    parser.add_argument("--shape", type=int, nargs=2, default=[8960, 1536], help="out and in features")
    parser.add_argument("--matrices", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=9, help="timed passes per kernel and row count (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [torch.randn(*args.shape, dtype=dtype) for _ in range(args.matrices)]
    by_kernel = kernels(weights)
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
    print(f"\n{device_name(torch.device('cpu'))}, torch {torch.__version__}: {args.matrices} matrices of "
          f"{args.shape[0]} x {args.shape[1]} ({megabytes:.0f} MB in {args.dtype}), activations in {args.dtype}, "
          f"{args.threads} threads, ms per pass, median of {args.repeats}\n")
    print("| rows | " + " | ".join(by_kernel) + " |")
    print("|---:|" + "---:|" * len(by_kernel))
    for r in args.rows:
        cells = [f"{statistics.median(times[k, r][1:]) * 1000:.1f}" for k in by_kernel]
        print(f"| {r} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
