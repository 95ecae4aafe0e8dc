"""SpeculativeHFLLM in real LlamaIndex pipelines (FAISS index, query engines, callbacks, instrumentation),
with the small packaged model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import faiss
import pytest
import torch
from langchain_rag_speculate import SpeculativeHFLLM as LangChainLLM
from llama_index.core import PromptTemplate, StorageContext, VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.llms.rag_speculate import DraftDocumentsPostprocessor, SpeculativeHFLLM, drafting_from
from llama_index.llms.rag_speculate.documents import current_documents, drafter_documents
from llama_index.vector_stores.faiss import FaissVectorStore
from pydantic import Field, ValidationError

from rag_speculate import Drafter, DraftTree, SpeculativeEngine
from rag_speculate.retrieval.corpus import packaged_embedding_path

from .conftest import COUNT_DOCUMENT, COUNT_PROMPT, DTYPE, MODEL

QUESTION = "What is the capital of France?"
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
    assert metadata.context_window == engine.max_positions == 8192
    assert metadata.num_output == 10 and metadata.is_chat_model and metadata.model_name == MODEL


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
    with pytest.raises(ValueError, match="not 'tool'"):
        llm.chat([ChatMessage(role=MessageRole.TOOL, content="42"), ChatMessage(role="user", content="and?")])
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
