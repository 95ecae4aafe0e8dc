"""SpeculativeHFLLM and ChatSpeculativeHF in real LangChain pipelines, with the small packaged model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import LLMResult
from langchain_core.prompts import PromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda
from langchain_core.tracers.context import collect_runs
from langchain_rag_speculate import ChatSpeculativeHF, SpeculativeHFLLM, create_rag_chain
from pydantic import ValidationError

from rag_speculate import Drafter, DraftTree, SpeculativeEngine

from .conftest import COUNT_DOCUMENT, COUNT_PROMPT, MODEL

QUESTION = "What is the capital of France?"


@pytest.fixture
def chat(engine) -> ChatSpeculativeHF:
    return ChatSpeculativeHF.from_engine(engine, model=MODEL, max_tokens=10)


@pytest.fixture
def llm(engine) -> SpeculativeHFLLM:
    return SpeculativeHFLLM.from_engine(engine, model=MODEL, max_tokens=10)


class Recorder(BaseCallbackHandler):
    """What the callbacks of one run see: the streamed tokens and the final generation's info."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.info: dict | None = None

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        self.info = response.generations[0][0].generation_info


def _finishes_within(seconds: float, work: Callable[[], object]) -> bool:
    """Whether `work` ends in time; a daemon thread, so a deadlock fails the test instead of hanging it."""
    done = threading.Event()
    threading.Thread(target=lambda: (work(), done.set()), daemon=True).start()
    return done.wait(seconds)


# --- the LLM ------------------------------------------------------------------------------


def test_llm_invoke_stream_and_astream_agree_and_report_usage(llm):
    llm.get_engine().prompt_cache.clear()
    result = llm.generate([COUNT_PROMPT])
    text, info = result.generations[0][0].text, result.generations[0][0].generation_info
    assert info["finish_reason"] == "length"
    assert info["token_usage"] == {
        "prompt_tokens": len(llm.get_token_ids(COUNT_PROMPT)),
        "completion_tokens": 10,
        "total_tokens": len(llm.get_token_ids(COUNT_PROMPT)) + 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert result.llm_output["token_usage"] == info["token_usage"]
    assert info["speculative_stats"]["new_tokens"] == 10

    tokens = Recorder()
    assert "".join(llm.stream(COUNT_PROMPT, config={"callbacks": [tokens]})) == text
    assert "".join(tokens.tokens) == text and len(tokens.tokens) > 1

    async def astream() -> str:
        return "".join([chunk async for chunk in llm.astream(COUNT_PROMPT)])

    assert asyncio.run(astream()) == text
    assert asyncio.run(llm.ainvoke(COUNT_PROMPT)) == text


def test_llm_usage_and_stats_agree_between_invoke_and_stream(llm):
    invoked, streamed = Recorder(), Recorder()
    llm.get_engine().prompt_cache.clear()  # both calls start cold, so their usage is the same
    text = llm.invoke(COUNT_PROMPT, config={"callbacks": [invoked]})
    llm.get_engine().prompt_cache.clear()
    assert "".join(llm.stream(COUNT_PROMPT, config={"callbacks": [streamed]})) == text
    for key in ("finish_reason", "token_usage", "model_name"):
        assert streamed.info[key] == invoked.info[key]
    for key in ("new_tokens", "prompt_tokens", "target_forwards", "drafted_tokens", "accepted_tokens"):
        assert streamed.info["speculative_stats"][key] == invoked.info["speculative_stats"][key]


def test_llm_batch_and_per_call_arguments(llm):
    short, longer = llm.batch([COUNT_PROMPT, COUNT_PROMPT], max_tokens=3), llm.invoke(COUNT_PROMPT, max_new_tokens=6)
    assert short[0] == short[1] and longer.startswith(short[0]) and len(longer) > len(short[0])
    # top_k=1 sampling can only pick the greedy token: the per-call sampling arguments reach the engine.
    assert llm.invoke(COUNT_PROMPT, temperature=1.0, top_k=1, seed=3) == llm.invoke(COUNT_PROMPT)
    sampled = [llm.invoke(COUNT_PROMPT, temperature=1.5, top_p=0.9, seed=7) for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_llm_stop_is_never_emitted_even_split_across_chunks(llm):
    full = llm.invoke(COUNT_PROMPT, max_tokens=24)
    assert "14, 15" in full  # " 14, 15" spans several tokens, so several streamed chunks
    chunks = list(llm.stream(COUNT_PROMPT, stop=["14, 15"], max_tokens=24))
    assert "".join(chunks) == full[: full.index("14, 15")]
    assert not any("14" in chunk for chunk in chunks)
    result = llm.generate([COUNT_PROMPT], stop=["14, 15"], max_tokens=32).generations[0][0]
    assert result.text == "".join(chunks) and result.generation_info["finish_reason"] == "stop"


def test_llm_tracing_reports_the_provider(llm):
    with collect_runs() as runs:
        llm.invoke(COUNT_PROMPT, max_tokens=2)
    metadata = runs.traced_runs[0].extra["metadata"]
    assert metadata["ls_provider"] == "rag_speculate" and metadata["ls_model_name"] == MODEL
    assert llm._get_ls_params(max_new_tokens=5)["ls_max_tokens"] == 5


def test_a_repeated_prompt_reports_its_cached_tokens(llm, chat):
    llm.get_engine().prompt_cache.clear()
    prompt_tokens = len(llm.get_token_ids(COUNT_PROMPT))
    cached = [llm.generate([COUNT_PROMPT]).llm_output["token_usage"]["prompt_tokens_details"]["cached_tokens"] for _ in range(2)]
    assert cached == [0, prompt_tokens - 1]
    messages = [SystemMessage("Answer briefly."), HumanMessage(QUESTION)]
    first, second = chat.invoke(messages), chat.invoke(messages)
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    assert second.usage_metadata["input_token_details"]["cache_read"] == second.usage_metadata["input_tokens"] - 1


# --- the chat model -----------------------------------------------------------------------


def test_chat_usage_and_stats_agree_between_invoke_and_stream(chat):
    messages = [SystemMessage("Answer briefly."), HumanMessage(QUESTION)]
    chat.get_engine().prompt_cache.clear()  # both calls start cold, so their usage is the same
    invoked = chat.invoke(messages)
    chat.get_engine().prompt_cache.clear()
    streamed = None
    for chunk in chat.stream(messages):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.content == invoked.content
    assert streamed.usage_metadata == invoked.usage_metadata
    assert invoked.usage_metadata["input_tokens"] == chat.get_num_tokens_from_messages(messages)
    for message in (invoked, streamed):
        stats = message.response_metadata["speculative_stats"]
        assert message.response_metadata["model_name"] == MODEL
        assert stats["new_tokens"] == message.usage_metadata["output_tokens"]
        assert stats["target_forwards"] <= stats["new_tokens"]


def test_chat_astream_events_and_callbacks(chat):
    tokens = Recorder()

    async def events() -> list[dict]:
        return [e async for e in chat.astream_events(QUESTION, version="v2", config={"callbacks": [tokens]})]

    collected = asyncio.run(events())
    streamed = [e["data"]["chunk"].content for e in collected if e["event"] == "on_chat_model_stream"]
    end = next(e for e in collected if e["event"] == "on_chat_model_end")["data"]["output"]
    assert "".join(streamed) == end.content == "".join(tokens.tokens) == chat.invoke(QUESTION).content
    assert end.usage_metadata["output_tokens"] == end.response_metadata["speculative_stats"]["new_tokens"]


# --- documents reach the drafters ---------------------------------------------------------


class _CountRetriever(BaseRetriever):
    def _get_relevant_documents(self, query: str, **kwargs: Any) -> list[Document]:
        return [Document(COUNT_DOCUMENT, metadata={"title": "counting"})]


def _trimmed(documents: list[Document]) -> str:
    """A prompt template's formatting that keeps only the start of each document."""
    return "".join(doc.page_content[:30] for doc in documents)


def test_documents_raise_tokens_per_forward_when_the_template_trims_them(engine):
    llm = SpeculativeHFLLM.from_engine(engine, model=MODEL, max_tokens=32)
    prompt = PromptTemplate.from_template("Numbers: {context}")
    retriever = _CountRetriever()
    runs = {way: Recorder() for way in "abc"}

    # (a) The documents reach the drafters only through the prompt, which the template trimmed.
    stuffed = {"context": retriever | _trimmed} | prompt | llm
    answers = {"a": stuffed.invoke("count", config={"callbacks": [runs["a"]]})}
    # (b) Bound explicitly; (c) through the RAG chain helper, which binds the retriever's documents.
    answers["b"] = llm.bind(documents=[COUNT_DOCUMENT]).invoke(COUNT_PROMPT, config={"callbacks": [runs["b"]]})
    rag = create_rag_chain(retriever, prompt, llm, format_documents=_trimmed).invoke(
        "count", config={"callbacks": [runs["c"]]}
    )
    answers["c"] = rag["answer"]

    assert answers["a"] == answers["b"] == answers["c"]  # lossless: the same text, only in fewer forwards
    assert rag["documents"][0].metadata["title"] == "counting" and rag["question"] == "count"
    tokens_per_forward = {way: run.info["speculative_stats"]["tokens_per_forward"] for way, run in runs.items()}
    # Each step verifies what pays for its measured cost, so (b) and (c) need not draft identically.
    assert min(tokens_per_forward["b"], tokens_per_forward["c"]) > 1.5 * tokens_per_forward["a"]


def test_rag_chain_streams_and_drafts_from_pretokenized_documents(engine):
    """A corpus index's token ids (metadata["token_ids"]) are drafted from instead of the text: here the
    ids hold the whole document and the text only what the prompt shows of it."""
    llm = SpeculativeHFLLM.from_engine(engine, model=MODEL, max_tokens=32)
    ids = engine.tokenizer.encode(COUNT_DOCUMENT, add_special_tokens=False)
    retriever = RunnableLambda(lambda _: [Document(COUNT_DOCUMENT[:30], metadata={"token_ids": ids})])
    chain = create_rag_chain(retriever, PromptTemplate.from_template("Numbers: {context}"), llm)
    run, plain = Recorder(), Recorder()
    parts = list(chain.stream("count", config={"callbacks": [run]}))
    answer = "".join(p.get("answer", "") for p in parts)
    assert answer == "".join(run.tokens) == llm.invoke(COUNT_PROMPT, config={"callbacks": [plain]})
    assert (
        run.info["speculative_stats"]["tokens_per_forward"]
        > 1.5 * plain.info["speculative_stats"]["tokens_per_forward"]
    )


# --- concurrency and cancellation ---------------------------------------------------------


def test_concurrent_threads_and_tasks_match_sequential(engine):
    llm = SpeculativeHFLLM.from_engine(engine, model=MODEL, max_tokens=6)
    chat = ChatSpeculativeHF.from_engine(engine, model=MODEL, max_tokens=6)
    prompts = [COUNT_PROMPT, "The capital of France is"]
    sequential = [llm.invoke(p) for p in prompts]
    assert sequential[0] != sequential[1]
    assert llm.batch(prompts * 2, config={"max_concurrency": 4}) == sequential * 2

    async def concurrently() -> list[str]:
        async def collect(prompt: str) -> str:
            return "".join([chunk async for chunk in llm.astream(prompt)])

        chat_answer = chat.ainvoke(QUESTION)
        return await asyncio.gather(*(collect(p) for p in prompts), chat_answer)

    *texts, chat_answer = asyncio.run(concurrently())
    assert texts == sequential
    assert chat_answer.content == chat.invoke(QUESTION).content


LONG = {"max_tokens": 2000}  # minutes of generation, unless it is stopped


def test_stopping_a_stream_early_frees_the_engine(llm):
    for _ in llm.stream(COUNT_PROMPT, **LONG):
        break
    assert _finishes_within(30, lambda: llm.invoke(COUNT_PROMPT, max_tokens=2))


def test_cancelling_astream_stops_generation_and_the_loop_stays_free(llm):
    async def cancel_then_generate() -> None:
        chunks = 0

        async def consume() -> None:
            nonlocal chunks
            async for _ in llm.astream(COUNT_PROMPT, **LONG):
                chunks += 1

        task = asyncio.create_task(consume())
        # The loop is free while the generation runs: this coroutine wakes up between chunks.
        while chunks < 3 and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Were the cancelled generation still running, this would wait for its 2000 tokens.
        await asyncio.wait_for(llm.ainvoke(COUNT_PROMPT, max_tokens=2), timeout=30)

    asyncio.run(cancel_then_generate())


class _ExplodingDrafter(Drafter):
    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        raise RuntimeError("drafter exploded")


def test_generation_errors_propagate_through_astream(engine):
    broken = SpeculativeEngine(engine.model, engine.tokenizer, _ExplodingDrafter())
    llm = SpeculativeHFLLM.from_engine(broken, model=MODEL, max_tokens=5)

    async def consume() -> None:
        async for _ in llm.astream(COUNT_PROMPT):
            pass

    with pytest.raises(RuntimeError, match="drafter exploded"):
        asyncio.run(consume())
    with pytest.raises(RuntimeError, match="drafter exploded"):
        asyncio.run(llm.ainvoke(COUNT_PROMPT))
    with pytest.raises(ValueError, match="position limit"):  # refused before any thread starts
        asyncio.run(llm.ainvoke(COUNT_PROMPT, max_tokens=10**6))


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("model_class", [SpeculativeHFLLM, ChatSpeculativeHF])
def test_unknown_arguments_are_refused(engine, model_class):
    model = model_class.from_engine(engine, model=MODEL, max_tokens=2)
    with pytest.raises(TypeError, match="'max_lenght'"):
        model.invoke("hi", max_lenght=5)
    with pytest.raises(TypeError, match="'model'"):
        model.invoke("hi", model="other")
    with pytest.raises(TypeError, match="not both"):
        model.invoke("hi", max_tokens=2, max_new_tokens=3)
    with pytest.raises(TypeError, match="documents must be a list"):
        model.invoke("hi", documents="one string")
    with pytest.raises(ValueError, match="stop must be"):
        model.invoke("hi", stop=[1])
    with pytest.raises(ValidationError, match="max_lenght"):
        model_class(model=MODEL, max_lenght=5)
    with pytest.raises(ValidationError, match="cannot be combined with engine"):
        model_class(engine=engine, dtype="float16")
    with pytest.raises(ValidationError, match="pass model="):
        model_class()
    with pytest.raises(ValidationError, match="dtype must be one of"):
        model_class(model=MODEL, dtype="int8")


@pytest.mark.parametrize("model_class", [SpeculativeHFLLM, ChatSpeculativeHF])
def test_devices_as_huggingface_pipeline_takes_them(engine, model_class):
    # Checked when the object is built, before any model loads.
    assert model_class(model=MODEL, device=-1).device == "cpu"
    assert model_class(model=MODEL, device_map="cpu").device == "cpu"
    assert model_class(model=MODEL).device == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValidationError, match="unknown device 'tpu'"):
        model_class(model=MODEL, device="tpu")
    with pytest.raises(ValidationError, match="spreads the model over several devices"):
        model_class(model=MODEL, device_map={"model.embed_tokens": 0, "lm_head": 1})
    if not torch.cuda.is_available():
        with pytest.raises(ValidationError, match="torch sees no CUDA GPU"):
            model_class(model=MODEL, device="cuda")
    with pytest.raises(ValidationError, match="cannot be combined with engine"):
        model_class(engine=engine, device_map="auto")


def test_bad_prompts_are_refused(llm, chat):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.invoke("")
    with pytest.raises(ValueError, match="at least one message"):
        chat.invoke([])
    with pytest.raises(ValueError, match="must end with a user"):
        chat.invoke([HumanMessage("hi"), AIMessage("hello")])
    with pytest.raises(ValueError, match="last user message is empty"):
        chat.invoke([HumanMessage(" ")])
    with pytest.raises(ValueError, match="not ToolMessage"):
        chat.invoke([HumanMessage("hi"), ToolMessage("42", tool_call_id="1"), HumanMessage("and?")])
    with pytest.raises(ValueError, match="text content only"):
        chat.invoke([HumanMessage([{"type": "image", "url": "https://example.com/cat.png"}])])
