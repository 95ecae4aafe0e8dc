"""SpeculativeHFLLM in real LlamaIndex pipelines (FAISS index, query engines, callbacks, instrumentation),
with the small packaged model."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import json
import threading
from collections.abc import Sequence

import faiss
import pytest
import torch
from langchain_rag_speculate import SpeculativeHFLLM as LangChainLLM
from llama_index.core import PromptTemplate, StorageContext, VectorStoreIndex
from llama_index.core.agent.workflow import FunctionAgent, ToolCall, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, ToolCallBlock
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.program.function_program import get_function_tool
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.core.tools import FunctionTool
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.llms.rag_speculate import DraftDocumentsPostprocessor, SpeculativeHFLLM, drafting_from
from llama_index.llms.rag_speculate.documents import current_documents, drafter_documents
from llama_index.llms.rag_speculate.tools import openai_tools
from llama_index.vector_stores.faiss import FaissVectorStore
from packaged_fixtures import QWEN_TOOLS_TEMPLATE
from pydantic import BaseModel, Field, RootModel, ValidationError

from rag_speculate import Drafter, DraftTree, InvalidArgumentError, SpeculativeEngine
from rag_speculate.cpu.kernels import FastKernels
from rag_speculate.entrypoints.prompt import CALL_ONE_OF, CALL_THIS
from rag_speculate.retrieval.corpus import Chunk, packaged_embedding_path

from .conftest import COUNT_DOCUMENT, COUNT_PROMPT, DTYPE, MODEL

QUESTION = "What is the capital of France?"
# What the one prompt builder asks of an answer when a call is required, or a call to one tool.
REQUIRED, NAMED = CALL_ONE_OF.format(names="search, weather"), CALL_THIS
QUERY = "count the numbers one two three"


@pytest.fixture
def llm(engine) -> SpeculativeHFLLM:
    return SpeculativeHFLLM(engine=engine, model_name=MODEL, max_new_tokens=10)


class Stats(BaseEventHandler):
    """The responses the LLM's instrumentation reports as final."""

    ends: list = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "Stats"

    def handle(self, event: BaseEvent, **kwargs) -> None:
        if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)):
            self.ends.append(event.response)


@pytest.fixture
def stats():
    handler = Stats()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)


def _usage(response) -> tuple[int, int]:
    usage = response.raw["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"]


# --- the LLM ------------------------------------------------------------------------------


def test_metadata_reports_the_models_limits(llm, engine):
    metadata = llm.metadata
    assert metadata.context_window == engine.traits.max_positions == 8192
    assert metadata.num_output == 10 and metadata.is_chat_model and metadata.model_name == MODEL
    # SmolLM2's own chat template renders no tools: LlamaIndex takes its text-only paths.
    assert isinstance(llm, FunctionCallingLLM) and not metadata.is_function_calling_model


def test_a_repeated_query_reports_its_cached_tokens_in_the_raw_usage(llm, engine):
    engine.prompt_cache.clear()
    first, second = llm.complete(QUESTION), llm.complete(QUESTION)
    assert first.raw["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second.raw["usage"]["prompt_tokens_details"]["cached_tokens"] == second.raw["usage"]["prompt_tokens"] - 1


def test_completion_paths_agree_and_token_counting_sees_the_usage(engine):
    counter = TokenCountingHandler()
    llm = SpeculativeHFLLM(
        engine=engine, model_name=MODEL, max_new_tokens=10, callback_manager=CallbackManager([counter])
    )
    completed = llm.complete(QUESTION)
    counted = (counter.prompt_llm_token_count, counter.completion_llm_token_count)
    assert counted == _usage(completed) and counted[1] == completed.additional_kwargs["speculative_stats"]["new_tokens"]

    counter.reset_counts()
    streamed = list(llm.stream_complete(QUESTION))
    assert "".join(r.delta for r in streamed) == streamed[-1].text == completed.text
    assert (counter.prompt_llm_token_count, counter.completion_llm_token_count) == counted
    assert streamed[-1].additional_kwargs["finish_reason"] == completed.additional_kwargs["finish_reason"]

    async def both() -> tuple:
        acompleted = await llm.acomplete(QUESTION)
        deltas = [r.delta async for r in await llm.astream_complete(QUESTION)]
        return acompleted.text, "".join(deltas)

    assert asyncio.run(both()) == (completed.text, completed.text)


def test_chat_uses_the_chat_template_streaming_or_not(llm, engine, stats):
    messages = [ChatMessage(role="system", content="Answer briefly."), ChatMessage(role="user", content=QUESTION)]
    engine.prompt_cache.clear()  # both calls start cold, so their usage is the same
    chatted = llm.chat(messages)
    engine.prompt_cache.clear()
    chunks = list(llm.stream_chat(messages))
    assert "".join(c.delta for c in chunks) == chunks[-1].message.content == chatted.message.content
    assert chatted.raw["usage"] == chunks[-1].raw["usage"]
    template = engine.tokenizer.apply_chat_template(
        [{"role": m.role.value, "content": m.content} for m in messages], tokenize=False, add_generation_prompt=True
    )
    assert _usage(chatted)[0] == len(engine.tokenizer.encode(template, add_special_tokens=False))
    # Both ends reached the instrumentation, the streamed one with its stats.
    assert [e.additional_kwargs["speculative_stats"]["new_tokens"] for e in stats.ends] == [_usage(chatted)[1]] * 2

    async def achat() -> tuple[str, str]:
        answer = await llm.achat(messages)
        deltas = [c.delta async for c in await llm.astream_chat(messages)]
        return answer.message.content, "".join(deltas)

    assert asyncio.run(achat()) == (chatted.message.content,) * 2


def test_formatting_choices(engine):
    raw = SpeculativeHFLLM(
        engine=engine, model_name=MODEL, max_new_tokens=2, completion_to_prompt=lambda p: f"Numbers: {p}"
    )
    assert _usage(raw.complete(COUNT_PROMPT.removeprefix("Numbers: ")))[0] == len(engine.tokenizer.encode(COUNT_PROMPT))
    llm = SpeculativeHFLLM(engine=engine, model_name=MODEL, max_new_tokens=2)
    assert _usage(llm.complete(COUNT_PROMPT, formatted=True))[0] == len(engine.tokenizer.encode(COUNT_PROMPT))
    in_template = _usage(llm.complete(COUNT_PROMPT))[0]
    streamed = list(llm.stream_complete(COUNT_PROMPT))  # HuggingFaceLLM skips its formatting here; we do not
    assert _usage(streamed[-1])[0] == in_template > len(engine.tokenizer.encode(COUNT_PROMPT))


def test_per_call_arguments_are_honoured(llm):
    assert _usage(llm.complete(COUNT_PROMPT, formatted=True, max_new_tokens=3))[1] == 3
    assert _usage(llm.complete(COUNT_PROMPT, formatted=True, max_tokens=4))[1] == 4
    greedy = llm.complete(COUNT_PROMPT, formatted=True, max_new_tokens=4).text
    assert llm.complete(COUNT_PROMPT, formatted=True, max_new_tokens=4, temperature=1.0, top_k=1, seed=5).text == greedy
    sampled = [
        llm.complete(COUNT_PROMPT, formatted=True, max_new_tokens=4, temperature=1.5, top_p=0.9, seed=7).text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]
    full = llm.complete(COUNT_PROMPT, formatted=True, max_new_tokens=24).text
    assert "14, 15" in full
    chunks = list(llm.stream_complete(COUNT_PROMPT, formatted=True, max_new_tokens=24, stop=["14, 15"]))
    assert "".join(c.delta for c in chunks) == full[: full.index("14, 15")]
    assert not any("14" in c.delta for c in chunks) and chunks[-1].additional_kwargs["finish_reason"] == "stop"


# --- the retrieved nodes reach the drafters -----------------------------------------------


@pytest.fixture(scope="module")
def embed_model() -> HuggingFaceEmbedding:
    return HuggingFaceEmbedding(model_name=str(packaged_embedding_path()), device="cpu")


def _faiss_index(nodes: list[TextNode], embed_model: HuggingFaceEmbedding) -> VectorStoreIndex:
    store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(384))
    return VectorStoreIndex(
        nodes, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=embed_model
    )


def test_faiss_index_query_engine_drafts_from_the_retrieved_nodes(engine, embed_model, stats):
    nodes = [
        TextNode(text=COUNT_DOCUMENT, metadata={"title": "counting"}, excluded_llm_metadata_keys=["title"]),
        TextNode(text="Paris is the capital and largest city of France.", metadata={"title": "Paris"}),
        TextNode(text="The Nile is a major north-flowing river in northeastern Africa.", metadata={"title": "Nile"}),
    ]
    index = _faiss_index(nodes, embed_model)
    # A template that trims the context, and a raw-text rendering under which this small model counts on.
    trimming = PromptTemplate(
        "Numbers: {context_str}", function_mappings={"context_str": lambda **kw: kw["context_str"][:30]}
    )
    llm = SpeculativeHFLLM(
        engine=engine, model_name=MODEL, max_new_tokens=32, messages_to_prompt=lambda m: m[-1].content
    )

    def query_engine(*postprocessors):
        return index.as_query_engine(
            llm=llm,
            streaming=True,
            similarity_top_k=1,
            text_qa_template=trimming,
            node_postprocessors=list(postprocessors),
        )

    def ask(*postprocessors) -> tuple[str, dict, list]:
        response = query_engine(*postprocessors).query(QUERY)
        return (
            "".join(response.response_gen),
            stats.ends[-1].additional_kwargs["speculative_stats"],
            response.source_nodes,
        )

    from_prompt, prompt_stats, sources = ask()
    from_nodes, node_stats, _ = ask(DraftDocumentsPostprocessor())
    assert sources[0].node.metadata["title"] == "counting"
    assert from_nodes == from_prompt == llm.complete(COUNT_PROMPT, formatted=True).text
    assert node_stats["tokens_per_forward"] > 1.5 * prompt_stats["tokens_per_forward"]
    # The nodes belong to that query only: other calls in this thread draft from their prompt alone.
    assert current_documents() is None
    assert llm.predict(trimming, context_str=COUNT_DOCUMENT, query_str="another query") == from_prompt
    # (Drafting choices follow measured forward costs, so counts are compared by their effect.)
    assert stats.ends[-1].additional_kwargs["speculative_stats"]["tokens_per_forward"] * 1.5 < node_stats["tokens_per_forward"]

    async def aquery() -> str:
        response = await query_engine(DraftDocumentsPostprocessor()).aquery(QUERY)
        return "".join([token async for token in response.async_response_gen()])

    assert asyncio.run(aquery()) == from_nodes
    assert stats.ends[-1].additional_kwargs["speculative_stats"]["tokens_per_forward"] > 1.5 * prompt_stats["tokens_per_forward"]


def test_pretokenized_node_ids_are_drafted_from(engine):
    ids = engine.tokenizer.encode(COUNT_DOCUMENT, add_special_tokens=False)
    node = TextNode(
        text=COUNT_DOCUMENT[:30],
        metadata={"title": "counting", "token_ids": ids},
        excluded_llm_metadata_keys=["token_ids"],
        excluded_embed_metadata_keys=["token_ids"],
    )
    assert drafter_documents(
        [NodeWithScore(node=node, score=1.0), TextNode(text="plain", metadata={"a": "b"}), "text", [1, 2]]
    ) == [ids, "plain", "text", [1, 2]]
    llm = SpeculativeHFLLM(engine=engine, model_name=MODEL, max_new_tokens=32)
    plain = llm.complete(COUNT_PROMPT, formatted=True)
    with drafting_from([node]):
        assert current_documents() == [ids]
        drafted = llm.complete(COUNT_PROMPT, formatted=True)
    assert current_documents() is None
    assert drafted.text == plain.text
    tokens_per_forward = [r.additional_kwargs["speculative_stats"]["tokens_per_forward"] for r in (plain, drafted)]
    assert tokens_per_forward[1] > 1.5 * tokens_per_forward[0]


# --- concurrency, cancellation, errors ----------------------------------------------------


def test_concurrent_threads_and_tasks_match_sequential(engine):
    llm = SpeculativeHFLLM(engine=engine, model_name=MODEL, max_new_tokens=6)
    langchain_llm = LangChainLLM.from_engine(engine, model=MODEL, max_tokens=6)  # the same weights, another framework
    prompts = [COUNT_PROMPT, "The capital of France is"]
    sequential = [llm.complete(p, formatted=True).text for p in prompts]
    assert sequential[0] != sequential[1]

    results: dict[int, str] = {}

    def stream(i: int, prompt: str) -> None:
        results[i] = "".join(r.delta for r in llm.stream_complete(prompt, formatted=True))

    threads = [threading.Thread(target=stream, args=(i, p)) for i, p in enumerate(prompts * 2)]
    threads.append(threading.Thread(target=lambda: results.__setitem__(9, langchain_llm.invoke(prompts[0]))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[i] for i in range(4)] == sequential * 2 and results[9] == sequential[0]

    async def tasks() -> list[str]:
        async def collect(prompt: str) -> str:
            return "".join([r.delta async for r in await llm.astream_complete(prompt, formatted=True)])

        return await asyncio.gather(*(collect(p) for p in prompts))

    assert asyncio.run(tasks()) == sequential


def test_async_calls_run_together(llm):
    prompts = [COUNT_PROMPT, "The capital of France is", "Once upon a time"]
    alone = [llm.complete(p, formatted=True, max_new_tokens=12).text for p in prompts]

    async def gathered():
        return await asyncio.gather(*(llm.acomplete(p, formatted=True, max_new_tokens=12) for p in prompts))

    responses = asyncio.run(gathered())
    assert [r.text for r in responses] == alone
    assert max(size for r in responses for size in r.additional_kwargs["speculative_stats"]["batch_sizes"]) > 1


def test_leaving_astream_early_frees_the_engine(llm):
    async def leave_then_generate() -> None:
        responses = await llm.astream_complete(COUNT_PROMPT, formatted=True, max_new_tokens=2000)
        async for _ in responses:
            break
        await responses.aclose()
        # Were the abandoned generation still running, this would wait for its 2000 tokens.
        await asyncio.wait_for(llm.acomplete(COUNT_PROMPT, formatted=True, max_new_tokens=2), timeout=30)

    asyncio.run(leave_then_generate())


class _ExplodingDrafter(Drafter):
    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        raise RuntimeError("drafter exploded")


def test_generation_errors_propagate_through_async_streams(engine):
    broken = SpeculativeHFLLM(
        engine=SpeculativeEngine(engine.model, engine.tokenizer, _ExplodingDrafter()), model_name=MODEL
    )

    async def consume() -> None:
        async for _ in await broken.astream_chat([ChatMessage(role="user", content=QUESTION)]):
            pass

    with pytest.raises(RuntimeError, match="drafter exploded"):
        asyncio.run(consume())


# --- bad input ----------------------------------------------------------------------------


def test_bad_input_is_refused(llm, engine):
    with pytest.raises(TypeError, match="'max_lenght'"):
        llm.complete("hi", max_lenght=5)
    with pytest.raises(TypeError, match="not both"):
        llm.stream_complete("hi", max_tokens=2, max_new_tokens=3)
    with pytest.raises(TypeError, match="documents must be a list"):
        llm.complete("hi", documents="one string")
    with pytest.raises(ValueError, match="stop must be"):
        llm.complete("hi", stop=[3])
    with pytest.raises(ValueError, match="non-empty string"):
        llm.complete("")
    with pytest.raises(ValueError, match="at least one message"):
        llm.chat([])
    with pytest.raises(ValueError, match="must end with a user message"):
        llm.stream_chat([ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="hello")])
    with pytest.raises(ValueError, match="last user message is empty"):
        llm.chat([ChatMessage(role="user", content="")])
    with pytest.raises(ValueError, match="not 'chatbot'"):
        llm.chat([ChatMessage(role=MessageRole.CHATBOT, content="42"), ChatMessage(role="user", content="and?")])
    with pytest.raises(ValueError, match="no user turn"):  # a tool result answers a user's request
        llm.chat([ChatMessage(role=MessageRole.TOOL, content="42")])
    with pytest.raises(ValueError, match="text content only"):
        llm.chat([ChatMessage(role="user", blocks=[ImageBlock(url="https://example.com/cat.png")])])
    with pytest.raises(ValidationError, match="max_lenght"):
        SpeculativeHFLLM(engine=engine, max_lenght=5)
    with pytest.raises(ValueError, match="cannot be combined with engine"):
        SpeculativeHFLLM(engine=engine, dtype="float16")
    with pytest.raises(ValueError, match="pass model_name"):
        SpeculativeHFLLM()


def test_devices_as_huggingface_llm_takes_them(engine):
    # Refused when the object is built, before any model loads.
    with pytest.raises(ValueError, match="device_map"):  # one device, as HuggingFaceLLM names it: a string
        SpeculativeHFLLM(MODEL, device_map={"model.embed_tokens": 0, "lm_head": 1})
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        SpeculativeHFLLM(MODEL, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
            SpeculativeHFLLM(MODEL, device_map="cuda:0")
    with pytest.raises(ValueError, match="cannot be combined with engine"):
        SpeculativeHFLLM(engine=engine, device_map="cpu")
    # The default, device_map="auto", is the engine's device here: the shared engine is reused.
    assert SpeculativeHFLLM(MODEL, dtype=DTYPE).engine is engine


# --- function calling ---------------------------------------------------------------------
# SmolLM2's chat template renders no tools; Qwen2.5's (ChatML too, so the same special tokens) does. The
# same weights under that template (packaged_fixtures.QWEN_TOOLS_TEMPLATE) make a model that is offered
# tools; and this small model copies a tool call it is shown, which makes the whole loop (call, tool,
# result, answer) run for real.

SEARCH_RESULT = "Paris is the capital and largest city of France."
SEARCH_CALL = '{"name": "search", "arguments": {"query": "capital of France"}}'
WEATHER_CALL = '{"name": "weather", "arguments": {"city": "Paris"}}'


def copy_this(*calls: str) -> str:
    """A user turn this model answers with exactly the tool calls in it."""
    return "Copy this text exactly, nothing else:\n" + "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)


def copy_before_instruction(*calls: str) -> str:
    """`copy_this`, where the tool choice asks for a call after it (after a blank line, which the model
    is told to ignore)."""
    return copy_this(*calls).replace("nothing else:", "nothing else (ignore anything after a blank line):", 1)


def search(query: str) -> str:
    """Search the passages for the query."""
    return SEARCH_RESULT


def weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


class Capital(BaseModel):
    """A country's capital."""

    city: str
    country: str


@pytest.fixture(scope="module")
def tools_engine(engine) -> SpeculativeEngine:
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = QWEN_TOOLS_TEMPLATE
    tools_engine = SpeculativeEngine(engine.model, tokenizer, name="smollm2-135m-qwen-tools-template")
    tools_engine.cost_model = engine.cost_model  # pinned (learn=False), as the shared engine's
    return tools_engine


@pytest.fixture
def tools_llm(tools_engine) -> SpeculativeHFLLM:
    return SpeculativeHFLLM(engine=tools_engine, model_name=MODEL, max_new_tokens=40)


@pytest.fixture
def prepared(tools_engine, monkeypatch) -> list[tuple]:
    """The (prompt, options) of every generation the tools engine starts, recorded on the way through."""
    calls = []
    prepare = tools_engine.prepare

    def recording(prompt, **options):
        calls.append((prompt, options))
        return prepare(prompt, **options)

    monkeypatch.setattr(tools_engine, "prepare", recording)
    return calls


def test_a_template_that_renders_tools_makes_a_function_calling_model(tools_llm, tools_engine):
    assert tools_llm.metadata.is_function_calling_model
    # A messages_to_prompt of the caller's replaces the template, tools and all.
    own = SpeculativeHFLLM(engine=tools_engine, messages_to_prompt=lambda m: m[-1].content)
    assert not own.metadata.is_function_calling_model
    # An agent takes it (an agent over a model that calls tools runs in the tests below).
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(search)], llm=tools_llm, system_prompt="Be brief.")
    assert agent.llm is tools_llm and [t.metadata.name for t in agent.tools] == ["search"]


def test_tools_reach_the_engine_in_openai_format_and_greedy_output_is_unchanged(tools_llm, tools_engine, prepared):
    tool = FunctionTool.from_defaults(search)
    response = tools_llm.chat_with_tools([tool], user_msg=QUESTION, max_new_tokens=24)
    (messages, options), = prepared
    assert messages == [{"role": "user", "content": QUESTION}]
    assert options["tools"] == [tool.metadata.to_openai_tool()] == [{
        "type": "function",
        "function": {
            "name": "search",
            "description": tool.metadata.description,  # the signature, then the docstring
            "parameters": {
                "type": "object", "properties": {"query": {"title": "Query", "type": "string"}}, "required": ["query"]
            },
        },
    }]
    ids = tools_engine.encode_prompt(messages, chat=True, tools=options["tools"])
    assert '"name": "search"' in tools_engine.tokenizer.decode(ids) and _usage(response)[0] == len(ids)
    # The answer is the model's own greedy one over the prompt with the tools: the engine's and
    # transformers' generate give the same tokens.
    expected = tools_engine.generate(ids, max_new_tokens=24)
    assert response.raw["text"] == response.message.content == expected.text
    # Through the engine's kernels, as the demo compares.
    with FastKernels() if tools_engine.traits.kernels else contextlib.nullcontext():
        reference = tools_engine.model.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long)
        )[0, len(ids) :].tolist()
    assert expected.token_ids == reference[: len(expected.token_ids)]
    assert tools_llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    # OpenAI-format dicts go straight through chat(tools=...).
    direct = tools_llm.chat([ChatMessage(role="user", content=QUESTION)], tools=options["tools"], max_new_tokens=24)
    assert direct.raw["text"] == expected.text


def test_the_calls_the_model_writes_become_tool_selections(tools_llm):
    tools = [FunctionTool.from_defaults(search), FunctionTool.from_defaults(weather)]
    response = tools_llm.chat_with_tools(tools, user_msg=copy_this(SEARCH_CALL))
    assert response.raw["text"] == f"<tool_call>\n{SEARCH_CALL}\n</tool_call>" and response.message.content == ""
    call = {"id": "call_0", "type": "function", "function": {"name": "search", "arguments": {"query": "capital of France"}}}
    assert response.message.additional_kwargs == {"tool_calls": [call]}
    assert tools_llm.get_tool_calls_from_response(response) == [
        ToolSelection(tool_id="call_0", tool_name="search", tool_kwargs={"query": "capital of France"})
    ]

    # Streamed: the deltas are the text as written, the last response carries the parsed calls.
    chunks = list(tools_llm.stream_chat_with_tools(tools, user_msg=copy_this(SEARCH_CALL)))
    assert "".join(c.delta for c in chunks) == response.raw["text"]
    assert all(tools_llm.get_tool_calls_from_response(c, error_on_no_tool_call=False) == [] for c in chunks[:-1])
    assert chunks[-1].message.additional_kwargs == response.message.additional_kwargs

    # Two calls: both with parallel calls allowed, else the first (chat_with_tools' default).
    both = copy_this(SEARCH_CALL, WEATHER_CALL)
    parallel = asyncio.run(tools_llm.achat_with_tools(tools, user_msg=both, allow_parallel_tool_calls=True, max_new_tokens=64))
    assert [s.tool_name for s in tools_llm.get_tool_calls_from_response(parallel)] == ["search", "weather"]
    single = tools_llm.chat_with_tools(tools, user_msg=both, max_new_tokens=64)
    assert [s.tool_name for s in tools_llm.get_tool_calls_from_response(single)] == ["search"]


def test_a_malformed_call_comes_back_as_text_with_the_reason(tools_llm):
    broken = '{"name": "search", "arguments": {"query": }'
    response = tools_llm.chat_with_tools([FunctionTool.from_defaults(search)], user_msg=copy_this(broken))
    assert response.message.content == f"<tool_call>\n{broken}\n</tool_call>"
    assert "tool call 0 is not valid JSON" in response.message.additional_kwargs["tool_call_error"]
    assert "tool_calls" not in response.message.additional_kwargs
    assert tools_llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="without a tool call: tool call 0 is not valid JSON"):
        tools_llm.get_tool_calls_from_response(response)


def test_tool_history_renders_through_the_template(tools_llm, tools_engine, prepared):
    tool = FunctionTool.from_defaults(search)
    # The assistant's call as OpenAI's adapter leaves it (arguments as a JSON string), and as a block.
    arguments = '{"query": "capital of France"}'
    openai_call = {"id": "call_7", "type": "function", "function": {"name": "search", "arguments": arguments}}
    history = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content=QUESTION),
        ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [openai_call]}),
        ChatMessage(role="tool", content=SEARCH_RESULT, additional_kwargs={"tool_call_id": "call_7"}),
    ]
    block = ToolCallBlock(tool_call_id="call_7", tool_name="search", tool_kwargs={"query": "capital of France"})
    as_blocks = [*history[:2], ChatMessage(role="assistant", blocks=[block]), history[3]]
    first = tools_llm.chat_with_tools([tool], chat_history=history, max_new_tokens=8)
    second = tools_llm.chat_with_tools([tool], chat_history=as_blocks, max_new_tokens=8)
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "search", "arguments": {"query": "capital of France"}}}
        ]},
        {"role": "tool", "content": SEARCH_RESULT, "tool_call_id": "call_7"},
    ]
    assert [p[0] for p in prepared] == [expected, expected] and first.raw["text"] == second.raw["text"]
    text = tools_engine.tokenizer.decode(tools_engine.encode_prompt(expected, chat=True, tools=prepared[0][1]["tools"]))
    assert f"<|im_start|>assistant\n<tool_call>\n{SEARCH_CALL}\n</tool_call><|im_end|>" in text
    assert text.endswith(f"<|im_start|>user\n<tool_response>\n{SEARCH_RESULT}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # The tool's result feeds the drafters.
    ids = tools_engine.tokenizer.encode(SEARCH_RESULT, add_special_tokens=False)
    assert ids in tools_engine.prepare(expected, chat=True, tools=prepared[0][1]["tools"]).document_ids


def test_tool_choice_and_tool_required_ask_in_the_prompt(tools_llm, prepared):
    tools = [FunctionTool.from_defaults(search), FunctionTool.from_defaults(weather)]
    system = ChatMessage(role="system", content="Be brief.")
    user = ChatMessage(role="user", content=QUESTION)
    tools_llm.chat_with_tools(tools, chat_history=[system, user], tool_choice="weather", max_new_tokens=2)
    tools_llm.chat_with_tools(tools, chat_history=[user], tool_required=True, max_new_tokens=2)
    as_dict = {"type": "function", "function": {"name": "search"}}
    tools_llm.chat_with_tools(tools, chat_history=[user], tool_choice=as_dict, max_new_tokens=2)
    tools_llm.chat_with_tools(tools, chat_history=[user], tool_choice="none", max_new_tokens=2)
    # At the end of the last user message, in the words every entrance uses (the one prompt builder): the
    # system message, the start of every turn's prompt, stays as it is, and so stays in the prompt cache.
    assert [p[0] for p in prepared[:3]] == [
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": f"{QUESTION}\n\n{NAMED.format(name='weather')}"}],
        [{"role": "user", "content": f"{QUESTION}\n\n{REQUIRED}"}],
        [{"role": "user", "content": f"{QUESTION}\n\n{NAMED.format(name='search')}"}],
    ]
    # A tool named by the choice is the only one the template gets, as through the server and LangChain.
    assert [len(p[1]["tools"] or ()) for p in prepared] == [1, 2, 1, 0] and prepared[3][0] == [{"role": "user", "content": QUESTION}]
    # After a tool result, in the system message.
    selection = ToolSelection(tool_id="call_0", tool_name="search", tool_kwargs={"query": "France"})
    called = ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [selection]})
    result = ChatMessage(role="tool", content=SEARCH_RESULT, additional_kwargs={"tool_call_id": "call_0"})
    tools_llm.chat_with_tools(tools, chat_history=[system, user, called, result], tool_required=True, max_new_tokens=2)
    assert prepared[4][0][0] == {"role": "system", "content": f"Be brief.\n\n{REQUIRED}"}
    assert prepared[4][0][2]["tool_calls"] == [
        {"id": "call_0", "type": "function", "function": {"name": "search", "arguments": {"query": "France"}}}
    ]
    assert system.content == "Be brief." and user.content == QUESTION  # the caller's messages are left as they were


def test_structured_output_goes_through_a_tool_call(tools_llm, prepared):
    call = '{"name": "Capital", "arguments": {"city": "Paris", "country": "France"}}'
    predicted = tools_llm.structured_predict(Capital, PromptTemplate("{text}"), text=copy_before_instruction(call))
    assert predicted == Capital(city="Paris", country="France")
    # The output class is the one tool offered, and a call is asked for.
    (messages, options), = prepared
    assert options["tools"] == [get_function_tool(Capital).metadata.to_openai_tool()]
    assert messages == [{"role": "user", "content": f"{copy_before_instruction(call)}\n\n{CALL_ONE_OF.format(names='Capital')}"}]

    structured = tools_llm.as_structured_llm(Capital).chat([ChatMessage(role="user", content=copy_before_instruction(call))])
    assert structured.raw == Capital(city="Paris", country="France")
    assert json.loads(structured.message.content) == {"city": "Paris", "country": "France"}
    # A model that answers in text (here a call it got wrong) instead: the reason, not a silent None.
    with pytest.raises(ValueError, match="the model answered without a tool call: "):
        tools_llm.structured_predict(Capital, PromptTemplate("{text}"), text=QUESTION)


def test_function_agent_calls_the_tool_and_answers_over_its_result(tools_llm, prepared):
    searched = []

    def search_passages(query: str) -> str:
        """Search the passages for the query."""
        searched.append(query)
        return SEARCH_RESULT

    agent = FunctionAgent(tools=[FunctionTool.from_defaults(search_passages)], llm=tools_llm)
    call = '{"name": "search_passages", "arguments": {"query": "capital of France"}}'

    async def run() -> tuple[list, str]:
        handler = agent.run(copy_this(call))
        events = [
            (type(e).__name__, e.tool_name, e.tool_kwargs)
            async for e in handler.stream_events()
            if isinstance(e, (ToolCall, ToolCallResult))
        ]
        return events, str(await handler)

    events, answer = asyncio.run(run())
    arguments = {"query": "capital of France"}
    assert events == [("ToolCall", "search_passages", arguments), ("ToolCallResult", "search_passages", arguments)]
    assert searched == ["capital of France"] and answer.strip()
    # The second turn saw the call and its result, rendered through the template.
    second = prepared[1][0]
    assert [m["role"] for m in second[-3:]] == ["user", "assistant", "tool"] and second[-1]["content"] == SEARCH_RESULT
    assert second[-2]["tool_calls"][0]["function"] == {"name": "search_passages", "arguments": {"query": "capital of France"}}


def test_bad_tools_are_refused_at_the_call_naming_them(llm, tools_llm):
    messages = [ChatMessage(role="user", content=QUESTION)]
    numbers = FunctionTool.from_defaults(sum, name="numbers", description="Sums.", fn_schema=RootModel[list[int]])
    with pytest.raises(InvalidArgumentError, match="tool 'numbers': parameters must be a JSON Schema object"):
        tools_llm.chat_with_tools([numbers], user_msg=QUESTION)
    spaced = FunctionTool.from_defaults(search, name="search docs")
    with pytest.raises(InvalidArgumentError, match="tool 'search docs' cannot be offered to the model"):
        tools_llm.chat_with_tools([spaced], user_msg=QUESTION)
    with pytest.raises(InvalidArgumentError, match="tool 'search' is given twice"):
        tools_llm.chat_with_tools([FunctionTool.from_defaults(search)] * 2, user_msg=QUESTION)
    with pytest.raises(InvalidArgumentError, match=r"tools\[0\] must be"):
        tools_llm.chat(messages, tools=[{"name": "search"}])
    with pytest.raises(ValueError, match="tool_choice names the tool 'weather', which is not among the tools: search"):
        tools_llm.chat_with_tools([FunctionTool.from_defaults(search)], user_msg=QUESTION, tool_choice="weather")
    with pytest.raises(ValueError, match="needs at least one tool"):
        tools_llm.chat_with_tools([], user_msg=QUESTION, tool_required=True)
    with pytest.raises(InvalidArgumentError, match="chat template takes no tools"):
        llm.chat_with_tools([FunctionTool.from_defaults(search)], user_msg=QUESTION)
    with pytest.raises(TypeError, match="'tools'"):
        tools_llm.complete(QUESTION, tools=[FunctionTool.from_defaults(search)])
    own = SpeculativeHFLLM(engine=tools_llm.engine, messages_to_prompt=lambda m: m[-1].content)
    with pytest.raises(ValueError, match="messages_to_prompt replaces"):
        own.chat(messages, tools=[FunctionTool.from_defaults(search)])
    bad_call = {"function": {"name": "search", "arguments": "{not json"}}
    with pytest.raises(ValueError, match=r"call_0 \('search'\) has arguments that are not valid JSON"):
        called = ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [bad_call]})
        tools_llm.chat([*messages, called, ChatMessage(role="tool", content="x")])


def test_the_agentic_example_offers_its_search_tool():
    # The example itself runs Qwen2.5-Coder-1.5B (SmolLM2's template renders no tools): here, its parts.
    example = importlib.import_module("agentic_rag_llamaindex")

    class Index:
        def search(self, query: str, k: int) -> list[Chunk]:
            return [Chunk(SEARCH_RESULT, 0.9, "Paris", "nq-1", {}, [], 0)][:k]

    tool = example.search_tool(Index(), 3)
    assert openai_tools([tool])[0]["function"]["name"] == "search_passages"
    assert tool.call(query="capital of France").content == f"[1] Paris\n{SEARCH_RESULT}"
    assert example.parse_args(["--question", "q"]).model == "qwen2.5-coder-1.5b-instruct"
