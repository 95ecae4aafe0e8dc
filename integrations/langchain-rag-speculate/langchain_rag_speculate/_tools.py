"""Tool calling and JSON answers for `ChatSpeculativeHF`: the tools and `tool_choice` a call binds, the
instructions they add to the prompt, and the calls read back out of the answer (streamed or not).

There is no constrained decoding: the output stays exactly the model's own (the point of a lossless
decoder), so what a template and an instruction cannot make the model do, nothing forces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import InvalidToolCall, ToolCall, ToolCallChunk
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.utils.function_calling import convert_to_openai_tool

from rag_speculate.decoding.tool_calls import ParsedToolCalls, call_id_prefix, check_tools, parse_tool_calls

# The per-call arguments of the chat model beyond the shared ones.
TOOL_ARGUMENTS = ("tools", "tool_choice", "response_format")
# tool_choice, besides a tool's name or {"type": "function", "function": {"name": ...}}.
TOOL_CHOICES = ("auto", "none", "any", "required")


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


def chosen_tool(tool_choice: Any, tools: Sequence[dict]) -> str:
    """`tool_choice` as "auto", "none", "any", or the name of the one tool to call; refused naming
    what is wrong (an unknown tool, a choice without tools)."""
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice == "none":
        return "none"
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
    elif isinstance(tool_choice, str):
        name = "any" if tool_choice in ("any", "required") else tool_choice
    else:
        name = None
    if not isinstance(name, str):
        raise ValueError(
            f"tool_choice must be one of {', '.join(map(repr, TOOL_CHOICES))}, a tool's name or "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}'
        )
    names = [tool["function"]["name"] for tool in tools]
    if not names:
        raise ValueError(f"tool_choice={tool_choice!r} needs tools: bind some with bind_tools")
    if name != "any" and name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
    return name


def template_tools(tools: Sequence[dict] | None, choice: str) -> tuple[list[dict] | None, str | None]:
    """The tools the chat template gets and the instruction the answered turn gets, for a choice.

    Nothing constrains decoding, so a choice acts through the prompt only: "none" drops the tools,
    "auto" passes them all, "any" passes them all and asks for a call, a name passes only that tool
    and asks for a call to it. The request goes at the end of the turn the model answers: in the
    system message, Qwen2.5-Coder-1.5B ignored it where the question did not call for a tool
    ("Hello!" with a tool forced by name), and called the tool asked for from there.
    """
    if not tools or choice == "none":
        return None, None
    if choice == "auto":
        return list(tools), None
    if choice == "any":
        names = ", ".join(tool["function"]["name"] for tool in tools)
        return list(tools), (
            f"Answer by calling one of the tools ({names}) with arguments that fit the request, not with text."
        )
    return [tool for tool in tools if tool["function"]["name"] == choice], (
        f"Answer by calling the tool {choice} with arguments that fit the request, not with text."
    )


def json_instruction(response_format: Any) -> str | None:
    """The system instruction for an OpenAI-style `response_format`: {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} ({"type": "text"}: none)."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "Answer with one JSON object and nothing else."
    schema = (response_format.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    if not isinstance(schema, dict):
        raise ValueError(
            'response_format must be {"type": "json_object"}, {"type": "text"} or {"type": "json_schema", '
            f'"json_schema": {{"name": ..., "schema": {{...}}}}}}, got {response_format!r}'
        )
    schema_text = json.dumps(schema, ensure_ascii=False)
    return f"Answer with one JSON object that follows this JSON schema, and nothing else:\n{schema_text}"


def with_instructions(messages: list[dict], *, system: str | None = None, last: str | None = None) -> list[dict]:
    """The messages with `system` at the end of the first system message (one is added at the start
    when there is none: templates take a system message first, not anywhere) and `last` at the end
    of the turn the model answers."""
    out = list(messages)
    if system:
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system}
        else:
            out.insert(0, {"role": "system", "content": system})
    if last:
        out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{last}"}
    return out


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
