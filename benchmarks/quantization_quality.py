"""What quantizing the packaged 1.5B costs in quality, per setting: the next-token predictions of the
quantized model against the fp32 model's over the same prompts (Spec-Bench's summarization and rag
dev items, the last `--positions` positions of each prompt, teacher-forced, one forward each).

Prints, per setting, how often the two models' top tokens agree and the mean KL divergence of the
quantized model's next-token distribution from fp32's, KL(fp32 ‖ quantized). Each setting runs the product its layers
compute (`quantization.formats`: `dequantize` of the quantized weights times, for int8, each row's
activations as `quantize_activations` rounds them), in torch, so groups the CPU kernel does not
time can be compared: int8 in groups of 32 (GGUF's Q8_0, llama.cpp's activations), 64 and 128
(ours), and our 4-bit.

    python3 benchmarks/quantization_quality.py --n 2 --positions 300
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_check import device_name
from spec_bench import load_items

from rag_speculate import SpeculativeEngine
from rag_speculate.cpu.linear import activation_block
from rag_speculate.quantization.formats import dequantize, quantize, quantize_activations

MODEL = "qwen2.5-coder-1.5b-instruct"
DATA = Path(__file__).resolve().parent / "data" / "spec_bench_dev.jsonl"
SETTINGS = {"int8, groups of 32 (Q8_0)": ("int8", 32), "int8, groups of 64": ("int8", 64),
            "int8, groups of 128 (ours)": ("int8", 128), "4-bit, groups of 32 (ours)": ("int4", 32)}  # fmt: skip


def set_layers(linears: list[torch.nn.Linear], setting: tuple[str, int] | None) -> None:
    """Every linear layer computes `setting`'s product (None: its own). The weights are left as
    they are (the output layer shares its weight with the embeddings, which stay fp32)."""
    for layer in linears:
        layer.forward = torch.nn.Linear.forward.__get__(layer)
        if setting is None:
            continue
        method, group = setting
        quantized = quantize(layer.weight, method, group)
        weight, block = dequantize(quantized), activation_block(quantized.group_shift)
        inputs = (lambda x, block=block: quantize_activations(x, block)) if method == "int8" else (lambda x: x)
        layer.forward = lambda x, layer=layer, weight=weight, inputs=inputs: F.linear(inputs(x), weight, layer.bias)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2, help="items per category")
    parser.add_argument("--positions", type=int, default=300, help="last prompt positions compared per item")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = SpeculativeEngine.from_pretrained(MODEL, dtype=torch.float32, device="cpu", draft_budget=0)
    model = engine.model
    items = load_items(engine, DATA, ["summarization", "rag"], args.n)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def logits() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [
                model(input_ids=torch.tensor([item.prompt_ids]), logits_to_keep=args.positions).logits[0].float()
                for item in items
            ]

    reference = logits()
    print(
        f"{device_name(torch.device('cpu'))}, {MODEL}, {len(items)} items, last {args.positions} positions each, against fp32\n"
    )
    print("| setting | top token agrees with fp32 | KL(fp32 ‖ quantized), nats |\n|---|---:|---:|")
    for name, setting in SETTINGS.items():
        set_layers(linears, setting)
        got = logits()
        agree = statistics.mean((g.argmax(-1) == r.argmax(-1)).float().mean().item() for g, r in zip(got, reference))
        kl = statistics.mean(F.kl_div(g.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="batchmean").item()
                             for g, r in zip(got, reference))  # fmt: skip
        print(f"| {name} | {agree:.1%} | {kl:.4f} |", flush=True)
    set_layers(linears, None)


if __name__ == "__main__":
    main()
