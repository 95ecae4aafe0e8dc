"""The `rag-speculate` command line (the only place in the library that prints).

    rag-speculate index CORPUS --out DIR    chunk, embed and index a corpus; build its REST datastore
    rag-speculate ask DIR "question"        retrieve, answer with speculative decoding, show sources and stats
    rag-speculate demo                      the whole pipeline on the shipped Natural Questions corpus,
                                            accelerated and plain, with timings
    rag-speculate serve --model NAME        an OpenAI-compatible server (--index DIR to retrieve;
                                            --ray --replicas N for replicas on Ray Serve)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..cpu.kernels import FastKernels
from ..decoding.baseline import timed_generate
from ..decoding.result import GenerationResult
from ..engine import SpeculativeEngine
from ..errors import RagSpeculateError
from ..files.cache import cache_dir
from ..models.loading import load_tokenizer
from ..quantization.layer import METHODS
from ..retrieval.corpus import ChunkingOptions, CorpusIndex, read_corpus
from .engines import shared_engine
from .openai.config import BODY_TIMEOUT_S, SEND_TIMEOUT_S, SHUTDOWN_TIMEOUT_S
from .prompt import Prepared, prepare
from .warm import read_warm_file

# What `--help` opens with: the commands, for a user.
USAGE = "Answer questions over your documents with a local model, faster, with exactly its own output.\n\n" + __doc__.split("\n\n", 1)[1]
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEMO_QUESTION = 0  # the shipped corpus's first question, unless --question or --item says otherwise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rag-speculate", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    index = commands.add_parser("index", help="index a corpus for retrieval and drafting")
    index.add_argument("corpus", type=Path, help="a folder of .txt/.md files, or a .jsonl(.gz) file")
    index.add_argument("--out", type=Path, required=True, help="the index folder to write")
    index.add_argument("--text-field", default="text", help="the JSONL field holding the text (default: text)")
    _add_index_options(index)
    _add_model_options(index)

    ask = commands.add_parser("ask", help="answer a question from an index")
    ask.add_argument("index", type=Path, help="a folder written by `rag-speculate index`")
    ask.add_argument("question")
    ask.add_argument("--embedding-model", default=None, help="the embedding model's folder, for an index built from one (default: the one its manifest names)")
    _add_answer_options(ask)
    _add_drafting_options(ask)
    _add_cache_options(ask)
    _add_model_options(ask)
    _add_quantization_options(ask)
    _add_graph_options(ask)

    demo = commands.add_parser("demo", help="index the shipped NQ corpus, then answer accelerated and plain")
    demo.add_argument("--question", help="your own question (default: one of the corpus's questions)")
    demo.add_argument("--item", type=int, default=DEMO_QUESTION, help="which corpus question to ask (0-2654)")
    demo.add_argument("--index-dir", type=Path, default=None, help="where to keep the corpus index (default: the model cache)")
    _add_index_options(demo)
    _add_answer_options(demo)
    _add_drafting_options(demo)
    _add_model_options(demo)
    _add_quantization_options(demo)
    _add_graph_options(demo)

    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument("--index", type=Path, default=None, help="an index folder: requests may ask to retrieve from it, and the REST drafter drafts from its corpus")
    serve.add_argument("--embedding-model", default=None, help="the embedding model's folder, for an index built from one")
    serve.add_argument("--served-model-name", default=None, help="the name clients send as \"model\" (default: the model's)")
    serve.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-queued", type=int, default=16, help="requests that may wait for the engine; more get 503")
    serve.add_argument("--max-batch", type=int, default=None,
                       help="generations the engine runs together, every step one forward for all (default: 8)")
    serve.add_argument("--api-key", default=os.environ.get("RAG_SPECULATE_API_KEY"),
                       help="require Authorization: Bearer KEY on every endpoint but /health (default: $RAG_SPECULATE_API_KEY)")
    serve.add_argument("--send-timeout", type=float, default=SEND_TIMEOUT_S,
                       help="seconds a streamed answer's client may take nothing before it is cut off (default: %(default)s)")
    serve.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                       help="seconds a request body may take to arrive before a 408 (default: %(default)s)")
    serve.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                       help="on SIGTERM or SIGINT, seconds the running generation gets to finish before it is stopped (default: %(default)s)")
    serve.add_argument("--ray", action="store_true", help="run replicas on Ray Serve (a local Ray, or the cluster RAY_ADDRESS names)")
    serve.add_argument("--replicas", type=int, default=1, help="with --ray: engines, each a replica of its own")
    serve.add_argument("--cpus-per-replica", type=float, default=1.0, help="with --ray: the CPUs Ray reserves for each replica")
    serve.add_argument("--gpus-per-replica", type=float, default=0.0, help="with --ray: the GPUs Ray reserves for each replica")
    serve.add_argument("--warm", type=Path, default=None,
                       help="a JSON Lines file of prompts to prefill before the first request: each line a string, or an "
                            'object with "prompt" or "messages" and optional "documents"')
    _add_drafting_options(serve)
    _add_cache_options(serve)
    _add_model_options(serve)
    _add_quantization_options(serve)
    _add_graph_options(serve)

    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return {"index": run_index, "ask": run_ask, "demo": run_demo, "serve": run_serve}[args.command](args)
    except RagSpeculateError as error:
        print(f"rag-speculate {args.command}: {error}", file=sys.stderr)
        return 1


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="packaged model name, .gguf file, folder or HF id")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda when available, else cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def _add_quantization_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", choices=METHODS, default=None,
                        help="the target's linear layers as int8 or 4-bit weights, or a GGUF file's own quantized tensors (gguf); "
                             "on the CPU, answers exactly the quantized model's own (default: none)")
    parser.add_argument("--draft-quantization", choices=METHODS, default=None,
                        help="the same for --draft-model (default: int8 computing in int8 on a CPU)")


def _add_graph_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="replay each shape of the verification step in a CUDA graph "
                             "(default: on where the model is on a CUDA GPU)")


def _add_cache_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-cache-dir", type=Path, default=None,
                        help="a folder for the prompt cache's disk tier: prompts prefilled once are reused after restarts "
                             "and by every process and replica naming the same folder")
    parser.add_argument("--prompt-cache-disk-bytes", type=int, default=None,
                        help="what the --prompt-cache-dir folder may hold, in bytes (default: 8 GiB)")


def _add_index_options(parser: argparse.ArgumentParser) -> None:
    defaults = ChunkingOptions()
    parser.add_argument("--embedding-model", default=None, help="sentence-transformers name or folder (default: bge-small if cached, else the packaged all-MiniLM-L6-v2)")
    parser.add_argument("--chunk-tokens", type=int, default=defaults.chunk_tokens)
    parser.add_argument("--chunk-overlap", type=int, default=defaults.chunk_overlap)
    parser.add_argument("--ivf-lists", type=int, default=defaults.ivf_lists, help="0: exact search; n: FAISS IVF with n lists")
    parser.add_argument("--ivf-probe", type=int, default=defaults.ivf_probe, help="IVF lists searched per query")


def _add_answer_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-k", "--top-k", type=int, default=5, help="chunks retrieved into the prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)


def _add_drafting_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-model", default=None,
                        help="a small model sharing the target's tokenizer, to draft with too (Ouroboros; int8 on a CPU)")
    parser.add_argument("--draft-budget", type=int, default=None,
                        help="draft tokens a generation verifies per step at most; 0: no drafting (default: 16)")


def _progress(message: str) -> None:
    print(f"[rag-speculate] {message}", file=sys.stderr, flush=True)


def _options(args: argparse.Namespace) -> ChunkingOptions:
    return ChunkingOptions(args.chunk_tokens, args.chunk_overlap, args.ivf_lists, args.ivf_probe)


def run_index(args: argparse.Namespace) -> int:
    documents = read_corpus(args.corpus, text_field=args.text_field)
    # Chunks are cut and stored by the model's token ids: its tokenizer is all an index needs of it.
    tokenizer = load_tokenizer(args.model, progress=_progress)
    _progress(f"indexing {len(documents)} documents from {args.corpus}")
    index = CorpusIndex.build(
        documents, args.out, tokenizer=tokenizer, embedder=args.embedding_model, options=_options(args), progress=True, log=_progress
    )
    _print_index(index)
    return 0


def run_ask(args: argparse.Namespace) -> int:
    index = CorpusIndex.load(args.index, embedder=args.embedding_model)
    engine = _engine(args, index, prompt_cache_dir=args.prompt_cache_dir, prompt_cache_disk_bytes=args.prompt_cache_disk_bytes)
    result, prepared = _answer(engine, index, args.question, args.top_k, args.max_new_tokens)
    chunks = prepared.sources
    print(f"Question: {args.question}\n\nAnswer:\n{result.text}\n")
    _print_sources(chunks)
    _print_stats(result)
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from ..retrieval.nq import nq_documents, nq_questions

    questions = nq_questions()
    if args.question is None and not 0 <= args.item < len(questions):
        raise SystemExit(f"--item must be in [0, {len(questions) - 1}]")
    question = args.question or questions[args.item].question
    answers = [] if args.question else questions[args.item].answers

    tokenizer = load_tokenizer(args.model, progress=_progress)
    folder = args.index_dir or cache_dir() / "indexes" / f"nq-{Path(args.model).name}"
    _progress(f"indexing the shipped Natural Questions corpus into {folder} (once; later runs reuse it)")
    index = CorpusIndex.build(
        nq_documents(), folder, tokenizer=tokenizer, embedder=args.embedding_model, options=_options(args), progress=True, log=_progress
    )
    engine = _engine(args, index)
    _progress("warming up")
    engine.generate([1, 2, 3], max_new_tokens=4)
    # The first forward over a prompt this long pays one-off allocations, which would fall on
    # whichever answer runs first: pay them on the model alone.
    timed_generate(engine.model, prepare(engine, question, chunks=index.search(question, args.top_k)).request.prompt_ids, 1)

    _progress("answering with speculative decoding")
    result, prepared = _answer(engine, index, question, args.top_k, args.max_new_tokens)
    chunks = prepared.sources
    # Through the engine's kernels, as its own forwards run: in bf16 only then is the output promised
    # token for token (docs/design.md, "Losslessness"), and the speed-up is speculation's alone.
    kernels = " through the same kernels" if engine.traits.kernels else ""
    _progress(f"answering with plain greedy decoding (model.generate{kernels})")
    plain = timed_generate(engine.model, prepared.request.prompt_ids, args.max_new_tokens,
                           context=FastKernels if engine.traits.kernels else contextlib.nullcontext)

    print(f"Question: {question}\n")
    print(f"Answer (speculative):\n{result.text}\n")
    print(f"Answer (plain greedy{kernels}):\n{engine.tokenizer.decode(plain.token_ids, skip_special_tokens=True)}\n")
    _print_sources(chunks)
    _print_stats(result)
    # Up to the first token: the drafters' setup (a draft model's own prefill) and the prefill.
    fast_s = result.stats.time_to_first_token_s + result.stats.decode_s
    n = len(plain.token_ids)
    print(f"\nPlain greedy: {n} tokens in {plain.total_s:.2f} s ({n / plain.total_s:.2f} tok/s), decode {plain.decode_s:.2f} s")
    print(f"Speculative:  {result.stats.new_tokens} tokens in {fast_s:.2f} s ({result.stats.new_tokens / fast_s:.2f} tok/s), "
          f"decode {result.stats.decode_s:.2f} s")
    # Prefill is the same work for both and speculation cannot touch it: decode is where it acts.
    decode = f"{plain.decode_s / result.stats.decode_s:.2f}x" if result.stats.decode_s > 0 else "-"
    print(f"Speed-up: {plain.total_s / fast_s:.2f}x end to end, {decode} decode; identical output: {plain.token_ids == result.token_ids}")
    if answers:
        found = any(a.lower() in result.text.lower() for a in answers)
        print(f"Reference answer{'s' if len(answers) > 1 else ''}: {answers} (found in the answer: {found})")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from .openai import ServerConfig

    config = ServerConfig(
        model=args.model, index=args.index, embedding_model=args.embedding_model, draft_model=args.draft_model, device=args.device, dtype=args.dtype,
        quantization=args.quantization, draft_quantization=args.draft_quantization,
        served_name=args.served_model_name, max_queued=args.max_queued, max_batch=args.max_batch, draft_budget=args.draft_budget,
        cuda_graphs=args.cuda_graphs,
        api_key=args.api_key or None,
        send_timeout_s=args.send_timeout, body_timeout_s=args.body_timeout, shutdown_timeout_s=args.shutdown_timeout,
        prompt_cache_dir=args.prompt_cache_dir, prompt_cache_disk_bytes=args.prompt_cache_disk_bytes,
        warm=read_warm_file(args.warm) if args.warm else (),
    )
    if args.ray:
        from .openai import ray_serve

        # The replicas load the model: a file that cannot be one is refused here, in one line, before Ray starts.
        load_tokenizer(args.model)

        _progress(f"serving {config.name} on http://{args.host}:{args.port}/v1 with {args.replicas} Ray Serve replica(s)")
        ray_serve.run(config, args.replicas, args.host, args.port, args.cpus_per_replica, args.gpus_per_replica)
        return 0
    from .openai import Server, load
    from .openai.standalone import serve

    engine, index = load(config)
    server = Server(engine, config.name, index, max_queued=config.max_queued)
    _progress(f"serving {config.name} on http://{args.host}:{args.port}/v1")
    serve(server, config, args.host, args.port)
    return 0


def _engine(args: argparse.Namespace, index: CorpusIndex, **options: Any) -> SpeculativeEngine:
    """The one engine `ask` and `demo` answer with, drafting from the index and the options given."""
    return shared_engine(args.model, device=args.device, quantization=args.quantization, index=index, draft_model=args.draft_model,
                         draft_quantization=args.draft_quantization, draft_budget=args.draft_budget, cuda_graphs=args.cuda_graphs,
                         progress=_progress, **options)  # fmt: skip


def _answer(engine: SpeculativeEngine, index: CorpusIndex, question: str, k: int, max_new_tokens: int) -> tuple[GenerationResult, Prepared]:
    prepared = prepare(engine, question, chunks=index.search(question, k), max_new_tokens=max_new_tokens)
    return engine.stream_request(prepared.request).collect(), prepared


def _print_index(index: CorpusIndex) -> None:
    m = index.manifest
    kind = f"IVF with {m['options']['ivf_lists']} lists" if m["options"]["ivf_lists"] else "exact inner product"
    print(f"Index {index.path}: {m['documents']} documents, {m['chunks']} chunks, {m['tokens']} tokens")
    print(f"  embeddings: {m['embedding']['name']} ({m['embedding']['dimension']} dimensions), FAISS {kind}")
    print(f"  REST datastore: {index.datastore.num_tokens} tokens")


def _print_sources(chunks) -> None:
    print("Sources:")
    for i, c in enumerate(chunks, 1):
        print(f"  [{i}] {c.score:.3f} {c.title or c.id}: {c.text[:80]!r}")


def _print_stats(result: GenerationResult) -> None:
    s = result.stats
    print(f"Stats: {s.new_tokens} new tokens from a {s.prompt_tokens}-token prompt in {s.target_forwards} target forwards "
          f"({s.tokens_per_forward:.2f} tokens/forward, {s.verification} verification)")
    print(f"  drafted {dict(s.drafted_tokens)}, accepted {dict(s.accepted_tokens)}, "
          f"decode forwards by tokens fed {dict(sorted(s.forward_sizes.items()))}")
    print(f"  time to first token {s.time_to_first_token_s:.2f} s, prefill {s.prefill_s:.2f} s, "
          f"decode {s.decode_s:.2f} s ({s.decode_tokens_per_s:.2f} tok/s), drafting {s.drafting_s * 1000:.1f} ms (+ {s.draft_setup_s * 1000:.1f} ms setup)")
    print(f"  finish reason: {result.finish_reason}")


if __name__ == "__main__":
    sys.exit(main())
