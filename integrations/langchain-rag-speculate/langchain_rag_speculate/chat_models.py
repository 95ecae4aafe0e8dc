"""`ChatSpeculativeHF`: a LangChain chat model on the speculative engine (in place of `ChatHuggingFace`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage, UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from rag_speculate import GenerationResult, GenerationStream
from rag_speculate.serving import acollect, aiterate, collect, token_usage

from ._common import MODEL_CONFIG, SpeculativeHFParams

_ROLES = {"system": "system", "human": "user", "ai": "assistant"}


class ChatSpeculativeHF(SpeculativeHFParams, BaseChatModel):
    """A local Hugging Face model as a LangChain chat model (its own chat template), accelerated by
    lossless speculative decoding. Text in, text out: no tool calling, structured output or images.

        chat = ChatSpeculativeHF(model="qwen2.5-coder-1.5b-instruct", max_tokens=128)
        chat.invoke([("system", "Answer briefly."), ("human", "Who wrote Hamlet?")])

    Documents reach the drafters as with `SpeculativeHFLLM`: from the prompt, or `bind(documents=...)`.
    """

    model_config = MODEL_CONFIG

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
        """The prompt length exactly as generation will see it: the messages in the chat template."""
        if tools:
            raise ValueError("ChatSpeculativeHF does not support tools")
        tokenizer = self.get_engine().tokenizer
        text = tokenizer.apply_chat_template(_chat_messages(messages), tokenize=False, add_generation_prompt=True)
        return len(tokenizer.encode(text, add_special_tokens=False))

    def _start(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> GenerationStream:
        return self.get_engine().stream(_chat_messages(messages), chat=True, **self._generation_kwargs(stop, kwargs))

    def _chat_result(self, result: GenerationResult) -> ChatResult:
        info = self._result_info(result)
        message = AIMessage(content=result.text, usage_metadata=_usage_metadata(result), response_metadata=info)
        generation = ChatGeneration(message=message, generation_info={"finish_reason": result.finish_reason})
        return ChatResult(
            generations=[generation], llm_output={"token_usage": info["token_usage"], "model_name": self.model}
        )

    def _last_chunk(self, result: GenerationResult) -> ChatGenerationChunk:
        """Carries the usage and stats, once per stream, so aggregating the chunks counts them once."""
        message = AIMessageChunk(
            content="",
            usage_metadata=_usage_metadata(result),
            response_metadata=self._result_info(result),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": result.finish_reason})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._chat_result(collect(self._start(messages, stop, kwargs)))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._chat_result(await acollect(self._start(messages, stop, kwargs)))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        stream = self._start(messages, stop, kwargs)
        try:
            for delta in stream:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
                if run_manager:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        finally:
            stream.close()  # a consumer that stops early frees the engine at once
        yield self._last_chunk(stream.result)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        stream = self._start(messages, stop, kwargs)
        async for delta in aiterate(stream):
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.result)


def _usage_metadata(result: GenerationResult) -> UsageMetadata:
    usage = token_usage(result.stats)
    return UsageMetadata(
        input_tokens=usage["prompt_tokens"],
        output_tokens=usage["completion_tokens"],
        total_tokens=usage["total_tokens"],
        # The prompt's tokens whose KV came from the prompt cache, as LangChain names a cache read.
        input_token_details={"cache_read": usage["prompt_tokens_details"]["cached_tokens"]},
    )


def _chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as the chat template's {"role", "content"} dicts; what it cannot render is refused."""
    if not messages:
        raise ValueError("ChatSpeculativeHF needs at least one message")
    out = [{"role": _role(m), "content": _text(m)} for m in messages]
    if out[-1]["role"] != "user":
        raise ValueError(
            f"the chat history must end with a user (human) message, not {type(messages[-1]).__name__}: "
            "the model answers the last user message"
        )
    if not out[-1]["content"].strip():
        raise ValueError("the last user message is empty")
    return out


def _role(message: BaseMessage) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    if isinstance(message, AIMessage) and message.tool_calls:
        raise ValueError(
            "ChatSpeculativeHF does not support tool calling: an AIMessage with tool_calls cannot be rendered"
        )
    role = _ROLES.get(message.type)
    if role is None:
        raise ValueError(f"ChatSpeculativeHF supports system, human and AI messages, not {type(message).__name__}")
    return role


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block["text"])
        else:
            raise ValueError(f"ChatSpeculativeHF supports text content only, got a {block.get('type')!r} block")
    return "".join(parts)
