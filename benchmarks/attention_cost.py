"""Microseconds per layer of attention over a few query rows, torch's kernel against ours.

Decoding attends 1 query row to the cache, verification 2-17 rows under a draft tree's mask; this
times `F.scaled_dot_product_attention` as transformers calls it (grouped key/value heads, a mask
from 2 rows on) against `attention` (rag_speculate/cpu/attention.py), calls interleaved so machine
noise hits both alike, each round over the keys and values of `--layers`
layers, and reports each one's largest error against fp64 attention of the same
inputs. Defaults: the 1.5B Qwen's heads (12 query heads over 2 key/value heads of 128 dims), bf16
(`--dtype float32`: what a quantized target's fp32 activations attend in).

    python3 benchmarks/attention_cost.py --context 300 1000 --rows 1 5 17
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from rag_speculate.cpu.attention import attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, nargs="+", default=[300, 1000], help="cached tokens")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 17], help="query rows")
    parser.add_argument("--heads", type=int, nargs=3, default=[12, 2, 128], metavar=("QUERY", "KV", "DIMS"))
    parser.add_argument("--layers", type=int, default=28, help="layers of keys and values attended in turn per timed round")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds per kernel (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    heads, kv_heads, dims = args.heads
    dtype = getattr(torch, args.dtype)
    print("| context | rows | torch (us) | ours (us) | torch / ours | torch's max error | ours |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for context in args.context:
        for rows in args.rows:
            length = context + rows
            q = torch.randn(1, heads, rows, dims, dtype=dtype)
            # One layer's keys and values after another, as a forward reads them: not from the caches.
            cached = [[torch.randn(1, kv_heads, length, dims, dtype=dtype) for _ in range(2)] for _ in range(args.layers)]
            # As transformers calls it: no mask for one row, an additive one (here a causal chain) beyond.
            keep = torch.ones(rows, length, dtype=torch.bool).tril(context)[None, None] if rows > 1 else None
            mask = None if keep is None else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -1e30)
            kernels = {
                "torch": lambda k, v, q=q, mask=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                "ours": lambda k, v, q=q, mask=mask: attention(q, k, v, attn_mask=mask, enable_gqa=True),
            }
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(args.repeats):
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    for k, v in cached:
                        kernel(k, v)
                    times[name].append((time.perf_counter() - start) / args.layers * 1e6)
            torch_us, ours_us = (statistics.median(times[name]) for name in kernels)
            k, v = cached[0]
            exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep, enable_gqa=True)
            errors = [(kernel(k, v).double() - exact).abs().max().item() for kernel in kernels.values()]
            print(f"| {context} | {rows} | {torch_us:.0f} | {ours_us:.0f} | {torch_us / ours_us:.2f} | {errors[0]:.1e} | {errors[1]:.1e} |")


if __name__ == "__main__":
    main()
