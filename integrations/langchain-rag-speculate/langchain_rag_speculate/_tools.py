"""Tool calling for `ChatSpeculativeHF`: LangChain's tools in OpenAI's format, and the calls read back
out of the answer as LangChain's tool calls. What `tool_choice` and `response_format` add to the
prompt is the one prompt builder's (`rag_speculate.entrypoints.prompt`)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import InvalidToolCall, ToolCall, ToolCallChunk
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.utils.function_calling import convert_to_openai_tool

from rag_speculate.engine.inputs import check_tools
from rag_speculate.entrypoints.tool_calls import ParsedToolCalls, call_id_prefix, parse_tool_calls

# The per-call arguments of the chat model beyond the shared ones.
TOOL_ARGUMENTS = ("tools", "tool_choice", "response_format")


def describe(value: Any) -> str:
    """A short name for a tool or schema in an error message."""
    name = getattr(value, "name", None) or getattr(value, "__name__", None)
    if isinstance(name, str):
        return name
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def convert_tools(tools: Any) -> list[dict]:
    """LangChain tools, pydantic models, functions, TypedDicts or dicts as OpenAI function tools,
    checked now: a tool that cannot be converted or rendered is refused here, by name."""
    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of tools, got {type(tools).__name__}")
    converted = []
    for i, tool in enumerate(tools):
        try:
            converted.append(convert_to_openai_tool(tool))
        except Exception as exc:  # noqa: BLE001 - LangChain raises ValueError, TypeError, or pydantic's errors
            raise ValueError(
                f"tools[{i}] ({describe(tool)}) cannot be converted to an OpenAI function tool: {one_line(exc)}"
            ) from exc
    check_tools(converted)  # InvalidArgumentError, a ValueError
    return converted


# --- reading the calls back ------------------------------------------------------------------


class ReadCalls:
    """The tool calls in one answer, as `AIMessage` fields: the text without the calls, the calls,
    and a malformed call with the parser's reason."""

    def __init__(self, text: str, messages: list[dict]):
        self.parsed: ParsedToolCalls = parse_tool_calls(text)
        prefix = call_id_prefix(messages, text)
        self.content = self.parsed.content
        self.tool_calls: list[ToolCall] = [
            tool_call(name=call.name, args=call.arguments, id=f"{prefix}_{i}")
            for i, call in enumerate(self.parsed.calls)
        ]
        self.invalid_tool_calls: list[InvalidToolCall] = []
        if self.parsed.error:
            name = re.search(r'"name"\s*:\s*"([^"]+)"', text)
            self.invalid_tool_calls = [
                invalid_tool_call(name=name and name.group(1), args=text, id=f"{prefix}_0", error=self.parsed.error)
            ]

    def chunks(self) -> list[ToolCallChunk]:
        """The calls as streamed chunks: aggregating them gives `tool_calls` back."""
        return [
            tool_call_chunk(
                name=call["name"], args=json.dumps(call["args"], ensure_ascii=False), id=call["id"], index=i
            )
            for i, call in enumerate(self.tool_calls)
        ]
