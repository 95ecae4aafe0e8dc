"""Agentic RAG with LangChain: ChatSpeculativeHF decides whether to search and for what, a retriever
tool searches the shipped Natural Questions index, and the model answers from what the tool returned.

    python examples/agentic_rag.py                     # Qwen2.5-Coder-1.5B, the first NQ question
    python examples/agentic_rag.py --question "who wrote the declaration of independence"

A plain tool-calling loop on langchain_core (bind_tools, tool calls, ToolMessages), the shape of
LangGraph's agentic RAG (decide, retrieve, answer); LangGraph's agents take the same model
unchanged. The index is the one `rag-speculate demo` builds (built here on first use, then
reused). Every model turn is then decoded again with plain greedy decoding (`model.generate`,
through the same CPU kernels) from the same prompt ids: the script prints both times and whether
every output is identical, token for token.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_rag_speculate import ChatSpeculativeHF
from pydantic import ValidationError

from rag_speculate import SpeculativeEngine
from rag_speculate.cpu.kernels import FastKernels
from rag_speculate.decoding.baseline import timed_generate
from rag_speculate.drafters import NGramTrieDrafter, RESTDrafter
from rag_speculate.files.cache import cache_dir
from rag_speculate.retrieval.corpus import CorpusIndex
from rag_speculate.retrieval.nq import nq_documents, nq_questions


class RecordingEngine(SpeculativeEngine):
    """The engine, keeping each generation's prompt ids and result: what plain decoding is compared with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generations: list[tuple[list[int], Any]] = []

    def stream(self, prompt: Any, **options: Any):
        prompt_ids = self.prepare(prompt, **options).prompt_ids
        stream = super().stream(prompt, **options)
        self.generations.append((prompt_ids, stream))
        return stream


def log(message: str) -> None:
    print(f"[agentic_rag] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="qwen2.5-coder-1.5b-instruct", help="a packaged model whose chat template takes tools"
    )
    parser.add_argument("--question", default=None, help="default: the NQ question --item")
    parser.add_argument("--item", type=int, default=0, help="which shipped NQ question to ask")
    parser.add_argument("-k", "--top-k", type=int, default=3, help="passages the tool returns per search")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=3, help="searches before the agent gives up")
    parser.add_argument("--no-baseline", action="store_true", help="skip the plain greedy comparison")
    return parser.parse_args(argv)


def stream_turn(model: Any, messages: list[BaseMessage]) -> AIMessage:
    """One model turn, streamed to the screen and added to `messages`: text as it comes, a call whole."""
    reply = None
    for chunk in model.stream(messages):
        print(chunk.content, end="", flush=True)
        reply = chunk if reply is None else reply + chunk
    if reply.content:
        print()
    messages.append(reply)
    for call in reply.tool_calls:
        print(f"Tool call: {call['name']}({call['args']})")
    return reply


def run_tool(search: Any, call: dict) -> ToolMessage:
    """The tool's answer to a call; arguments that do not fit the tool come back as an error to retry."""
    try:
        result = search.invoke(call)  # a ToolMessage answering this call
    except ValidationError as error:
        problem = error.errors()[0]
        result = ToolMessage(
            f"Error: {problem['msg']}: {'.'.join(map(str, problem['loc']))}. "
            "Call the tool again with fitting arguments.",
            tool_call_id=call["id"], status="error",
        )
        print(f"  -> {result.content}")
        return result
    titles = [line.split("] ", 1)[1] for line in result.content.split("\n") if line.startswith("[")]
    print(f"  -> {len(titles)} passages: {'; '.join(titles)}")
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    question = args.question or nq_questions()[args.item].question

    loaded = SpeculativeEngine.from_pretrained(args.model, progress=log)
    folder = cache_dir() / "indexes" / f"nq-{args.model}"
    log(f"indexing the shipped Natural Questions corpus into {folder} (once; later runs reuse it)")
    index = CorpusIndex.build(nq_documents(), folder, tokenizer=loaded.tokenizer, progress=True, log=log)
    # Drafts from the prompt and tool results (trie) and from the whole corpus (REST), in one tree.
    engine = RecordingEngine(
        loaded.model, loaded.tokenizer, [NGramTrieDrafter(), RESTDrafter(index.datastore)], name=loaded.name
    )
    chat = ChatSpeculativeHF.from_engine(engine, model=args.model, max_tokens=args.max_tokens)

    @tool
    def search_wikipedia(query: str) -> str:
        """Search Wikipedia for a query; returns the best matching passages with their titles."""
        chunks = index.search(query, args.top_k)
        return "\n\n".join(f"[{i}] {c.title}\n{c.text}" for i, c in enumerate(chunks, 1))

    # The model decides whether to search, and for what; once the tool has returned passages, it answers
    # from them with the tools off (tool_choice="none"): offered the tool again, Qwen2.5-Coder-1.5B
    # tends to call it again rather than answer. A call whose arguments do not fit the tool goes back
    # to the model as an error, and it decides again.
    decide = chat.bind_tools([search_wikipedia])
    answer = chat.bind_tools([search_wikipedia], tool_choice="none")
    log("warming up")
    engine.generate([1, 2, 3], max_new_tokens=4)
    # The first forward over a prompt this long pays one-off allocations, which would fall on whichever
    # decoding runs first: pay them on the model alone.
    with FastKernels() if engine.traits.kernels else contextlib.nullcontext():
        timed_generate(engine.model, engine.tokenizer.encode(search_wikipedia.invoke({"query": question})), 1)

    print(f"Question: {question}\n")
    messages: list[BaseMessage] = [HumanMessage(question)]
    reply = None
    for _ in range(args.max_steps):
        reply = stream_turn(decide, messages)
        if not reply.tool_calls:
            break
        results = [run_tool(search_wikipedia, call) for call in reply.tool_calls]
        messages.extend(results)
        if all(r.status == "success" for r in results):
            reply = stream_turn(answer, messages)
            break
    print()

    turns = [(ids, stream.result) for ids, stream in engine.generations]
    report = {"question": question, "answer": reply.content, "messages": messages, "turns": []}
    if args.no_baseline:
        return report

    log("the same turns with plain greedy decoding" + (" through the same kernels" if engine.traits.kernels else ""))
    header = ("turn", "new tokens", "prompt (cached)", "speculative s", "plain s", "tok/forward")
    print(f"{header[0]:>4} {header[1]:>10} {header[2]:>16} {header[3]:>13} {header[4]:>8} {header[5]:>11}  identical")
    fast_total = plain_total = fast_decode = plain_decode = 0.0
    identical = True
    for i, (prompt_ids, result) in enumerate(turns, 1):
        with FastKernels() if engine.traits.kernels else contextlib.nullcontext():
            plain = timed_generate(engine.model, prompt_ids, args.max_tokens)
        s = result.stats
        fast_s = s.time_to_first_token_s + s.decode_s
        same = plain.token_ids == result.token_ids
        identical &= same
        fast_total, plain_total = fast_total + fast_s, plain_total + plain.total_s
        fast_decode, plain_decode = fast_decode + s.decode_s, plain_decode + plain.decode_s
        prompt = f"{s.prompt_tokens} ({s.cached_prompt_tokens})"
        times = f"{fast_s:>13.2f} {plain.total_s:>8.2f}"
        print(f"{i:>4} {s.new_tokens:>10} {prompt:>16} {times} {s.tokens_per_forward:>11.2f}  {same}")
        report["turns"].append({"stats": s.as_dict(), "plain_s": plain.total_s, "identical": same})
    decode = f"{plain_decode / fast_decode:.2f}x" if fast_decode > 0 else "-"
    # End to end includes the prompt cache: a later turn prefills only what the earlier ones did not.
    print(f"\nSpeed-up: {plain_total / fast_total:.2f}x end to end, {decode} decode; identical output: {identical}")
    report["identical"] = identical
    return report


if __name__ == "__main__":
    main()
