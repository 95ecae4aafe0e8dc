"""Turning retrieved chunks into what the engine takes: a RAG prompt, and documents to draft from."""

from __future__ import annotations

from collections.abc import Sequence

from .documents import Chunk

RAG_SYSTEM_PROMPT = "Answer the question using the passages."


def rag_messages(question: str, chunks: Sequence[Chunk]) -> list[dict[str, str]]:
    """Chat messages asking `question` over the retrieved chunks, numbered so answers can cite them."""
    passages = "\n\n".join(f"[{i}] {c.title}\n{c.text}" if c.title else f"[{i}] {c.text}" for i, c in enumerate(chunks, 1))
    return [
        {"role": "system", "content": RAG_SYSTEM_PROMPT},
        {"role": "user", "content": f"Passages:\n{passages}\n\nQuestion: {question}"},
    ]


def drafting_documents(chunks: Sequence[Chunk]) -> list[list[int]]:
    """The chunks' token ids, for `SpeculativeEngine.generate(documents=...)`: nothing to tokenize."""
    return [c.token_ids for c in chunks]
