"""`SpeculativeHFLLM`: a LlamaIndex LLM on the speculative engine (in place of `HuggingFaceLLM`), with
function calling through the model's chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt
from llama_index.core.prompts import BasePromptTemplate, SelectorPromptTemplate
from llama_index.core.tools.types import BaseTool
from llama_index.core.types import TokenAsyncGen, TokenGen
from pydantic import ConfigDict, Field, PrivateAttr

from rag_speculate import GenerationResult, GenerationStream, SpeculativeEngine
from rag_speculate.devices import device_from_map, resolve_device
from rag_speculate.entrypoints.engines import DTYPES, shared_engine
from rag_speculate.entrypoints.prompt import Prepared, check_call_arguments, chosen_tool, prepare

from .documents import current_documents, drafter_documents, drafting_for_query
from .tools import TOOL_CALL_ERROR, TOOL_CALLS, message_tool_calls, openai_tools, parsed_message_kwargs, tool_selections

# What a caller may pass per call to complete/chat and their stream/async variants.
CALL_ARGUMENTS = ("max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "documents")
# ... and what chat and its variants take besides: LlamaIndex tools or OpenAI-format tool dicts, and
# which of them to call ("auto", "none", "required" or a tool's name).
CHAT_ARGUMENTS = (*CALL_ARGUMENTS, "tools", "tool_choice")
_ROLES = (MessageRole.SYSTEM, MessageRole.USER, MessageRole.ASSISTANT)
_TOOL_ROLES = (MessageRole.TOOL, MessageRole.FUNCTION)
_LOADING = ("dtype", "device", "device_map", "draft_budget", "prompt_cache_dir", "prompt_cache_disk_bytes", "quantization")


class SpeculativeHFLLM(FunctionCallingLLM):
    """A local Hugging Face model as a LlamaIndex LLM, accelerated by lossless speculative decoding.

    Prompts go through the model's chat template, streaming or not (`complete(..., formatted=True)`
    sends the text as it is; `completion_to_prompt` / `messages_to_prompt`, when given, replace the
    template). The drafters draft from the prompt, and from the retrieved nodes when the query engine
    has a `DraftDocumentsPostprocessor` or a call passes `documents=`.

    A `FunctionCallingLLM` when the model's chat template renders tools: `chat_with_tools`,
    `FunctionAgent`, `structured_predict` and `as_structured_llm` work through the template's own tool
    format, and `get_tool_calls_from_response` reads the calls the model wrote.

        llm = SpeculativeHFLLM("qwen2.5-coder-1.5b-instruct", max_new_tokens=128)
        index.as_query_engine(llm=llm, streaming=True, node_postprocessors=[DraftDocumentsPostprocessor()])
    """

    # Unknown settings are rejected: a mistyped one would otherwise be silently ignored.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_name: str = Field(description="Packaged model name, .gguf file, local folder or Hugging Face id.")
    dtype: str = Field(default="auto", description=f"One of {', '.join(DTYPES)}.")
    device_map: str = Field(default="auto", description='As HuggingFaceLLM takes it, for one device: "auto" (CUDA when available, else the CPU), "cuda:0", "cpu".')
    device: str | None = Field(default=None, description='"cpu", "cuda", "cuda:N" or "mps"; None: as device_map says.')
    draft_budget: int | None = Field(default=None, description="Draft nodes verified per forward (0: no speculation).")
    prompt_cache_dir: str | None = Field(default=None, description="A folder for the prompt cache's disk tier, shared by every process naming it (None: memory only).")
    prompt_cache_disk_bytes: int | None = Field(default=None, description="What prompt_cache_dir may hold, in bytes (None: 8 GiB).")
    quantization: Literal["int8", "int4", "gguf"] | None = Field(default=None, description='The linear layers as int8 or 4-bit weights, or a GGUF file\'s own quantized tensors, on the CPU (None: as loaded).')
    max_new_tokens: int = Field(default=256, ge=1, description="Tokens generated at most (the metadata's num_output).")
    temperature: float = Field(default=0.0, ge=0.0, description="0 decodes greedily.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k.")
    seed: int | None = Field(default=None)
    stop: list[str] | None = Field(default=None, description="Strings that end generation (never emitted).")

    _engine: SpeculativeEngine = PrivateAttr()

    def __init__(self, model_name: str | None = None, *, engine: SpeculativeEngine | None = None, **kwargs: Any):
        """Load `model_name` (or reuse the engine this process loaded with the same settings), or wrap
        `engine`, already loaded, to share one model between several LlamaIndex and LangChain objects."""
        if engine is None:
            if model_name is None:
                raise ValueError(
                    "pass model_name (a packaged model name, .gguf file, folder or Hugging Face id) or engine="
                )
            super().__init__(model_name=model_name, **kwargs)
            self.device = str(resolve_device(device_from_map(self.device_map, self.device)))
            self._engine = shared_engine(
                model_name, dtype=self.dtype, device=self.device, draft_budget=self.draft_budget,
                prompt_cache_dir=self.prompt_cache_dir, prompt_cache_disk_bytes=self.prompt_cache_disk_bytes,
                quantization=self.quantization,
            )  # fmt: skip
            return
        loading = sorted(set(_LOADING) & set(kwargs))
        if loading:
            raise ValueError(f"{', '.join(loading)} configure loading a model: they cannot be combined with engine=")
        super().__init__(
            model_name=model_name or engine.name,
            dtype=str(engine.model.dtype).removeprefix("torch."),
            device=str(engine.model.device),
            draft_budget=engine.draft_budget,
            **kwargs,
        )
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "SpeculativeHFLLM"

    @property
    def engine(self) -> SpeculativeEngine:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._engine.traits.max_positions or DEFAULT_CONTEXT_WINDOW,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=self._renders_tools(),
            model_name=self.model_name,
        )

    def _renders_tools(self) -> bool:
        """Whether tools reach the model: its chat template renders them (the engine's test), and no
        `messages_to_prompt` of the caller's replaces that template. Otherwise LlamaIndex falls back to
        its text-only paths (`structured_predict` parses JSON from a completion)."""
        return self.messages_to_prompt is generic_messages_to_prompt and "tools" in (
            self._engine.tokenizer.chat_template or ""
        )

    # --- what query engines call: the query being answered says which retrieved nodes to draft from

    def predict(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        with drafting_for_query(self._query(prompt, prompt_args)):
            return super().predict(prompt, **prompt_args)

    def stream(self, prompt: BasePromptTemplate, **prompt_args: Any) -> TokenGen:
        # The generation starts (and takes its documents) inside this call; only the tokens come later.
        with drafting_for_query(self._query(prompt, prompt_args)):
            return super().stream(prompt, **prompt_args)

    async def apredict(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        with drafting_for_query(self._query(prompt, prompt_args)):
            return await super().apredict(prompt, **prompt_args)

    async def astream(self, prompt: BasePromptTemplate, **prompt_args: Any) -> TokenAsyncGen:
        with drafting_for_query(self._query(prompt, prompt_args)):
            return await super().astream(prompt, **prompt_args)

    def _query(self, prompt: BasePromptTemplate, prompt_args: dict[str, Any]) -> str | None:
        """The `query_str` a synthesizer answers: among the arguments, or (as most synthesizers do it)
        already filled into the template."""
        template = prompt.select(llm=self) if isinstance(prompt, SelectorPromptTemplate) else prompt
        return prompt_args.get("query_str", template.kwargs.get("query_str"))

    # --- completion ----------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._response(self._start_completion(prompt, formatted, kwargs).collect())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._responses(self._start_completion(prompt, formatted, kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._response(await self._start_completion(prompt, formatted, kwargs).acollect())

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return self._aresponses(self._start_completion(prompt, formatted, kwargs))

    # --- chat ----------------------------------------------------------------------------

    # `tools=` (LlamaIndex tools or OpenAI-format dicts) reach the chat template; the answer's calls are
    # then parsed into the last response's message.additional_kwargs["tool_calls"].

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        stream, tools = self._start_chat(messages, kwargs)
        return _chat_response(self._response(stream.collect()), tools)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream, tools = self._start_chat(messages, kwargs)
        return (_chat_response(r, tools) for r in self._responses(stream))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        stream, tools = self._start_chat(messages, kwargs)
        return _chat_response(self._response(await stream.acollect()), tools)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        stream, tools = self._start_chat(messages, kwargs)
        return (_chat_response(r, tools) async for r in self._aresponses(stream))

    # --- function calling (chat_with_tools and its variants, FunctionAgent, structured_predict) ----

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The chat arguments for a call offering `tools`. Nothing constrains the decoding (the answer
        stays the model's own), so `tool_required=True` and a `tool_choice` naming a tool (or
        "required") become an instruction to answer with a call, which the prompt builder places as it
        does for every entrance; `tool_choice="none"` leaves the tools out of the prompt."""
        checked = openai_tools(tools) or []
        messages = list(chat_history or [])
        if user_msg is not None:
            if isinstance(user_msg, str):
                user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
            messages.append(user_msg)
        choice = chosen_tool(tool_choice, checked)
        if choice == "none":
            return {"messages": messages, **kwargs}
        if not checked:
            if tool_required or choice == "required":
                raise ValueError("tool_required=True (or tool_choice='required') needs at least one tool")
            return {"messages": messages, **kwargs}
        if tool_required and choice == "auto":
            choice = "required"
        return {"messages": messages, "tools": checked, "tool_choice": choice, **kwargs}

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        """Without parallel calls only the first call the model wrote is kept (as OpenAI's adapter does)."""
        calls = response.message.additional_kwargs.get(TOOL_CALLS)
        if not allow_parallel_tool_calls and calls and len(calls) > 1:
            response.message.additional_kwargs[TOOL_CALLS] = calls[:1]
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The calls in `response.message` (`additional_kwargs["tool_calls"]`, or `ToolCallBlock`s), in
        the order the model wrote them; none raises `ValueError` with the reason, unless
        `error_on_no_tool_call=False`."""
        selections = tool_selections(response.message)
        if not selections and error_on_no_tool_call:
            reason = response.message.additional_kwargs.get(TOOL_CALL_ERROR)
            raise ValueError(
                "the model answered without a tool call"
                + (f": {reason}" if reason else f": {(response.message.content or '')[:200]!r}")
            )
        return selections

    # --- starting a generation: everything is checked here, before any streaming starts ----

    def _start_completion(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> GenerationStream:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
        if formatted:
            return self._start(prompt, False, kwargs)
        if self.completion_to_prompt is not default_completion_to_prompt:
            return self._start(self.completion_to_prompt(prompt), False, kwargs)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return self._start([*system, {"role": "user", "content": prompt}], True, kwargs)

    def _start_chat(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> tuple[GenerationStream, list[dict] | None]:
        """The generation, and the tools it offers the model (None: none, so nothing is parsed)."""
        check_call_arguments("SpeculativeHFLLM", kwargs, CHAT_ARGUMENTS)
        kwargs = dict(kwargs)
        tools = openai_tools(kwargs.pop("tools", None))
        tool_choice = kwargs.pop("tool_choice", None)
        chat = _chat_messages(messages)
        if self.messages_to_prompt is not generic_messages_to_prompt:
            if tools:
                raise ValueError(
                    "tools reach the model through its chat template, which this LLM's messages_to_prompt replaces"
                )
            return self._start(self.messages_to_prompt(messages), False, kwargs), None
        stream, prepared = self._start_prepared(chat, True, kwargs, tools=tools, tool_choice=tool_choice)
        return stream, prepared.tools

    def _start(self, prompt: str | list[dict], chat: bool, kwargs: dict[str, Any]) -> GenerationStream:
        return self._start_prepared(prompt, chat, kwargs)[0]

    def _start_prepared(
        self, prompt: str | list[dict], chat: bool, kwargs: dict[str, Any], **tooling: Any
    ) -> tuple[GenerationStream, Prepared]:
        """The generation through the one prompt builder, with the settings and this call's arguments."""
        check_call_arguments("SpeculativeHFLLM", kwargs, CALL_ARGUMENTS)
        documents = kwargs.get("documents")
        prepared = prepare(
            self._engine,
            prompt,
            chat=chat,
            documents=current_documents() if documents is None else drafter_documents(documents),
            max_new_tokens=kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens)),
            temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p),
            top_k=kwargs.get("top_k", self.top_k),
            seed=kwargs.get("seed", self.seed),
            stop=kwargs.get("stop", self.stop),
            **tooling,
        )
        return self._engine.stream_request(prepared.request), prepared

    # --- responses -----------------------------------------------------------------------

    def _response(self, result: GenerationResult, delta: str | None = None) -> CompletionResponse:
        """The whole answer; its `raw["usage"]` is what TokenCountingHandler counts, streamed or not."""
        return CompletionResponse(
            text=result.text,
            delta=delta,
            raw={"model": self.model_name, "usage": result.stats.usage()},
            additional_kwargs={"finish_reason": result.finish_reason, "speculative_stats": result.stats.as_dict()},
        )

    def _responses(self, stream: GenerationStream) -> Iterator[CompletionResponse]:
        text = ""
        try:
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
        finally:
            stream.close()  # a consumer that stops early frees the engine at once
        # The last response carries the usage and stats: the callbacks read them from the last one.
        yield self._response(stream.result, delta="")

    async def _aresponses(self, stream: GenerationStream) -> AsyncIterator[CompletionResponse]:
        text = ""
        async for delta in stream:
            text += delta
            yield CompletionResponse(text=text, delta=delta)
        yield self._response(stream.result, delta="")


def _chat_response(response: CompletionResponse, tools: list[dict] | None = None) -> ChatResponse:
    """A chat response; when the model was offered tools, the last one (the whole answer, with its usage)
    carries the calls the model wrote in `message.additional_kwargs["tool_calls"]` and the text around
    them as its content, and `raw["text"]` keeps the answer as written."""
    content, message_kwargs, raw = response.text, {}, response.raw
    if tools and response.raw is not None:
        content, message_kwargs = parsed_message_kwargs(response.text)
        raw = {**response.raw, "text": response.text}
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=content, additional_kwargs=message_kwargs),
        delta=response.delta,
        raw=raw,
        additional_kwargs=response.additional_kwargs,
    )


def _chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex messages as the chat template's dicts: {"role", "content"}, tool results as {"role":
    "tool", "content", "tool_call_id"}, assistant turns that called tools with their "tool_calls"; what
    the template cannot render is refused (the history itself is checked where every entrance's is, in
    the prompt builder)."""
    out = []
    for message in messages:
        if message.role not in (*_ROLES, *_TOOL_ROLES):
            raise ValueError(
                f"SpeculativeHFLLM supports system, user, assistant and tool messages, not {message.role.value!r}"
            )
        allowed = (TextBlock, ToolCallBlock) if message.role == MessageRole.ASSISTANT else TextBlock
        if not all(isinstance(block, allowed) for block in message.blocks):
            raise ValueError("SpeculativeHFLLM supports text content only")
        entry: dict[str, Any] = {"role": message.role.value, "content": message.content or ""}
        if message.role in _TOOL_ROLES:
            entry["role"] = "tool"
            for key in ("tool_call_id", "name"):
                if isinstance(message.additional_kwargs.get(key), str):
                    entry[key] = message.additional_kwargs[key]
        elif message.role == MessageRole.ASSISTANT:
            calls = message_tool_calls(message)
            if calls:
                entry["tool_calls"] = calls
        out.append(entry)
    return out
