"""What a request asks of the answer that only the prompt can ask for: a tool call, a JSON answer.

Nothing constrains decoding (the output stays exactly the model's own, the point of a lossless
decoder), so `tool_choice` and `response_format` act through the chat template's tools and an
instruction in the messages; what they cannot make the model do, nothing forces. The server and
both framework adapters read them through these functions.

    >>> weather = {"type": "function", "function": {"name": "weather"}}
    >>> template_tools([weather], chosen_tool({"type": "function", "function": {"name": "weather"}}, [weather]))[1]
    'Answer by calling the tool weather with arguments that fit the request, not with text.'
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidArgumentError


def chosen_tool(tool_choice: Any, tools: Sequence[dict]) -> str:
    """`tool_choice` as "auto", "none", "required" or the name of the one tool to call, from OpenAI's,
    LangChain's or LlamaIndex's spellings: a string ("any" for "required", or a tool's name),
    {"type": "function", "function": {"name": ...}} or {"name": ...}; refused naming what is wrong."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return tool_choice or "auto"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function", tool_choice)
        name = function.get("name") if isinstance(function, dict) else None
    elif isinstance(tool_choice, str):
        name = "required" if tool_choice in ("required", "any") else tool_choice
    else:
        name = None
    if not isinstance(name, str):
        raise InvalidArgumentError(
            "tool_choice must be 'auto', 'none', 'required', a tool's name or "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}'
        )
    names = [tool["function"]["name"] for tool in tools]
    if not names:
        raise InvalidArgumentError(f"tool_choice={tool_choice!r} needs tools")
    if name != "required" and name not in names:
        raise InvalidArgumentError(f"tool_choice names the tool {name!r}, which is not among the tools: {', '.join(names)}")
    return name


def template_tools(tools: Sequence[dict] | None, choice: str) -> tuple[list[dict] | None, str | None]:
    """The tools the chat template gets and the instruction the answered turn gets, for a choice.

    "none" drops the tools, "auto" passes them all, "required" passes them all and asks for a call,
    a name passes only that tool and asks for a call to it. The request goes at the end of the turn
    the model answers: in the system message, Qwen2.5-Coder-1.5B ignored it where the question did
    not call for a tool ("Hello!" with a tool forced by name), and called the tool asked for from there.
    """
    if not tools or choice == "none":
        return None, None
    if choice == "auto":
        return list(tools), None
    if choice == "required":
        names = ", ".join(tool["function"]["name"] for tool in tools)
        return list(tools), f"Answer by calling one of the tools ({names}) with arguments that fit the request, not with text."
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
        raise InvalidArgumentError(
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
