"""`ChatSpeculativeHF`: a LangChain chat model on the speculative engine (in place of `ChatHuggingFace`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
    UsageMetadata,
)
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, Generation
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from rag_speculate import GenerationResult, GenerationStream
from rag_speculate.entrypoints.prompt import Prepared, chosen_tool, prepare
from rag_speculate.entrypoints.tool_calls import HeldText

from ._common import CALL_ARGUMENTS, MODEL_CONFIG, SpeculativeHFParams
from ._tools import TOOL_ARGUMENTS, ReadCalls, convert_tools, describe, one_line

_ROLES = {SystemMessage: "system", HumanMessage: "user", AIMessage: "assistant", ToolMessage: "tool"}
# Content blocks an AI message may carry beside its text that repeat its `tool_calls` (Anthropic's
# "tool_use", LangChain v1's "tool_call"): the calls are rendered from `tool_calls`.
_CALL_BLOCKS = ("tool_use", "tool_call", "tool_call_chunk", "invalid_tool_call")
STRUCTURED_OUTPUT_METHODS = ("function_calling", "json_schema", "json_mode")


@dataclass
class _Call:
    """One generation under way: its stream, and the request it answers (its messages, and the tools
    offered, when there are any: then the answer is read for calls)."""

    stream: GenerationStream
    prepared: Prepared

    @property
    def messages(self) -> list[dict]:
        return self.prepared.messages

    @property
    def reads_calls(self) -> bool:
        return self.prepared.tools is not None


class ChatSpeculativeHF(SpeculativeHFParams, BaseChatModel):
    """A local Hugging Face model as a LangChain chat model (its own chat template), accelerated by
    lossless speculative decoding. Text in, text out; tools through the chat template
    (`bind_tools`, `with_structured_output`); no images.

        chat = ChatSpeculativeHF(model="qwen2.5-coder-1.5b-instruct", max_tokens=128)
        chat.invoke([("system", "Answer briefly."), ("human", "Who wrote Hamlet?")])

    Documents reach the drafters as with `SpeculativeHFLLM`: from the prompt, or `bind(documents=...)`.
    """

    model_config = MODEL_CONFIG

    call_arguments = CALL_ARGUMENTS + TOOL_ARGUMENTS

    streaming: bool = False
    """Generate through `_stream` even for `invoke`, so callbacks receive every token."""

    @property
    def _llm_type(self) -> str:
        return "rag-speculate-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params(super()._get_ls_params(stop=stop, **kwargs), stop, kwargs)

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the model's own tokenizer (LangChain's default would be GPT-2's)."""
        return self.get_engine().tokenizer.encode(text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """The prompt length exactly as generation will see it: the messages (and tools) in the chat template."""
        converted = convert_tools(tools) if tools else None
        return len(self.get_engine().encode_prompt(_chat_messages(messages), chat=True, tools=converted))

    # --- tools and structured output ------------------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | Any],
        *,
        tool_choice: str | dict | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """The model with tools, which reach the chat template (OpenAI function format, converted from
        LangChain tools, pydantic models, functions, TypedDicts or dicts) and checked now.

        There is no constrained decoding, so `tool_choice` acts through the prompt: None or "auto"
        passes every tool, "none" passes none, "any" (or "required") passes every tool and asks for a
        call at the end of the last message; a tool's name (or {"type": "function", "function":
        {"name": ...}}) passes only that tool and asks for a call to it. The answer is read for calls
        whenever tools reach the template; the model may still answer with text.
        """
        formatted = convert_tools(tools)
        chosen_tool(tool_choice, formatted)  # refused now, by name, rather than at the first call
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict | type | None = None,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | Any]:
        """The model answering with an instance of `schema` (a pydantic class) or a dict (a TypedDict,
        a JSON schema, an OpenAI tool; json_mode also takes no schema).

        "function_calling" binds the schema as the one tool and asks for a call to it (the chat template
        must take tools); "json_schema" asks, in the system message, for a JSON object following the
        schema; "json_mode" for a JSON object (describe the keys in your prompt). A fenced ```json
        block is read too. Nothing constrains decoding, so `strict` changes nothing; a pydantic schema is
        validated by its parser. A failed parse raises `OutputParserException` (or pydantic's
        `ValidationError`), unless `include_raw=True`: then the result is {"raw": the AIMessage,
        "parsed": the object or None, "parsing_error": the exception or None}.
        """
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        if method not in STRUCTURED_OUTPUT_METHODS:
            raise ValueError(f"method must be one of {', '.join(map(repr, STRUCTURED_OUTPUT_METHODS))}, got {method!r}")
        if schema is None and method != "json_mode":
            raise ValueError(f"method={method!r} needs a schema")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        traced = {"ls_structured_output_format": {"kwargs": {"method": method, "strict": strict}, "schema": schema}}
        if schema is None:
            traced = {}
        if method == "function_calling":
            name = _converted(schema, convert_to_openai_tool)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, **traced)
            parser: Runnable = (
                _CalledPydanticTool(tools=[schema], first_tool_only=True)
                if is_pydantic
                else _CalledTool(key_name=name, first_tool_only=True)
            )
        else:
            if method == "json_schema":
                json_schema = _converted(schema, convert_to_json_schema)
                named = {"name": json_schema.get("title", "answer"), "schema": json_schema}
                response_format = {"type": "json_schema", "json_schema": named}
            else:
                response_format = {"type": "json_object"}
                if schema is not None:
                    _converted(schema, convert_to_json_schema)
            llm = self.bind(response_format=response_format, **traced)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    # --- generation -----------------------------------------------------------------------------

    def _start(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Call:
        options = self._generation_kwargs(stop, kwargs)  # checks every argument's name
        tools = convert_tools(kwargs["tools"]) if kwargs.get("tools") else None
        engine = self.get_engine()
        prepared = prepare(
            engine, _chat_messages(messages), tools=tools, tool_choice=kwargs.get("tool_choice"),
            response_format=kwargs.get("response_format"), **options,
        )  # fmt: skip
        return _Call(engine.stream_request(prepared.request), prepared)

    def _message(self, call: _Call, result: GenerationResult) -> AIMessage:
        info = self._result_info(result)
        if not call.reads_calls:
            return AIMessage(content=result.text, usage_metadata=_usage_metadata(result), response_metadata=info)
        read = ReadCalls(result.text, call.messages)
        if read.parsed.error:
            info["tool_call_error"] = read.parsed.error
        return AIMessage(
            content=read.content,
            tool_calls=read.tool_calls,
            invalid_tool_calls=read.invalid_tool_calls,
            usage_metadata=_usage_metadata(result),
            response_metadata=info,
        )

    def _chat_result(self, call: _Call, result: GenerationResult) -> ChatResult:
        message = self._message(call, result)
        generation = ChatGeneration(message=message, generation_info={"finish_reason": result.finish_reason})
        return ChatResult(
            generations=[generation],
            llm_output={"token_usage": message.response_metadata["token_usage"], "model_name": self.model},
        )

    def _last_chunks(self, call: _Call, held: HeldText | None) -> list[ChatGenerationChunk]:
        """What a stream ends with: the text held back and the calls (one chunk, when there are any),
        then the usage and stats, once per stream, so aggregating the chunks counts them once."""
        result = call.stream.result
        chunks = []
        info = self._result_info(result)
        if held is not None:
            read = ReadCalls(result.text, call.messages)
            rest, calls = held.finish(read.content), read.chunks()
            if rest or calls:
                chunks.append(ChatGenerationChunk(message=AIMessageChunk(content=rest, tool_call_chunks=calls)))
            if read.parsed.error:
                info["tool_call_error"] = read.parsed.error
        message = AIMessageChunk(
            content="", usage_metadata=_usage_metadata(result), response_metadata=info, chunk_position="last"
        )
        chunks.append(ChatGenerationChunk(message=message, generation_info={"finish_reason": result.finish_reason}))
        return chunks

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._start(messages, stop, kwargs)
        return self._chat_result(call, call.stream.collect())

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._start(messages, stop, kwargs)
        return self._chat_result(call, await call.stream.acollect())

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call = self._start(messages, stop, kwargs)
        held = HeldText() if call.reads_calls else None
        try:
            for delta in call.stream:
                text = held.feed(delta) if held is not None else delta
                if text:
                    yield self._text_chunk(text, run_manager)
        finally:
            call.stream.close()  # a consumer that stops early frees the engine at once
        for chunk in self._last_chunks(call, held):
            if run_manager and chunk.message.chunk_position != "last":
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        call = self._start(messages, stop, kwargs)
        held = HeldText() if call.reads_calls else None
        async for delta in call.stream:
            text = held.feed(delta) if held is not None else delta
            if text:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=text))
                if run_manager:
                    await run_manager.on_llm_new_token(text, chunk=chunk)
                yield chunk
        for chunk in self._last_chunks(call, held):
            if run_manager and chunk.message.chunk_position != "last":
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    @staticmethod
    def _text_chunk(text: str, run_manager: CallbackManagerForLLMRun | None) -> ChatGenerationChunk:
        chunk = ChatGenerationChunk(message=AIMessageChunk(content=text))
        if run_manager:
            run_manager.on_llm_new_token(text, chunk=chunk)
        return chunk


class _CalledTool(JsonOutputKeyToolsParser):
    """The arguments of the call to `key_name`; an answer without that call raises instead of
    giving None (nothing forces a local model to call the tool)."""

    def parse_result(self, result: list[Generation], *, partial: bool = False) -> Any:
        parsed = super().parse_result(result, partial=partial)
        if parsed is None and not partial:
            _no_call(self.key_name, result)
        return parsed


class _CalledPydanticTool(PydanticToolsParser):
    def parse_result(self, result: list[Generation], *, partial: bool = False) -> Any:
        parsed = super().parse_result(result, partial=partial)
        if parsed is None and not partial:
            _no_call(self.tools[0].__name__, result)
        return parsed


def _no_call(name: str, result: list[Generation]) -> None:
    text = result[0].text if result else ""
    raise OutputParserException(f"the model answered without calling the tool {name}: {text[:200]!r}", llm_output=text)


def _converted(schema: Any, convert: Callable[[Any], dict]) -> dict:
    try:
        return convert(schema)
    except Exception as exc:  # noqa: BLE001 - LangChain raises ValueError, TypeError, or pydantic's errors
        raise ValueError(
            f"schema {describe(schema)} cannot be converted for structured output: {one_line(exc)}"
        ) from exc


def _usage_metadata(result: GenerationResult) -> UsageMetadata:
    usage = result.stats.usage()
    return UsageMetadata(
        input_tokens=usage["prompt_tokens"],
        output_tokens=usage["completion_tokens"],
        total_tokens=usage["total_tokens"],
        # The prompt's tokens whose KV came from the prompt cache, as LangChain names a cache read.
        input_token_details={"cache_read": usage["prompt_tokens_details"]["cached_tokens"]},
    )


def _chat_messages(messages: Sequence[BaseMessage]) -> list[dict]:
    """LangChain messages as the chat template's dicts ({"role", "content"}, an AI message's
    "tool_calls", a tool message's "tool_call_id"); what it cannot render is refused (the history
    itself is checked where every entrance's is, in the prompt builder)."""
    return [_chat_message(m) for m in messages]


def _chat_message(message: BaseMessage) -> dict:
    out = {"role": _role(message), "content": _text(message)}
    if isinstance(message, AIMessage) and message.tool_calls:
        # OpenAI's shape with the arguments as an object, as Hugging Face chat templates take them.
        out["tool_calls"] = [
            {"type": "function", "id": call["id"], "function": {"name": call["name"], "arguments": call["args"]}}
            for call in message.tool_calls
        ]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
    return out


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    # By class, so that chunks (an aggregated stream's AIMessageChunk) count as their messages.
    for kind, role in _ROLES.items():
        if isinstance(message, kind):
            return role
    raise ValueError(f"ChatSpeculativeHF supports system, human, AI and tool messages, not {type(message).__name__}")


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block["text"])
        elif isinstance(message, AIMessage) and block.get("type") in _CALL_BLOCKS:
            continue  # the same calls as message.tool_calls, rendered from there
        else:
            raise ValueError(f"ChatSpeculativeHF supports text content only, got a {block.get('type')!r} block")
    return "".join(parts)
