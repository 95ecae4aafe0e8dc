"""SpeculativeHFLLM and ChatSpeculativeHF in real LangChain pipelines, with the small packaged model."""

from __future__ import annotations

import asyncio
import copy
import json
import random
import threading
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import pytest
import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.outputs import LLMResult
from langchain_core.prompts import PromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import tool
from langchain_core.tracers.context import collect_runs
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_rag_speculate import ChatSpeculativeHF, SpeculativeHFLLM, create_rag_chain
from langchain_rag_speculate._tools import ReadCalls
from pydantic import BaseModel, Field, ValidationError
from typing_extensions import TypedDict

from rag_speculate import Drafter, DraftTree, SpeculativeEngine
from rag_speculate.entrypoints.tool_calls import HeldText, parse_tool_calls

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


def test_batch_and_abatch_run_their_prompts_together(engine):
    llm = SpeculativeHFLLM.from_engine(engine, model=MODEL, max_tokens=12)
    chat = ChatSpeculativeHF.from_engine(engine, model=MODEL, max_tokens=12)
    prompts = [COUNT_PROMPT, "The capital of France is", "Once upon a time"]
    alone = [llm.invoke(p) for p in prompts]
    batched = llm.generate(prompts)  # what llm.batch calls, with every prompt at once
    assert [g[0].text for g in batched.generations] == alone
    assert max(size for g in batched.generations for size in g[0].generation_info["speculative_stats"]["batch_sizes"]) > 1
    questions = [QUESTION, "Name a colour.", "Say hello."]
    answers = asyncio.run(chat.abatch(questions))
    assert [a.content for a in answers] == [chat.invoke(q).content for q in questions]
    assert max(int(size) for a in answers for size in a.response_metadata["speculative_stats"]["batch_sizes"]) > 1


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
    if model_class is SpeculativeHFLLM:  # a completion model takes no tools
        with pytest.raises(TypeError, match="'tools'"):
            model.invoke("hi", tools=[search])
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
    with pytest.raises(ValueError, match="not FunctionMessage"):
        chat.invoke([HumanMessage("hi"), FunctionMessage("42", name="f"), HumanMessage("and?")])
    with pytest.raises(ValueError, match="text content only"):
        chat.invoke([HumanMessage([{"type": "image", "url": "https://example.com/cat.png"}])])
    # SmolLM2's template renders no tools: refused when called, naming the model, not silently dropped.
    with pytest.raises(ValueError, match="chat template takes no tools"):
        chat.bind_tools([search]).invoke("hi")


# --- tool calling and structured output -----------------------------------------------------
#
# SmolLM2's own chat template renders no tools, so these tests give the same model a copy of its
# tokenizer whose ChatML template does (tool names in the first message, an assistant's calls as
# Hermes <tool_call> tags). The answers are the model's own: asked to repeat the user's text, it
# writes a call, a malformed call, a JSON object or plain text, and the adapter reads them back.

TOOLS_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{%- if loop.first and tools %}\n\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{% endif %}"
    "{%- for call in message.get('tool_calls', []) %}\n<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ECHO = "Reply with exactly the text the user sends."
LOOKUP_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"id": 7}}\n</tool_call>'
SEARCH_CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "warranty"}}\n</tool_call>'
JOKE = {"setup": "Why did the cat sit on the computer?", "punchline": "To keep an eye on the mouse."}


@tool
def search(query: str) -> str:
    """Search the documents."""
    return f"results for {query}"


class Joke(BaseModel):
    """Joke to tell user."""

    setup: str = Field(description="question to set up a joke")
    punchline: str = Field(description="answer to resolve the joke")


class JokeDict(TypedDict):
    """Joke to tell user."""

    setup: Annotated[str, ..., "question to set up a joke"]
    punchline: Annotated[str, ..., "answer to resolve the joke"]


def lookup(id: int) -> str:  # noqa: A002 - a tool's argument name, as the model writes it
    """Look a record up by its id."""
    return str(id)


class RecordingEngine(SpeculativeEngine):
    """The engine, keeping each request it was given (the prompt ids the model sees) and its stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list = []
        self.streams: list = []

    def stream_request(self, request: Any):
        self.requests.append(request)
        self.streams.append(super().stream_request(request))
        return self.streams[-1]


@pytest.fixture(scope="module")
def tool_engine(engine) -> RecordingEngine:
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tools_engine = RecordingEngine(engine.model, tokenizer, name=MODEL)
    tools_engine.cost_model = engine.cost_model
    return tools_engine


@pytest.fixture
def tool_chat(tool_engine) -> ChatSpeculativeHF:
    return ChatSpeculativeHF.from_engine(tool_engine, model=MODEL, max_tokens=60)


def _echo(text: str) -> list[BaseMessage]:
    """A prompt this model answers with `text`, as it is (and the request tool_choice appends after a
    blank line, ignored)."""
    forced = "\n\nAnswer by calling the tool lookup with arguments that fit the request, not with text."
    return [
        SystemMessage(ECHO + " Ignore anything after a blank line."),
        *(HumanMessage("hello"), AIMessage("hello")),
        *(HumanMessage(LOOKUP_CALL + forced), AIMessage(LOOKUP_CALL)),
        HumanMessage(text),
    ]


def _aggregate(chunks: Sequence[AIMessageChunk]) -> AIMessageChunk:
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    return full


def _greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids) :].tolist()


def test_bind_tools_converts_every_kind_of_tool_and_checks_it_now(chat):
    class Weather(BaseModel):
        """Weather at a place."""

        place: str

    dict_tool = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    bound = chat.bind_tools([search, Weather, lookup, JokeDict, dict_tool, Joke.model_json_schema()], tool_choice="any")
    tools = bound.kwargs["tools"]
    assert [t["function"]["name"] for t in tools] == ["search", "Weather", "lookup", "JokeDict", "ping", "Joke"]
    assert tools[0]["function"]["parameters"]["properties"] == {"query": {"type": "string"}}
    assert tools[2]["function"]["parameters"]["properties"] == {"id": {"type": "integer"}}
    assert all(t["type"] == "function" for t in tools) and bound.kwargs["tool_choice"] == "any"
    for choice in (None, "auto", "none", "required", "lookup", {"type": "function", "function": {"name": "lookup"}}):
        assert chat.bind_tools([search, lookup], tool_choice=choice).kwargs["tool_choice"] == choice

    with pytest.raises(ValueError, match="tool_choice names the tool 'nope', which is not among the tools: search"):
        chat.bind_tools([search], tool_choice="nope")
    with pytest.raises(ValueError, match="tool_choice names the tool 'nope'"):
        chat.bind_tools([search], tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="tool_choice must be 'auto', 'none', 'required'"):
        chat.bind_tools([search], tool_choice=True)
    with pytest.raises(ValueError, match="needs tools"):
        chat.bind_tools([], tool_choice="any")
    with pytest.raises(ValueError, match=r"tools\[1\] \(42\) cannot be converted"):
        chat.bind_tools([search, 42])
    with pytest.raises(ValueError, match="tool 'search' is given twice"):
        chat.bind_tools([search, search])
    with pytest.raises(ValueError, match="tools must be a list"):
        chat.bind_tools(search)
    with pytest.raises(ValueError, match="tool_choice names the tool 'nope'"):  # per call, too
        chat.invoke("hi", tools=[search], tool_choice="nope")


def test_tool_choice_reaches_the_prompt_as_documented(tool_chat, tool_engine):
    tools = [convert_to_openai_tool(search), convert_to_openai_tool(lookup)]
    question = [HumanMessage("Find the warranty.")]
    asked = {"role": "user", "content": "Find the warranty."}

    def prompt_ids(**kwargs: Any) -> list[int]:
        tool_chat.invoke(question, max_tokens=1, **kwargs)
        return tool_engine.requests[-1].prompt_ids

    def expected(content: str, template_tools: list[dict] | None) -> list[int]:
        return tool_engine.encode_prompt([{**asked, "content": content}], chat=True, tools=template_tools)

    auto = prompt_ids(tools=tools)
    auto_request = tool_engine.requests[-1]
    assert auto == expected(asked["content"], tools) == prompt_ids(tools=tools, tool_choice="auto")
    assert "Tools: search lookup" in tool_engine.tokenizer.decode(auto)
    assert prompt_ids(tools=tools, tool_choice="none") == expected(asked["content"], None)
    fit = "with arguments that fit the request, not with text."
    any_call = f"Find the warranty.\n\nAnswer by calling one of the tools (search, lookup) {fit}"
    assert prompt_ids(tools=tools, tool_choice="any") == expected(any_call, tools)
    assert prompt_ids(tools=tools, tool_choice="required") == expected(any_call, tools)
    one_call = f"Find the warranty.\n\nAnswer by calling the tool lookup {fit}"
    named = prompt_ids(tools=tools, tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert named == prompt_ids(tools=tools, tool_choice="lookup") == expected(one_call, tools[1:])
    # The tool schemas feed the drafters too: a call's arguments copy from them.
    schema_ids = tool_engine.tokenizer.encode(json.dumps(tools[0], ensure_ascii=False), add_special_tokens=False)
    assert schema_ids in auto_request.document_ids


def test_tool_history_renders_calls_and_results(tool_chat, tool_engine):
    call = {"name": "search", "args": {"query": "warranty"}, "id": "abc123", "type": "tool_call"}
    result = ToolMessage('{"result": "parts for two years"}', tool_call_id="abc123", name="search")
    history = [HumanMessage("What does the warranty cover?"), AIMessage("", tool_calls=[call]), result]
    as_dicts = [
        {"role": "user", "content": "What does the warranty cover?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "abc123", "function": {"name": "search", "arguments": {"query": "warranty"}}}]},
        {"role": "tool", "content": '{"result": "parts for two years"}', "tool_call_id": "abc123", "name": "search"},
    ]
    tools = [convert_to_openai_tool(search)]
    ids = tool_engine.encode_prompt(as_dicts, chat=True, tools=tools)
    text = tool_engine.tokenizer.decode(ids)
    assert f"<|im_start|>assistant\n{SEARCH_CALL}<|im_end|>" in text
    assert text.endswith('<|im_start|>tool\n{"result": "parts for two years"}<|im_end|>\n<|im_start|>assistant\n')

    # The history may end with the tool's result: the model answers it.
    answer = tool_chat.bind_tools([search]).invoke(history, max_tokens=4)
    assert tool_engine.requests[-1].prompt_ids == ids and answer.usage_metadata["input_tokens"] == len(ids)
    assert tool_chat.get_num_tokens_from_messages(history, tools=[search]) == len(ids)
    assert tool_chat.get_num_tokens_from_messages(history) == len(tool_engine.encode_prompt(as_dicts, chat=True))
    # The result feeds the drafters.
    result_ids = tool_engine.tokenizer.encode(result.content, add_special_tokens=False)
    assert result_ids in tool_engine.requests[-1].document_ids
    # Anthropic-style content (text and tool_use blocks) and LangChain v1 blocks render the same calls.
    blocks = AIMessage(
        [{"type": "tool_use", "id": "abc123", "name": "search", "input": {"query": "warranty"}}], tool_calls=[call]
    )
    assert tool_chat.get_num_tokens_from_messages([history[0], blocks, result], tools=[search]) == len(ids)
    # So does an aggregated stream (an AIMessageChunk), as an agent loop may append it.
    chunk = AIMessageChunk(content="", tool_call_chunks=[
        {"name": "search", "args": '{"query": "warranty"}', "id": "abc123", "index": 0, "type": "tool_call_chunk"}])
    assert tool_chat.get_num_tokens_from_messages([history[0], chunk, result], tools=[search]) == len(ids)


def test_greedy_output_with_tools_is_generates(tool_chat, tool_engine):
    messages = [SystemMessage("Answer briefly."), HumanMessage("What does the warranty cover? Search for it.")]
    answer = tool_chat.bind_tools([search, lookup]).invoke(messages, max_tokens=24)
    stream = tool_engine.streams[-1]
    assert stream.result.token_ids == _greedy(tool_engine.model, tool_engine.requests[-1].prompt_ids, 24)
    read = parse_tool_calls(stream.result.text)
    assert answer.content == read.content
    assert [c["args"] for c in answer.tool_calls] == [c.arguments for c in read.calls]


@pytest.mark.parametrize(
    "said,content,calls,error",
    [
        (SEARCH_CALL, "", [("search", {"query": "warranty"})], ""),
        ('{"name": "search", "arguments": {"query": "warranty"}}', "", [("search", {"query": "warranty"})], ""),
        ('```json\n{"name": "search", "arguments": {"query": "warranty"}}\n```', "", [("search", {"query": "warranty"})],
         ""),
        ('<tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call>', None, [],
         "tool call 0 is not valid JSON"),
        ("The warranty covers parts for two years.", "The warranty covers parts for two years.", [], ""),
    ],
    ids=["tagged", "bare", "fenced", "malformed", "text"],
)
def test_calls_in_the_answer_become_tool_calls_streamed_or_not(tool_chat, said, content, calls, error):
    bound = tool_chat.bind_tools([search, lookup])
    message = bound.invoke(_echo(said))
    assert message.content == (said if content is None else content)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == calls
    assert all(c["type"] == "tool_call" and c["id"].startswith("call_") for c in message.tool_calls)
    if error:
        assert message.invalid_tool_calls[0]["error"].startswith(error)
        assert message.invalid_tool_calls[0]["name"] == "search"
        assert message.response_metadata["tool_call_error"].startswith(error)
    else:
        assert message.invalid_tool_calls == [] and "tool_call_error" not in message.response_metadata

    chunks = list(bound.stream(_echo(said)))
    streamed = _aggregate(chunks)
    assert streamed.content == message.content and streamed.tool_calls == message.tool_calls
    # The calls come whole, as chunks with their index, once the answer is complete.
    assert [c["index"] for c in streamed.tool_call_chunks] == list(range(len(calls)))
    assert streamed.response_metadata.get("tool_call_error") == message.response_metadata.get("tool_call_error")
    for key in ("input_tokens", "output_tokens"):  # the prompt cache serves the second call more
        assert streamed.usage_metadata[key] == message.usage_metadata[key]

    async def astreamed() -> AIMessageChunk:
        return _aggregate([chunk async for chunk in bound.astream(_echo(said))])

    assert asyncio.run(astreamed()).tool_calls == message.tool_calls
    if not calls and not error:  # plain text streams as it comes
        assert len(chunks) > 2


def test_text_before_calls_streams_and_adds_up_to_invoke(tool_chat):
    """How a stream splits an answer: all the answers below, cut at every character and at random,
    emit only what invoke's content starts with, and end with the rest of it."""
    answers = [
        'Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
        'Sure:\n```json\n{"name": "search", "arguments": {"query": "water damage"}}\n```\nDone.',
        'Code:\n```python\nprint(1)\n```\nand then ```json\n{"answer": 42}\n```',
        '  Leading space <tool_call>{"name": "a", "arguments": {}}</tool_call>',
        'A < B and `x` ``y`` <tool and <tool_call>{"name": "a", "arguments": {}}',
        '{"setup": "x", "punchline": "y"}',
        '{{"name": "magic_function", "arguments": {"input": 3}}}',  # Qwen2.5 copies its template's doubled braces
        'Searching. {"name": "search", "arguments": {"query": "q"}} Done.',  # a call inside prose
        'The JSON {"setup": "x"} is not a call; { "name" in prose is not either.',
    ]
    rng = random.Random(0)
    for answer in answers:
        read = ReadCalls(answer, [])
        for trial in range(200):
            every = range(1, len(answer))
            cuts = sorted(rng.sample(every, rng.randint(0, len(every)))) if trial else every
            pieces = [answer[i:j] for i, j in zip([0, *cuts], [*cuts, len(answer)])]
            held = HeldText()
            emitted = "".join(held.feed(piece) for piece in pieces)
            assert read.content.startswith(emitted) and emitted + held.finish(read.content) == read.content
    held = HeldText()
    assert "".join(held.feed(c) for c in answers[0]) == "Let me look."
    held = HeldText()
    assert "".join(held.feed(c) for c in answers[2]) == "Code:\n```python\nprint(1)\n```\nand then"

    # invoke reads the same answers: text and calls apart, ids that differ between answers.
    first, qwen = ReadCalls(answers[0], []), ReadCalls(answers[6], [])
    assert first.content == "Let me look."
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("a", {}), ("b", {"x": 1})]
    assert len({c["id"] for c in first.tool_calls + qwen.tool_calls}) == 3
    assert [(c["name"], c["args"]) for c in qwen.tool_calls] == [("magic_function", {"input": 3})]
    chunks = [AIMessageChunk(content="Let me look."), AIMessageChunk(content="", tool_call_chunks=first.chunks())]
    assert _aggregate(chunks).tool_calls == first.tool_calls


def test_structured_output_with_function_calling(tool_chat, tool_engine):
    call = '<tool_call>\n{"name": "Joke", "arguments": ' + json.dumps(JOKE) + "}\n</tool_call>"
    joke = tool_chat.with_structured_output(Joke).invoke(_echo(call))
    assert joke == Joke(**JOKE)
    # Only the schema's tool reaches the template, with the request to call it.
    prompt = tool_engine.tokenizer.decode(tool_engine.requests[-1].prompt_ids)
    assert "Tools: Joke<|im_end|>" in prompt and prompt.endswith(
        "\n\nAnswer by calling the tool Joke with arguments that fit the request, not with text."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert list(tool_chat.with_structured_output(Joke).stream(_echo(call))) == [Joke(**JOKE)]
    assert tool_chat.with_structured_output(JokeDict).invoke(_echo(call.replace("Joke", "JokeDict"))) == JOKE
    assert tool_chat.with_structured_output(Joke.model_json_schema()).invoke(_echo(call)) == JOKE

    # No call, or arguments the schema refuses: raised, or returned beside the raw message.
    with pytest.raises(OutputParserException, match="without calling the tool Joke"):
        tool_chat.with_structured_output(Joke).invoke(_echo("No joke today."))
    raw = tool_chat.with_structured_output(Joke, include_raw=True).invoke(_echo("No joke today."))
    assert raw["parsed"] is None and isinstance(raw["parsing_error"], OutputParserException)
    assert raw["raw"].content == "No joke today." and raw["raw"].tool_calls == []
    bad = call.replace('"punchline"', '"ending"')
    with pytest.raises(ValidationError, match="punchline"):
        tool_chat.with_structured_output(Joke).invoke(_echo(bad))
    raw = tool_chat.with_structured_output(Joke, include_raw=True).invoke(_echo(bad))
    assert raw["parsed"] is None and isinstance(raw["parsing_error"], ValidationError) and raw["raw"].tool_calls
    good = tool_chat.with_structured_output(Joke, include_raw=True).invoke(_echo(call))
    assert good["parsed"] == Joke(**JOKE) and good["parsing_error"] is None
    assert good["raw"].tool_calls[0]["name"] == "Joke"


def test_structured_output_with_json_schema_and_json_mode(engine):
    """No tools involved: these work with any chat template, SmolLM2's own included."""
    recorded = RecordingEngine(engine.model, engine.tokenizer, name=MODEL)
    recorded.cost_model = engine.cost_model
    chat = ChatSpeculativeHF.from_engine(recorded, model=MODEL, max_tokens=60)
    said = json.dumps(JOKE)
    shots = [SystemMessage(ECHO), HumanMessage("hello"), AIMessage("hello")]
    shots += [HumanMessage('{"a": 1}'), AIMessage('{"a": 1}')]
    messages = [*shots, HumanMessage(said)]
    assert chat.with_structured_output(Joke, method="json_schema").invoke(messages) == Joke(**JOKE)
    system = recorded.tokenizer.decode(recorded.requests[-1].prompt_ids).split("<|im_end|>")[0]
    schema = json.dumps(convert_to_json_schema(Joke))
    asked = f"Answer with one JSON object that follows this JSON schema, and nothing else:\n{schema}"
    assert system == f"<|im_start|>system\n{ECHO}\n\n{asked}"
    assert chat.with_structured_output(JokeDict, method="json_schema").invoke(messages) == JOKE
    assert chat.with_structured_output(Joke, method="json_mode").invoke(messages) == Joke(**JOKE)
    assert recorded.tokenizer.decode(recorded.requests[-1].prompt_ids).startswith(
        "<|im_start|>system\n" + ECHO + "\n\nAnswer with one JSON object and nothing else.<|im_end|>"
    )
    assert chat.with_structured_output(None, method="json_mode").invoke(messages) == JOKE
    fenced = [*shots, HumanMessage(f"```json\n{said}\n```")]  # a fenced block is read too
    assert chat.with_structured_output(Joke, method="json_mode").invoke(fenced) == Joke(**JOKE)
    streamed = list(chat.with_structured_output(JokeDict, method="json_mode").stream(messages))
    assert streamed[-1] == JOKE and len(streamed) > 1  # JSON parses as it streams, partial objects first

    not_json = [*shots, HumanMessage("Paris")]
    with pytest.raises(OutputParserException):
        chat.with_structured_output(Joke, method="json_mode").invoke(not_json)
    raw = chat.with_structured_output(Joke, method="json_mode", include_raw=True).invoke(not_json)
    assert raw["parsed"] is None and isinstance(raw["parsing_error"], OutputParserException) and raw["raw"].content


def test_structured_output_arguments_are_checked_when_built(chat):
    with pytest.raises(ValueError, match="schema 42 cannot be converted"):
        chat.with_structured_output(42)
    with pytest.raises(ValueError, match="schema 42 cannot be converted"):
        chat.with_structured_output(42, method="json_schema")
    with pytest.raises(ValueError, match="method must be one of"):
        chat.with_structured_output(Joke, method="xml")
    with pytest.raises(ValueError, match="needs a schema"):
        chat.with_structured_output(None)
    with pytest.raises(ValueError, match="unsupported arguments"):
        chat.with_structured_output(Joke, temperature=0.5)
    for method in ("function_calling", "json_schema", "json_mode"):
        assert chat.with_structured_output(Joke, method=method, strict=True) is not None
    with pytest.raises(ValueError, match="response_format must be"):
        chat.invoke("hi", response_format={"type": "yaml"})
