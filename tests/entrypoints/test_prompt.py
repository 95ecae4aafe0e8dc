"""One prompt builder for every entrance: the same request through the command line, the server, the
LangChain chat model and the LlamaIndex LLM gives the model the same token ids (the packaged SmolLM2)."""

from __future__ import annotations

import copy

import openai
import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_rag_speculate import ChatSpeculativeHF
from llama_index.core.base.llms.types import ChatMessage
from llama_index.llms.rag_speculate import SpeculativeHFLLM
from packaged_fixtures import DOCUMENT, MODEL, QWEN_TOOLS_TEMPLATE

from rag_speculate import InvalidArgumentError, SpeculativeEngine
from rag_speculate.entrypoints.cli import main
from rag_speculate.entrypoints.engines import shared_engine
from rag_speculate.entrypoints.openai import Server
from rag_speculate.entrypoints.openai.app import create_app
from rag_speculate.entrypoints.openai.background import running
from rag_speculate.entrypoints.prompt import RAG_SYSTEM_PROMPT, prepare, rag_messages
from rag_speculate.retrieval.corpus import CorpusIndex, Document

QUESTION = "Who designed the Eiffel Tower?"
SYSTEM = "Be brief."
TOOLS = [
    {"type": "function", "function": {"name": "search", "description": "Search the web.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]  # fmt: skip


@pytest.fixture
def prompts(monkeypatch) -> list[list[int]]:
    """The prompt ids of every generation any engine starts from now on, recorded on the way through."""
    seen = []
    stream_request = SpeculativeEngine.stream_request

    def recording(self, request):
        seen.append(request.prompt_ids)
        return stream_request(self, request)

    monkeypatch.setattr(SpeculativeEngine, "stream_request", recording)
    return seen


@pytest.fixture(scope="module")
def engine() -> SpeculativeEngine:
    return shared_engine(MODEL, dtype="float32", device="cpu", draft_budget=None)


@pytest.fixture(scope="module")
def index(engine, tmp_path_factory) -> CorpusIndex:
    documents = [
        Document(id="eiffel", text=DOCUMENT, title="Eiffel Tower"),
        Document(id="louvre", text="The Louvre is the world's most-visited art museum, in Paris.", title="Louvre"),
        Document(id="nile", text="The Nile is a major north-flowing river in northeastern Africa.", title="Nile"),
    ]
    return CorpusIndex.build(documents, tmp_path_factory.mktemp("prompt") / "index", tokenizer=engine.tokenizer)


def _langchain(messages: list[dict]) -> list:
    kinds = {"system": SystemMessage, "user": HumanMessage}
    return [kinds[m["role"]](content=m["content"]) for m in messages]


def test_a_question_over_retrieved_chunks_gives_one_prompt_through_every_entrance(engine, index, prompts, capsys):
    assert main(["ask", str(index.path), QUESTION, "-k", "2", "--max-new-tokens", "2", "--model", MODEL, "--threads", "1"]) == 0
    with running(create_app(Server(shared_engine(MODEL, dtype="float32", device="cpu", index=index), MODEL, index))) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=2,
                                       extra_body={"retrieve": 2})
    # The frameworks' users retrieve through their own retrievers: the same chunks, in the messages.
    messages = rag_messages(QUESTION, index.search(QUESTION, 2))
    assert messages[0] == {"role": "system", "content": RAG_SYSTEM_PROMPT}
    ChatSpeculativeHF(engine=engine, max_tokens=2).invoke(_langchain(messages))
    SpeculativeHFLLM(engine=engine, max_new_tokens=2).chat([ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    cli, server, langchain, llamaindex = prompts
    assert cli == server == langchain == llamaindex
    assert "Gustave Eiffel" in engine.tokenizer.decode(cli)


def test_tools_and_the_choice_of_one_give_one_prompt_through_the_server_and_both_adapters(engine, prompts):
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = QWEN_TOOLS_TEMPLATE
    tools_engine = SpeculativeEngine(engine.model, tokenizer, name=MODEL)
    tools_engine.cost_model = engine.cost_model
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for choice, langchain_choice in (("required", "any"), ({"type": "function", "function": {"name": "weather"}}, "weather")):
        with running(create_app(Server(tools_engine, MODEL))) as url:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, tools=TOOLS, tool_choice=choice)
        ChatSpeculativeHF(engine=tools_engine, max_tokens=2).bind_tools(TOOLS, tool_choice=langchain_choice).invoke(_langchain(messages))
        SpeculativeHFLLM(engine=tools_engine, max_new_tokens=2).chat(
            [ChatMessage(role=m["role"], content=m["content"]) for m in messages], tools=TOOLS, tool_choice=choice
        )
        server, langchain, llamaindex = prompts[-3:]
        assert server == langchain == llamaindex
        direct = prepare(tools_engine, messages, tools=TOOLS, tool_choice=choice, max_new_tokens=2)
        assert direct.request.prompt_ids == server
    required, named = prompts[0], prompts[3]
    assert "Answer by calling one of the tools (search, weather)" in tokenizer.decode(required)
    assert '"name": "search"' not in tokenizer.decode(named)  # only the tool named is offered


def test_a_json_answer_gives_one_prompt_through_the_server_and_langchain(engine, prompts):
    messages = [{"role": "user", "content": QUESTION}]
    with running(create_app(Server(engine, MODEL))) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, response_format={"type": "json_object"})
    ChatSpeculativeHF(engine=engine, max_tokens=2).bind(response_format={"type": "json_object"}).invoke(_langchain(messages))
    assert prompts[0] == prompts[1]
    assert "Answer with one JSON object" in engine.tokenizer.decode(prompts[0])


def test_bad_arguments_name_themselves(engine):
    cases = [
        ({"tool_choice": "lookup", "tools": TOOLS}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"documents": "one string"}, "documents"),
        ({"temperature": -1.0}, "temperature"),
    ]
    for options, argument in cases:
        with pytest.raises(InvalidArgumentError) as error:
            prepare(engine, QUESTION, **options)
        assert error.value.argument == argument, options
    with pytest.raises(InvalidArgumentError) as error:
        prepare(engine, [{"role": "assistant", "content": "hi"}])
    assert error.value.argument == "messages"
    with pytest.raises(InvalidArgumentError, match="need a chat") as error:
        prepare(engine, "Once upon a time", chat=False, tools=TOOLS)
    assert error.value.argument == "tools"
