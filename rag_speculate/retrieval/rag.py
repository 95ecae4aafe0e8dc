"""Turning retrieved chunks into what the engine takes: a RAG prompt, and documents to draft from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .documents import Chunk

if TYPE_CHECKING:
    from ..decoding.engine import SpeculativeEngine
    from .corpus import CorpusIndex

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


def rag_engine(
    engine: SpeculativeEngine,
    index: CorpusIndex | None,
    draft_model: str | None = None,
    progress: Callable[[str], None] | None = None,
    prompt_cache_bytes: int | None = None,
) -> SpeculativeEngine:
    """`engine`'s model drafting in one tree from the retrieved chunks (trie), the whole corpus
    (REST, with an index) and, if named, a draft model (int8 on a CPU); `prompt_cache_bytes` as
    `SpeculativeEngine` takes it."""
    from ..decoding.engine import SpeculativeEngine
    from ..drafters import NGramTrieDrafter, OuroborosDrafter, RESTDrafter
    from ..models.int8 import int8_draft_model
    from ..models.loading import load_model

    drafters = [NGramTrieDrafter()]
    if index is not None:
        index.check_tokenizer(engine.tokenizer)
        drafters.append(RESTDrafter(index.datastore))
    if draft_model:
        model, tokenizer = load_model(draft_model, dtype=engine.model.dtype, device=engine.model.device, progress=progress)
        if model.device.type == "cpu":
            model = int8_draft_model(model)
        drafters.append(OuroborosDrafter(model, tokenizer))
    return SpeculativeEngine(engine.model, engine.tokenizer, drafters, name=engine.name, prompt_cache_bytes=prompt_cache_bytes)
