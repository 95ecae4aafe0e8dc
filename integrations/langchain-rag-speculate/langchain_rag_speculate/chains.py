"""The standard RAG chain, `retriever | prompt | llm | parser`, with the retrieved documents also handed
to the drafters: they get every document whole, however the prompt template trims or reorders them,
and nobody has to parse them back out of the prompt."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.output_parsers import BaseOutputParser, StrOutputParser
from langchain_core.prompts import BasePromptTemplate
from langchain_core.retrievers import RetrieverLike
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough

from .chat_models import ChatSpeculativeHF
from .llms import SpeculativeHFLLM


def join_documents(documents: Sequence[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in documents)


def create_rag_chain(
    retriever: RetrieverLike,
    prompt: BasePromptTemplate,
    llm: SpeculativeHFLLM | ChatSpeculativeHF,
    output_parser: BaseOutputParser | None = None,
    *,
    format_documents: Callable[[Sequence[Document]], str] = join_documents,
    context_key: str = "context",
    question_key: str = "question",
) -> Runnable[str, dict[str, Any]]:
    """A chain from a question to {question_key: the question, "documents": the retrieved documents,
    "answer": the parsed answer}.

    `prompt` gets the question under `question_key` and `format_documents(documents)` under
    `context_key`; `llm` also gets the documents themselves as `documents=`. Streaming the chain streams the answer.
    """
    parser = output_parser or StrOutputParser()

    def answer(inputs: dict[str, Any]) -> Runnable:
        # Returning a Runnable makes LangChain run it on the same input, with the caller's config and callbacks.
        documents = inputs["documents"]
        filled = prompt.partial(**{context_key: format_documents(documents)})
        return filled | llm.bind(documents=documents) | parser

    retrieve = RunnableParallel({question_key: RunnablePassthrough(), "documents": retriever})
    return retrieve.assign(answer=RunnableLambda(answer, name="answer")).with_config(run_name="rag_chain")
