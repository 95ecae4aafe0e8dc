"""RAG with LlamaIndex over the shipped NQ passages: a FAISS VectorStoreIndex and a streaming query engine
answered by SpeculativeHFLLM.

    python examples/llamaindex_rag.py                     # the packaged Qwen2.5-Coder-1.5B
    python examples/llamaindex_rag.py --model smollm2-135m-instruct --question "who wrote hamlet"

The retrieved nodes reach the drafters through `DraftDocumentsPostprocessor`; the answer streams token
by token, and an instrumentation event handler reads the acceleration stats off the LLM's response.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import faiss
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.schema import TextNode
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.llms.rag_speculate import DraftDocumentsPostprocessor, SpeculativeHFLLM
from llama_index.vector_stores.faiss import FaissVectorStore

sys.path.insert(0, str(Path(__file__).parent))
from nq_corpus import SYSTEM_PROMPT, load_passages, parse_args, questions, report

from rag_speculate.retrieval.corpus import packaged_embedding_path


class SpeculativeStats(BaseEventHandler):
    """Keeps the acceleration stats of the last chat the LLM finished (streamed or not)."""

    stats: dict | None = None

    @classmethod
    def class_name(cls) -> str:
        return "SpeculativeStats"

    def handle(self, event: BaseEvent, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.stats = event.response.additional_kwargs.get("speculative_stats", self.stats)


def build_index(passages: list[dict]) -> VectorStoreIndex:
    """A FAISS inner-product index over normalized MiniLM embeddings: cosine similarity."""
    embed_model = HuggingFaceEmbedding(model_name=str(packaged_embedding_path()), device="cpu", normalize=True)
    dimension = len(embed_model.get_text_embedding("dimension probe"))
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(dimension))
    nodes = [TextNode(id_=p["id"], text=p["text"], metadata={"title": p["title"]}) for p in passages]
    return VectorStoreIndex(
        nodes, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=embed_model
    )


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], argv)
    passages = load_passages(args.passages)
    index = build_index(passages)
    llm = SpeculativeHFLLM(args.model, dtype=args.dtype, max_new_tokens=args.max_tokens, system_prompt=SYSTEM_PROMPT)
    engine = index.as_query_engine(
        llm=llm, streaming=True, similarity_top_k=args.top_k, node_postprocessors=[DraftDocumentsPostprocessor()]
    )
    stats = SpeculativeStats()
    get_dispatcher().add_event_handler(stats)

    results = []
    for question, gold in questions(args, passages):
        print(f"\nQ: {question}\nA: ", end="")
        response = engine.query(question)
        answer = ""
        for token in response.response_gen:
            answer += token
            print(token, end="", flush=True)
        print()
        sources = [n.node.metadata["title"] for n in response.source_nodes]
        results.append(report(question, answer, sources, stats.stats, gold))
    return results


if __name__ == "__main__":
    main()
