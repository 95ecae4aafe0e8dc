"""How retrieved nodes reach the drafters of `SpeculativeHFLLM` without going through the prompt.

A query engine calls its node postprocessors and then its response synthesizer, which calls the LLM's
`predict` or `stream` (or their async twins) with the query among the prompt arguments.
`DraftDocumentsPostprocessor` leaves the nodes, with their query, in a context variable; those four
methods draft from them while they answer that query. Concurrent queries in other threads or asyncio
tasks each see their own, and calls that answer another query (or none) never see them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle

from rag_speculate.retrieval.documents import TOKEN_IDS_KEY

Documents = Sequence[NodeWithScore | BaseNode | str | Sequence[int]]

# What the generations started now draft from, and what the last retrieval here found for which query.
_current: ContextVar[list | None] = ContextVar("rag_speculate_draft_documents", default=None)
_retrieved: ContextVar[tuple[str, list] | None] = ContextVar("rag_speculate_retrieved_documents", default=None)


def drafter_documents(documents: Documents) -> list[str | list[int]]:
    """Documents for the drafters: a node's pre-tokenized ids when the corpus index stored them in its
    metadata, else its text without metadata; strings and token-id lists as they are."""
    if isinstance(documents, (str, BaseNode, NodeWithScore)) or not isinstance(documents, Sequence):
        raise TypeError(f"documents must be a list of nodes, strings or token-id lists, got {type(documents).__name__}")
    return [_drafter_document(doc) for doc in documents]


def _drafter_document(doc: NodeWithScore | BaseNode | str | Sequence[int]) -> str | list[int]:
    node = doc.node if isinstance(doc, NodeWithScore) else doc
    if not isinstance(node, BaseNode):
        return doc  # text or token ids: the engine checks them
    ids = node.metadata.get(TOKEN_IDS_KEY)
    return list(ids) if ids is not None else node.get_content(metadata_mode=MetadataMode.NONE)


def current_documents() -> list[str | list[int]] | None:
    """What a generation started now drafts from (besides its prompt), if anything."""
    return _current.get()


def drafting_from(documents: Documents) -> AbstractContextManager[None]:
    """Draft every generation started inside the block from `documents` (for pipelines without a query engine)."""
    return _drafting(drafter_documents(documents))


def drafting_for_query(query: str | None) -> AbstractContextManager[None]:
    """Draft the generations started inside the block from the nodes last retrieved for `query` here."""
    retrieved = _retrieved.get()
    if query is None or retrieved is None or retrieved[0] != query:
        return nullcontext()
    return _drafting(retrieved[1])


@contextmanager
def _drafting(documents: list[str | list[int]]) -> Iterator[None]:
    token = _current.set(documents)
    try:
        yield
    finally:
        _current.reset(token)


class DraftDocumentsPostprocessor(BaseNodePostprocessor):
    """Hands the retrieved nodes, unchanged, to the drafters of the `SpeculativeHFLLM` that answers
    their query.

    Put it last in `node_postprocessors` to draft from exactly the nodes the prompt is built from.
    """

    @classmethod
    def class_name(cls) -> str:
        return "DraftDocumentsPostprocessor"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        if query_bundle is not None:
            _retrieved.set((query_bundle.query_str, drafter_documents(nodes)))
        return nodes

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        # The base class would run the sync version in a worker thread, whose context the caller never sees.
        return self._postprocess_nodes(nodes, query_bundle)
