"""Quantized targets on a CPU against llama.cpp on its own ground: the packaged Qwen2.5-Coder-1.5B GGUF
(Q4_K_M), the same prompts and token ids, greedy, interleaved per item, one process.

Methods:
- llama.cpp: llama-cpp-python on the GGUF file as shipped, plain, and with its prompt-lookup
  speculation (`LlamaPromptLookupDecoding`, llama.cpp's n-gram mode over the prompt);
- ours, gguf: the engine keeping the file's own Q4_K and Q6_K tensors (`quantization="gguf"`),
  activations in `--dtype`, with its document drafters, and the same model decoding plainly
  (draft_budget=0): speculation must give exactly the plain tokens;
- with `--int8`: llama.cpp on a Q8_0 GGUF written from the same weights (each tensor dequantized
  and requantized by the `gguf` package, as llama.cpp's quantizer does), and ours with the same
  weights requantized to int8 (`quantization="int8"`: groups of 128, activations quantized per
  row in blocks of the same size), speculative and plain; and ours on the dequantized weights
  in fp32, plainly: the reference that says how often quantizing changes an answer.

Items are Spec-Bench's summarization and RAG prompts (`benchmarks/data`), each run once per method
after a warm-up. Per method: prefill tokens/s (prompt tokens over time to first token), decode
tokens/s (tokens after the first over the time after it; the median item's, and over all the
category's tokens, which weighs long answers by their length) and end to end seconds; per item, whether
our speculative output equals our plain one (it must), how many tokens of llama.cpp's answer ours
shares before they part (different arithmetic: near ties go either way), and with `--int8` whether
each quantized plain answer equals the fp32 one.

    pip install llama-cpp-python diskcache   # builds llama.cpp for this CPU (CMAKE_ARGS="-DGGML_NATIVE=ON")
    python3 benchmarks/llamacpp_peer.py --n 2 --max-new-tokens 64 --int8 --out benchmarks/results/llamacpp_peer
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from gpu_check import device_name
from spec_bench import load_items

from rag_speculate import NGramTrieDrafter, SpeculativeEngine
from rag_speculate.files.cache import cache_dir
from rag_speculate.models.packaged import gguf_path

MODEL = "qwen2.5-coder-1.5b-instruct"
DATA = Path(__file__).resolve().parent / "data" / "spec_bench_dev.jsonl"


def llama_method(llm, eos: set[int]):
    def run(ids: list[int], documents, max_new_tokens: int) -> dict:
        started, first, tokens = time.perf_counter(), None, []
        # reset: no reuse of the previous prompt's KV, every method prefills in full.
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter()
            if token in eos:
                break
            tokens.append(token)
            if len(tokens) == max_new_tokens:
                break
        return {"ttft_s": first - started, "total_s": time.perf_counter() - started, "tokens": tokens}

    return run


def engine_method(engine: SpeculativeEngine):
    def run(ids: list[int], documents, max_new_tokens: int) -> dict:
        engine.prompt_cache.clear()  # every method prefills in full
        started = time.perf_counter()
        result = engine.generate(ids, documents=documents, max_new_tokens=max_new_tokens)
        stats = result.stats
        return {"ttft_s": stats.time_to_first_token_s, "total_s": time.perf_counter() - started, "tokens": result.token_ids}

    return run


def q8_0_copy(source: Path) -> Path:
    """`source` with every quantized tensor dequantized and requantized to Q8_0 (the `gguf` package's
    quantizer, llama.cpp's reference), metadata kept; written once into the cache."""
    target = cache_dir() / "gguf" / f"{source.stem}-q8_0.gguf"
    if target.exists():
        return target
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target.with_suffix(".partial"), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        value = gguf.LlamaFileType.MOSTLY_Q8_0 if field.name == "general.file_type" else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
        else:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    target.with_suffix(".partial").rename(target)
    return target


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2, help="items per category")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="activations (default: the CPU's, devices.default_dtype)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--int8", action="store_true", help="also llama.cpp at Q8_0, ours in int8, and ours in fp32 (the reference)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/llamacpp_peer"))
    args = parser.parse_args()
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    ours = SpeculativeEngine.from_pretrained(MODEL, NGramTrieDrafter(), dtype=dtype, device="cpu", quantization="gguf")
    plain = SpeculativeEngine(ours.model, ours.tokenizer, draft_budget=0)
    methods = {"llama.cpp": None, "llama.cpp prompt lookup": None, "ours gguf plain": engine_method(plain),
               "ours gguf": engine_method(ours)}
    options = {"model_path": str(gguf_path(MODEL)), "n_ctx": 4096, "n_threads": args.threads, "n_batch": 512, "verbose": False}
    # Speculation needs every fed position's logits (logits_all), so it is an instance of its own.
    lookup = LlamaPromptLookupDecoding(num_pred_tokens=10)
    eos = set(ours.eos_token_ids)
    methods["llama.cpp"] = llama_method(Llama(**options), eos)
    methods["llama.cpp prompt lookup"] = llama_method(Llama(**options, draft_model=lookup, logits_all=True), eos)
    if args.int8:
        int8 = SpeculativeEngine.from_pretrained(MODEL, NGramTrieDrafter(), dtype=dtype, device="cpu", quantization="int8")
        full = SpeculativeEngine.from_pretrained(MODEL, NGramTrieDrafter(), dtype=dtype, device="cpu", draft_budget=0)
        methods |= {"llama.cpp Q8_0": llama_method(Llama(**options | {"model_path": str(q8_0_copy(gguf_path(MODEL)))}), eos),
                    "ours int8": engine_method(int8),
                    "ours int8 plain": engine_method(SpeculativeEngine(int8.model, int8.tokenizer, draft_budget=0)),
                    "ours fp32 plain": engine_method(full)}  # fmt: skip
    items = load_items(ours, DATA, ["summarization", "rag"], args.n)
    for run in methods.values():  # warm-up: kernels built, cost curves timed, llama.cpp's buffers
        run(items[0].prompt_ids[:64], None, 4)

    rows = []
    for i, item in enumerate(items):
        order = list(methods)[i % len(methods):] + list(methods)[: i % len(methods)]
        runs = {name: methods[name](item.prompt_ids, item.documents, args.max_new_tokens) for name in order}
        row = {"item": item.id, "category": item.category, "prompt_tokens": len(item.prompt_ids),
               "speculative_equals_plain": runs["ours gguf"]["tokens"] == runs["ours gguf plain"]["tokens"],
               "shared_with_llama_cpp": shared_prefix(runs["ours gguf plain"]["tokens"], runs["llama.cpp"]["tokens"]),
               "runs": runs}  # fmt: skip
        if args.int8:
            row |= {"int8_speculative_equals_plain": runs["ours int8"]["tokens"] == runs["ours int8 plain"]["tokens"],
                    "gguf_equals_fp32": runs["ours gguf plain"]["tokens"] == runs["ours fp32 plain"]["tokens"],
                    "int8_equals_fp32": runs["ours int8 plain"]["tokens"] == runs["ours fp32 plain"]["tokens"]}  # fmt: skip
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}
                         | {m: round(r["total_s"], 2) for m, r in runs.items()}), flush=True)  # fmt: skip

    def rates(name: str, category: str) -> tuple[float, float, float, float]:
        """Medians of prefill and decode tokens/s, the decode rate over all the category's tokens, median end to end s."""
        runs = [r["runs"][name] | {"prompt_tokens": r["prompt_tokens"]} for r in rows if r["category"] == category]
        decoded = [(len(run["tokens"]) - 1, run["total_s"] - run["ttft_s"]) for run in runs]
        prefill = statistics.median(run["prompt_tokens"] / run["ttft_s"] for run in runs)
        decode = statistics.median(tokens / seconds for tokens, seconds in decoded)
        pooled = sum(tokens for tokens, _ in decoded) / sum(seconds for _, seconds in decoded)
        return prefill, decode, pooled, statistics.median(run["total_s"] for run in runs)

    lines = [f"{device_name(torch.device('cpu'))}, {args.threads} threads, {MODEL} Q4_K_M, activations in "
             f"{next(ours.model.parameters()).dtype}, greedy, {args.max_new_tokens} new tokens at most, medians",
             "", "| category (items) | method | prefill tok/s | decode tok/s | decode tok/s, all tokens | end to end s |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for category in dict.fromkeys(r["category"] for r in rows):
        count = sum(r["category"] == category for r in rows)
        for name in methods:
            prefill, decode, pooled, total = rates(name, category)
            lines.append(f"| {category} ({count}) | {name} | {prefill:.0f} | {decode:.1f} | {pooled:.1f} | {total:.2f} |")
    lines += ["", f"ours speculative = ours plain: {sum(r['speculative_equals_plain'] for r in rows)}/{len(rows)}; "
              f"tokens shared with llama.cpp's answer before they part (median): "
              f"{statistics.median(r['shared_with_llama_cpp'] for r in rows):.0f}"]  # fmt: skip
    if args.int8:
        lines += [f"int8 speculative = int8 plain: {sum(r['int8_speculative_equals_plain'] for r in rows)}/{len(rows)}; "
                  f"answers equal to fp32's: gguf {sum(r['gguf_equals_fp32'] for r in rows)}/{len(rows)}, "
                  f"int8 {sum(r['int8_equals_fp32'] for r in rows)}/{len(rows)}"]  # fmt: skip
    table = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) for k, v in vars(args).items()} | {"torch": torch.__version__, "cpu": device_name(torch.device("cpu"))}
    args.out.with_suffix(".json").write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
