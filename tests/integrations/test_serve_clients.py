"""LangChain's ChatOpenAI and LlamaIndex's OpenAILike, unchanged, against `rag-speculate serve` on
127.0.0.1: invoke, stream, stop and usage, with the answers the in-process engine gives."""

from __future__ import annotations

import pytest
from packaged_fixtures import DOCUMENT

from rag_speculate.entrypoints.openai.background import running as serving

from .conftest import MODEL

pytest.importorskip("fastapi")
QUESTION = f"{DOCUMENT}\n\nWho designed the Eiffel Tower?"
MESSAGES = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def base_url(engine):
    from rag_speculate.entrypoints.openai import Server
    from rag_speculate.entrypoints.openai.app import create_app

    with serving(create_app(Server(engine, MODEL))) as url:
        yield url


def test_langchain_chat_openai(base_url, engine):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    expected = engine.generate(MESSAGES, chat=True, documents=[DOCUMENT], max_new_tokens=24)
    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=24,
                     stream_usage=True, extra_body={"documents": [DOCUMENT]}, max_retries=0)
    message = llm.invoke(QUESTION)
    assert message.content == expected.text
    assert message.usage_metadata["input_tokens"] == expected.stats.prompt_tokens
    assert message.usage_metadata["output_tokens"] == len(expected.token_ids)

    chunks = list(llm.stream(QUESTION))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert streamed.content == expected.text
    assert streamed.usage_metadata["output_tokens"] == len(expected.token_ids)

    stopped = engine.generate(MESSAGES, chat=True, max_new_tokens=24, stop=["Eiffel"])
    assert stopped.finish_reason == "stop"
    assert llm.invoke(QUESTION, stop=["Eiffel"]).content == stopped.text


def test_llamaindex_openai_like(base_url, engine):
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    expected = engine.generate(MESSAGES, chat=True, max_new_tokens=24)
    llm = OpenAILike(model=MODEL, api_base=base_url, api_key="unused", is_chat_model=True, temperature=0,
                     max_tokens=24, context_window=8192, max_retries=0)
    response = llm.chat([ChatMessage(role="user", content=QUESTION)])
    assert response.message.content == expected.text
    assert response.raw.usage.completion_tokens == len(expected.token_ids)

    *_, last = llm.stream_chat([ChatMessage(role="user", content=QUESTION)])
    assert last.message.content == expected.text

    stopped = engine.generate(MESSAGES, chat=True, max_new_tokens=24, stop=["Eiffel"])
    assert stopped.finish_reason == "stop"
    assert llm.chat([ChatMessage(role="user", content=QUESTION)], stop=["Eiffel"]).message.content == stopped.text

    completion_llm = OpenAILike(model=MODEL, api_base=base_url, api_key="unused", is_chat_model=False, temperature=0,
                                max_tokens=8, context_window=8192, max_retries=0)
    prompt = "The Eiffel Tower is in"
    assert completion_llm.complete(prompt).text == engine.generate(prompt, max_new_tokens=8).text
    *_, last = completion_llm.stream_complete(prompt)
    assert last.text == engine.generate(prompt, max_new_tokens=8).text
