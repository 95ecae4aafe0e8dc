"""Function calling for `SpeculativeHFLLM`: LlamaIndex tools and tool-call history in the chat template's
terms, and the calls in the model's answer as LlamaIndex reads them.

The engine renders `tools=` (OpenAI function format) and a history with {"role": "tool"} results and
assistant turns carrying "tool_calls" through the model's own chat template; nothing constrains the
decoding, so the answer is exactly the model's, and `parse_tool_calls` reads the calls back out of it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.tools.types import BaseTool

from rag_speculate import InvalidArgumentError
from rag_speculate.engine.inputs import check_tools
from rag_speculate.entrypoints.tool_calls import ParsedToolCalls, parse_tool_calls, template_tool_call

# Keys of a response message's additional_kwargs: the parsed calls, and why a call-like answer was not one.
TOOL_CALLS = "tool_calls"
TOOL_CALL_ERROR = "tool_call_error"


def openai_tools(tools: Sequence[BaseTool | dict] | None) -> list[dict] | None:
    """LlamaIndex tools (or tools already in OpenAI's function format) as the engine's `tools=`, checked.

    A LlamaIndex tool keeps its own name (not `to_openai_tool`'s sanitized one): the model must call
    the name an agent looks the tool up by. A tool the chat template could not render is refused here,
    naming it."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, dict, BaseTool)) or not isinstance(tools, Sequence):
        raise TypeError(
            f"tools must be a list of LlamaIndex tools or OpenAI-format tool dicts, got {type(tools).__name__}"
        )
    if not tools:
        return None
    converted, names = [], []
    for tool in tools:
        if isinstance(tool, BaseTool):
            openai = tool.metadata.to_openai_tool(skip_length_check=True)  # a local model has no 1,024-character limit
            openai["function"]["name"] = tool.metadata.name
            converted.append(openai)
            names.append(tool.metadata.name)
        else:
            converted.append(tool)
            function = tool.get("function") if isinstance(tool, dict) else None
            names.append(function.get("name") if isinstance(function, dict) else None)
    try:
        return check_tools(converted)
    except InvalidArgumentError as exc:
        # The engine names a tool by its position when its name is what is wrong: name it here.
        where = re.match(r"tools\[(\d+)\]", str(exc))
        if where is None or names[int(where.group(1))] is None:
            raise
        name = names[int(where.group(1))]
        raise InvalidArgumentError(f"tool {name!r} cannot be offered to the model: {exc}") from None


def tool_call_dict(call: Any, where: str) -> dict:
    """One tool call in the chat templates' shape, {"id", "type": "function", "function": {"name",
    "arguments": {...}}}, from the shapes LlamaIndex LLMs leave in a message: ours, OpenAI's (objects,
    or dicts with the arguments as a JSON string), Ollama's, a `ToolCallBlock`, a `ToolSelection`."""
    if isinstance(call, ToolCallBlock):
        call_id, name, arguments = call.tool_call_id, call.tool_name, call.tool_kwargs
    elif isinstance(call, ToolSelection):
        call_id, name, arguments = call.tool_id, call.tool_name, call.tool_kwargs
    else:
        if hasattr(call, "model_dump"):
            call = call.model_dump()
        function = call.get("function", call) if isinstance(call, dict) else None
        if hasattr(function, "model_dump"):
            function = function.model_dump()
        if not isinstance(function, dict):
            raise ValueError(f"{where} must be a tool call with a name and arguments, got {call!r}")
        call_id, name, arguments = call.get("id"), function.get("name"), function.get("arguments", {})
    return template_tool_call(call_id, name, arguments, where)


def message_tool_calls(message: ChatMessage) -> list[dict]:
    """The tool calls an assistant message made: in `additional_kwargs["tool_calls"]`, else as blocks."""
    calls = message.additional_kwargs.get(TOOL_CALLS) or [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    return [tool_call_dict(call, f"call_{i}") for i, call in enumerate(calls)]


def parsed_message_kwargs(text: str) -> tuple[str, dict]:
    """A response message's content and additional_kwargs for the model's answer `text`: the calls it
    makes under "tool_calls" (and the text around them as the content), or, when something looked like a
    call but was not one, the whole text and the reason under "tool_call_error"."""
    parsed: ParsedToolCalls = parse_tool_calls(text)
    if parsed.calls:
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls
        ]
        return parsed.content, {TOOL_CALLS: calls}
    if parsed.error:
        return text, {TOOL_CALL_ERROR: parsed.error}
    return text, {}


def tool_selections(message: ChatMessage) -> list[ToolSelection]:
    return [
        ToolSelection(tool_id=call["id"], tool_name=call["function"]["name"], tool_kwargs=call["function"]["arguments"])
        for call in message_tool_calls(message)
    ]
