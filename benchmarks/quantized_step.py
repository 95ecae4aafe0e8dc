"""Where a quantized target's plain decoding step goes: its 4-bit, 6-bit and int8 layers, the rest.

The packaged 1.5B through `from_pretrained(quantization=...)` (the GGUF file's own tensors by default:
Q4_K and Q6_K in their own 4 and 6 bits), decoding plainly (`draft_budget=0`) after a short prompt, so a
step is one row through every layer. Every quantized layer's kernel call is timed by the weights'
format; the rest of a step is the step's time less those. Prints ms a step and the bytes each
format's layers read a step (the output layer included), with the CPU.

    python3 benchmarks/quantized_step.py --quantization gguf --steps 40
"""

from __future__ import annotations

import argparse
import time

import torch
from gpu_check import device_name

import rag_speculate.quantization.layer as layer
from rag_speculate import SpeculativeEngine

MODEL = "qwen2.5-coder-1.5b-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", choices=["gguf", "int8", "int4"], default="gguf")
    parser.add_argument("--steps", type=int, default=40, help="decoding steps timed, after one untimed generation")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = SpeculativeEngine.from_pretrained(MODEL, device="cpu", quantization=args.quantization, draft_budget=0, prompt_cache_bytes=0)
    formats = {"q4": "4-bit layers", "q6": "6-bit layers", "q8": "int8 layers"}
    seconds = dict.fromkeys(formats, 0.0)
    run = layer.run_quantized

    def timed(library, x, q, scale, offset, group_shift, out_features, bias, sub=None):
        start = time.perf_counter()
        out = run(library, x, q, scale, offset, group_shift, out_features, bias, sub)
        # The format as run_quantized tells them apart: int8 values, or q6's signed sub-block scales.
        seconds["q8" if q.dtype == torch.int8 else "q6" if sub.dtype == torch.int8 else "q4"] += time.perf_counter() - start
        return out

    layer.run_quantized = timed  # every QuantizedLinear calls the kernel through this module's name
    prompt = list(range(1000, 1008))
    engine.generate(prompt, max_new_tokens=4)  # kernels built, cost curve timed
    seconds.update(dict.fromkeys(formats, 0.0))
    stats = engine.generate([t + 1 for t in prompt], max_new_tokens=args.steps + 1).stats
    steps = stats.target_forwards - 1  # the first forward is the prompt's
    read = dict.fromkeys(formats, 0)
    for module in engine.model.modules():
        if isinstance(module, layer.QuantizedLinear):
            read[module.format] += module.weight.nbytes
    step_ms = 1e3 * stats.decode_s / steps
    print(f"{device_name(torch.device('cpu'))}, {args.threads} threads, {MODEL} quantization={args.quantization}, {steps} plain steps")
    print("| per step | ms | MB read |\n|---|---:|---:|")
    for fmt, name in formats.items():
        print(f"| {name} | {1e3 * seconds[fmt] / steps:.1f} | {read[fmt] / 1e6:.0f} |")
    print(f"| the rest | {step_ms - 1e3 * sum(seconds.values()) / steps:.1f} | |")
    print(f"| the step | {step_ms:.1f} | {sum(read.values()) / 1e6:.0f} |")


if __name__ == "__main__":
    main()
