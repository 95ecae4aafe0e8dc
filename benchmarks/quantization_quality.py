"""What quantizing the packaged 1.5B costs in quality, per setting: the next-token predictions of the
quantized model against the fp32 model's over the same prompts (Spec-Bench's summarization and rag
dev items, the last `--positions` positions of each prompt, teacher-forced, one forward each).

Prints, per setting, how often the two models' top tokens agree and the mean KL divergence of the
quantized model's next-token distribution from fp32's, KL(fp32 ‖ quantized). Each setting runs the product its layers
compute (`quantization.formats`: `dequantize` of the quantized weights times each row's activations
as `quantize_activations` rounds them), in torch, so groups the CPU kernel does not time can be
compared: int8 in groups of 32 (GGUF's Q8_0, llama.cpp's activations), 64 and 128 (ours), and our
4-bit (Q4_K).

With `--answers`, instead: how often quantizing changes the 16-bit model's greedy answer. Each
setting answers every item through the engine (`SpeculativeEngine.from_pretrained(quantization=...)`,
its default drafters fed the item's documents; greedy, so the answer is the quantized model's own):
int8, our int4 and the GGUF file's own Q4_K_M tensors (`gguf`), beside llama.cpp's greedy answers on
the same file and token ids (llama-cpp-python, as `llamacpp_peer.py` runs it). The reference is the
model in the CPU's 16-bit dtype (`devices.default_dtype`: bf16 with AVX512-BF16 or AMX, else fp32).
Per setting: answers identical to the reference's, and the mean number of tokens shared before an
answer that differs parts from the reference's. Settings load one after another, each freed before
the next. Writes `--out` (the answers' token ids and the summary).

    python3 benchmarks/quantization_quality.py --n 2 --positions 300
    python3 benchmarks/quantization_quality.py --answers --n 4 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_check import device_name
from llamacpp_peer import engine_method, llama_method, shared_prefix
from spec_bench import load_items

from rag_speculate import SpeculativeEngine
from rag_speculate.devices import cpu_flags, default_dtype
from rag_speculate.models.packaged import gguf_path
from rag_speculate.quantization.formats import dequantize, input_block, quantize, quantize_activations

MODEL = "qwen2.5-coder-1.5b-instruct"
DATA = Path(__file__).resolve().parent / "data" / "spec_bench_dev.jsonl"
CATEGORIES = ["summarization", "rag"]
SETTINGS = {"int8, groups of 32 (Q8_0)": ("int8", 32), "int8, groups of 64": ("int8", 64),
            "int8, groups of 128 (ours)": ("int8", 128), "4-bit, Q4_K super-blocks (ours)": ("int4", 256)}  # fmt: skip


def set_layers(linears: list[torch.nn.Linear], setting: tuple[str, int] | None) -> None:
    """Every linear layer computes `setting`'s product (None: its own). The weights are left as
    they are (the output layer shares its weight with the embeddings, which stay fp32)."""
    for layer in linears:
        layer.forward = torch.nn.Linear.forward.__get__(layer)
        if setting is None:
            continue
        method, group = setting
        quantized = quantize(layer.weight, method, group)
        weight, block = dequantize(quantized), input_block(quantized.format, quantized.group_shift)
        layer.forward = lambda x, layer=layer, weight=weight, block=block: F.linear(quantize_activations(x, block), weight, layer.bias)


def answers(args: argparse.Namespace) -> None:
    """Each quantized setting's greedy answers against the 16-bit model's (module docstring)."""
    reference_dtype = default_dtype("cpu")
    engine = SpeculativeEngine.from_pretrained(MODEL, device="cpu")  # dtype: the CPU's, as every setting below
    items = load_items(engine, DATA, CATEGORIES, args.n)
    # The engine's answer ends with its end-of-sequence token, llama.cpp's stops before it.
    eos = set(engine.eos_token_ids)

    def answer_all(run) -> list[list[int]]:
        tokens = []
        for item in items:
            got = run(item.prompt_ids, item.documents, args.max_new_tokens)["tokens"]
            tokens.append(got[:-1] if got and got[-1] in eos else got)
        print(f"  {len(items)} answers", flush=True)
        return tokens

    print(f"reference: {MODEL} in {reference_dtype}", flush=True)
    got = {"reference": answer_all(engine_method(engine))}
    del engine
    for quantization in ["int8", "int4", "gguf"]:
        gc.collect()
        print(f"ours {quantization}", flush=True)
        engine = SpeculativeEngine.from_pretrained(MODEL, quantization=quantization, device="cpu")
        got[f"ours {quantization}"] = answer_all(engine_method(engine))
        del engine
    gc.collect()
    print("llama.cpp Q4_K_M", flush=True)
    try:  # llama-cpp-python compiles llama.cpp when installed; without it the other rows still stand
        from llama_cpp import Llama
    except ImportError as error:
        llama_cpp = f"not run: {error}"
        print(llama_cpp, flush=True)
    else:
        llama_cpp = version("llama-cpp-python")
        llm = Llama(model_path=str(gguf_path(MODEL)), n_ctx=4096, n_threads=args.threads, n_batch=512, verbose=False)
        got["llama.cpp Q4_K_M"] = answer_all(llama_method(llm, eos))
        del llm

    reference = got.pop("reference")
    summary = {}
    for name, tokens in got.items():
        parted = [shared_prefix(a, r) for a, r in zip(tokens, reference) if a != r]
        summary[name] = {"identical": len(items) - len(parted), "n": len(items),
                         "mean_shared_tokens_where_different": statistics.mean(parted) if parted else None}  # fmt: skip
    cpu = device_name(torch.device("cpu"))
    lines = [f"{cpu}, {args.threads} threads, {MODEL}, reference {reference_dtype}, greedy, "
             f"{args.max_new_tokens} new tokens at most, {args.n} items each of {', '.join(CATEGORIES)}; "
             f"the reference's answers {statistics.mean(map(len, reference)):.1f} tokens on average", "",
             "| setting | answers identical to the reference's | mean tokens shared where they differ |",
             "|---|---:|---:|"]  # fmt: skip
    for name, row in summary.items():
        shared = row["mean_shared_tokens_where_different"]
        lines.append(f"| {name} | {row['identical']}/{row['n']} | {'-' if shared is None else f'{shared:.1f}'} |")
    config = {k: str(v) for k, v in vars(args).items()} | {
        "torch": torch.__version__, "llama_cpp": llama_cpp, "cpu": cpu, "reference_dtype": str(reference_dtype),
        "cpu_bf16_flags": sorted({"avx512_bf16", "amx_bf16"} & cpu_flags())}  # fmt: skip
    rows = [{"item": item.id, "category": item.category, "prompt_tokens": len(item.prompt_ids),
             "reference": reference[i]} | {name: tokens[i] for name, tokens in got.items()}
            for i, item in enumerate(items)]  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": config, "summary": summary, "rows": rows}, indent=1))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2, help="items per category")
    parser.add_argument("--positions", type=int, default=300, help="last prompt positions compared per item")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--answers", action="store_true", help="greedy answers against the 16-bit model's")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="with --answers")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quantization_quality.json"),
                        help="with --answers")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.answers:
        answers(args)
        return
    engine = SpeculativeEngine.from_pretrained(MODEL, dtype=torch.float32, device="cpu", draft_budget=0)
    model = engine.model
    items = load_items(engine, DATA, CATEGORIES, args.n)
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
