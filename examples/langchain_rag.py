"""RAG with LangChain over the shipped NQ passages: retriever | prompt | ChatSpeculativeHF | parser.

    python examples/langchain_rag.py                      # the packaged Qwen2.5-Coder-1.5B
    python examples/langchain_rag.py --model smollm2-135m-instruct --question "who wrote hamlet"

The retrieved documents reach the drafters through `create_rag_chain`; the answer streams token by
token, and a callback handler reads the acceleration stats off the model's response.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.outputs import LLMResult
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_rag_speculate import ChatSpeculativeHF, create_rag_chain

sys.path.insert(0, str(Path(__file__).parent))
from nq_corpus import SYSTEM_PROMPT, load_passages, parse_args, questions, report

from rag_speculate.retrieval.corpus import packaged_embedding_path


class SentenceTransformerEmbeddings(Embeddings):
    """The packaged MiniLM through sentence-transformers (langchain-huggingface would pin an older
    huggingface_hub than transformers 5 needs)."""

    def __init__(self, path: Path):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(path), device="cpu")

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.model.encode(texts, normalize_embeddings=True).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


class SpeculativeStats(BaseCallbackHandler):
    """Keeps the acceleration stats of the last chat model run (streamed or not)."""

    stats: dict | None = None

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        self.stats = response.generations[0][0].message.response_metadata["speculative_stats"]


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], argv)
    passages = load_passages(args.passages)
    store = InMemoryVectorStore(SentenceTransformerEmbeddings(packaged_embedding_path()))
    store.add_documents([Document(p["text"], id=p["id"], metadata={"title": p["title"]}) for p in passages])
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM_PROMPT), ("human", "Passages:\n{context}\n\nQuestion: {question}")]
    )
    chat = ChatSpeculativeHF.from_model_id(args.model, dtype=args.dtype, max_tokens=args.max_tokens)
    chain = create_rag_chain(store.as_retriever(search_kwargs={"k": args.top_k}), prompt, chat)

    results = []
    for question, gold in questions(args, passages):
        stats, answer, documents = SpeculativeStats(), "", []
        print(f"\nQ: {question}\nA: ", end="")
        for part in chain.stream(question, config={"callbacks": [stats]}):
            documents = part.get("documents", documents)
            answer += part.get("answer", "")
            print(part.get("answer", ""), end="", flush=True)
        print()
        results.append(report(question, answer, [d.metadata["title"] for d in documents], stats.stats, gold))
    return results


if __name__ == "__main__":
    main()
