"""Agentic RAG with LlamaIndex: a FunctionAgent that decides to search the shipped Natural Questions
corpus through a tool, then answers from what the search returned, on SpeculativeHFLLM.

    python examples/agentic_rag_llamaindex.py                                # the packaged Qwen2.5-Coder-1.5B
    python examples/agentic_rag_llamaindex.py --question "who wrote the declaration of independence"

The corpus index is the one `rag-speculate demo` builds (MiniLM embeddings in FAISS, a REST datastore
over all the corpus's tokens; built once into the model cache, reused after). The model sees the search
tool through its own chat template and calls it (Qwen's template asks for `<tool_call>{...}</tool_call>`;
the adapter also reads the fenced or bare JSON calls this model often writes instead); the agent runs the
call, and the passages come back to the model as a tool result.
Decoding drafts from three places: the prompt, the tool's result in the history (the engine feeds
tool results to the drafters) and the whole corpus (REST). The output is the model's own greedy
answer, token for token; the tool call is printed as the model wrote it, then the answer and what the
acceleration did on each of the model's turns. A model whose chat template renders no tools (SmolLM2's)
cannot be offered one: use a model with tool calling in its template.
"""

import argparse
import asyncio
from collections.abc import Sequence
from pathlib import Path

from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCall, ToolCallResult
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.tools import FunctionTool
from llama_index.llms.rag_speculate import SpeculativeHFLLM
from pydantic import Field

from rag_speculate import SpeculativeEngine
from rag_speculate.drafters import NGramTrieDrafter, RESTDrafter
from rag_speculate.files.cache import cache_dir
from rag_speculate.retrieval.corpus import CorpusIndex
from rag_speculate.retrieval.nq import nq_documents, nq_questions

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
# A 1.5B model is a fragile agent: this prompt (Qwen's own default, and what to answer from) got one search
# and an answer over its passages for each of the first questions; prompts that piled up instructions
# ("search first", "answer in one short sentence") got no search, or the same search again and again.
SYSTEM_PROMPT = (
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant. "
    "Answer questions from the passages that search_passages returns."
)


class TurnStats(BaseEventHandler):
    """The acceleration stats of every chat turn the LLM finished (each agent step is one)."""

    turns: list = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "TurnStats"

    def handle(self, event: BaseEvent, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            stats = event.response.additional_kwargs.get("speculative_stats")
            if stats is not None:
                self.turns.append(stats)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a model whose chat template renders tools (default {DEFAULT_MODEL})")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda when available, else cpu)")
    parser.add_argument("--question", action="append", help="ask this (repeatable); default: the corpus's first questions")
    parser.add_argument("--questions", type=int, default=2, help="how many corpus questions to ask without --question")
    parser.add_argument("--top-k", type=int, default=3, help="passages the search tool returns")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per model turn at most")
    parser.add_argument("--index-dir", type=Path, default=None, help="where the corpus index lives (default: the demo's, in the model cache)")
    return parser.parse_args(argv)


def search_tool(index: CorpusIndex, k: int) -> FunctionTool:
    """The agent's one tool: the corpus index's top `k` passages for a query, with their titles."""

    def search_passages(query: str) -> str:
        """Search Wikipedia passages for the query; returns the best matching passages with their titles."""
        chunks = index.search(query, k)
        return "\n\n".join(f"[{i}] {c.title}\n{c.text}" for i, c in enumerate(chunks, 1))

    return FunctionTool.from_defaults(search_passages)


async def ask(agent: FunctionAgent, question: str) -> tuple[list[dict], str]:
    """Runs the agent on `question`, printing each tool call as it happens; returns the calls and the answer."""
    handler = agent.run(question)
    calls = []
    async for event in handler.stream_events():
        if isinstance(event, ToolCall):
            print(f"   tool call: {event.tool_name}({', '.join(f'{k}={v!r}' for k, v in event.tool_kwargs.items())})")
        elif isinstance(event, ToolCallResult):
            titles = [line.split("] ", 1)[1] for line in str(event.tool_output.content).splitlines() if line.startswith("[")]
            print(f"   tool result: {len(titles)} passages: {'; '.join(titles)}")
            calls.append({"tool": event.tool_name, "arguments": event.tool_kwargs, "sources": titles})
        elif isinstance(event, AgentOutput) and event.tool_calls:
            raw = event.raw.get("text") if isinstance(event.raw, dict) else None
            if raw:
                print(f"   the model wrote: {raw.strip()!r}")
    output = await handler
    return calls, str(output.response.content or "")


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    base = SpeculativeEngine.from_pretrained(args.model, device=args.device)
    folder = args.index_dir or cache_dir() / "indexes" / f"nq-{Path(args.model).name}"
    print(f"Corpus index: {folder} (built once, reused after)")
    index = CorpusIndex.build(nq_documents(), folder, tokenizer=base.tokenizer, progress=True)
    # The same weights, drafting from the prompt and tool results (trie) and from the whole corpus (REST).
    engine = SpeculativeEngine(base.model, base.tokenizer, [NGramTrieDrafter(), RESTDrafter(index.datastore)], name=base.name)
    llm = SpeculativeHFLLM(engine=engine, max_new_tokens=args.max_tokens)
    if not llm.metadata.is_function_calling_model:
        raise SystemExit(f"{args.model}'s chat template renders no tools: pick a model with tool calling in its template")
    # initial_tool_choice: each question's first turn asks for a search (an instruction after the question:
    # the decoding is not constrained, so the answer stays the model's own).
    agent = FunctionAgent(
        tools=[search_tool(index, args.top_k)], llm=llm, system_prompt=SYSTEM_PROMPT, initial_tool_choice="search_passages"
    )
    stats = TurnStats()
    get_dispatcher().add_event_handler(stats)

    asked = [(q, []) for q in args.question] if args.question else [(q.question, q.answers) for q in nq_questions()[: args.questions]]
    results = []
    for question, gold in asked:
        print(f"\nQ: {question}")
        stats.turns = []
        calls, answer = asyncio.run(ask(agent, question))
        print(f"A: {answer.strip()}")
        if gold:
            print(f"   gold answers: {' | '.join(gold)}")
        for i, s in enumerate(stats.turns, 1):
            print(
                f"   model turn {i}: {s['new_tokens']} tokens in {s['target_forwards']} forwards "
                f"({s['tokens_per_forward']:.2f} tokens/forward), prompt {s['prompt_tokens']} tokens "
                f"({s['cached_prompt_tokens']} from the prompt cache), first token after {s['time_to_first_token_s']:.2f} s"
            )
        results.append({"question": question, "answer": answer, "tool_calls": calls, "turns": stats.turns, "gold": gold})
    return results


if __name__ == "__main__":
    main()
