"""Tool calling: the tools a chat template is given, and the calls a model's answer makes.

Models write a call in one of a few shapes: Hermes and Qwen templates ask for
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one tag per call); small models often
answer with the same JSON object bare or in a fenced block. `parse_tool_calls` reads all three and
returns the calls and the text around them; text that looks like a call but is not valid JSON comes
back as content, with the reason.

    >>> parse_tool_calls('<tool_call>\\n{"name": "search", "arguments": {"query": "warranty"}}\\n</tool_call>').calls
    [ToolCall(name='search', arguments={'query': 'warranty'}, id='call_0')]
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgumentError
from ..files.schema import too_deep

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCED = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)
# Where a call written without tags begins: a JSON object whose first key is "name". Some templates
# (the packaged Qwen2.5-Coder's) show the format with doubled braces, as in a Python format string,
# and models copy them: `{{"name": ..., "arguments": {...}}}`.
_BARE = re.compile(r'\{\{?\s*"name"')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str


@dataclass(frozen=True)
class ParsedToolCalls:
    calls: list[ToolCall] = field(default_factory=list)
    # The answer's text without the calls.
    content: str = ""
    # Why text that looked like a call was not parsed as one ("" when nothing went wrong).
    error: str = ""


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """The tool calls in a model's answer, in the order written, and the text around them."""
    tagged = _TAGGED.findall(text)
    if tagged:
        return _calls(tagged, _TAGGED.sub("", text).strip(), text)
    fenced = _FENCED.findall(text)
    if fenced and all(_BARE.match(body) for body in fenced):
        return _calls(fenced, _FENCED.sub("", text).strip(), text)
    bodies, rest, position = [], [], 0
    for match in _BARE.finditer(text):
        if match.start() < position:
            continue
        end = _object_end(text, match.start())
        if end is None:
            return ParsedToolCalls(content=text, error=f"tool call {len(bodies)} is not valid JSON")
        bodies.append(text[match.start() : end])
        rest.append(text[position : match.start()])
        position = end
    if not bodies:
        return ParsedToolCalls(content=text)
    rest.append(text[position:])
    return _calls(bodies, "".join(rest).strip(), text)


# What a streamed answer may still turn into a call as more text arrives: a tag, a fence opening a
# JSON object (or that could, once its language name is complete), an object whose first key is "name".
_TAG = "<tool_call>"
_FENCE = "```"
_LIVE_FENCE = re.compile(r"```(?:json)?\s*\{")
_OPENING_FENCE = re.compile(r"```(?:\s*|j|js|jso|json\s*)")
_NAME_KEY = '"name"'


def may_start_call(text: str, position: int) -> bool:
    """Whether a call `parse_tool_calls` reads may begin at `position` of an answer still being
    written (text from there is to be held back from a stream until the answer is whole)."""
    rest = text[position:]
    if rest[0] == "<":
        return rest.startswith(_TAG) or _TAG.startswith(rest)
    if rest[0] == "`":
        if not rest.startswith(_FENCE):
            return _FENCE.startswith(rest)
        return bool(_LIVE_FENCE.match(rest) or _OPENING_FENCE.fullmatch(rest))
    if rest[0] == "{":
        key = (rest[2:] if rest.startswith("{{") else rest[1:]).lstrip()
        return key.startswith(_NAME_KEY) or _NAME_KEY.startswith(key)
    return False


def _object_end(text: str, start: int) -> int | None:
    """Where the JSON object at `start` ends, past any closing braces a doubled opening one brought."""
    doubled = text.startswith("{{", start)
    try:
        _, end = json.JSONDecoder().raw_decode(text, start + doubled)
    except json.JSONDecodeError:
        return None
    while doubled and end < len(text) and text[end] == "}":
        end += 1
    return end


def _calls(bodies: Sequence[str], rest: str, text: str) -> ParsedToolCalls:
    calls = []
    for i, body in enumerate(bodies):
        body = body.strip()
        try:
            call, end = json.JSONDecoder().raw_decode(body, 1 if body.startswith("{{") else 0)
            if body[end:].strip().strip("}"):
                raise json.JSONDecodeError("text after the call", body, end)
        except json.JSONDecodeError as exc:
            return ParsedToolCalls(content=text, error=f"tool call {i} is not valid JSON: {exc.msg} at character {exc.pos}")
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            return ParsedToolCalls(content=text, error=f"tool call {i} needs a string 'name' and an object 'arguments'")
        calls.append(ToolCall(call["name"], arguments, f"call_{i}"))
    return ParsedToolCalls(calls, rest)


# The deepest JSON a request may nest: parsing it, chat templates and transformers' message conversion
# all recurse once (or more) per level, and Python's recursion limit is shared with their callers.
MAX_NESTING = 64


def unencodable(value: Any) -> tuple[list[str | int], str] | None:
    """Text in JSON data `value` (its strings and its objects' keys) that is not valid Unicode: the
    keys and indexes that lead to it (a bad key last, escaped) and why; None if there is none. A lone
    surrogate is such text: JSON's \\ud800 escape writes one, and no UTF-8 encoder, chat template or
    tokenizer can read it, so it is refused before anything else reads the data."""
    stack: list[tuple[list[str | int], Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str) and (error := _encoding_error(item)):
            return path, f"{error.reason} at position {error.start}"
        if isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and (error := _encoding_error(key)):
                    escaped = key.encode(errors="backslashreplace").decode()
                    return [*path, escaped], f"{error.reason} at position {error.start} of the key"
            stack.extend(([*path, key], inner) for key, inner in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(([*path, i], inner) for i, inner in reversed(list(enumerate(item))))
    return None


def _encoding_error(text: str) -> UnicodeEncodeError | None:
    try:
        text.encode()
    except UnicodeEncodeError as error:
        return error
    return None


def template_tool_call(call_id: Any, name: Any, arguments: Any, where: str) -> dict:
    """A call an assistant turn made, in the shape chat templates render: {"id", "type": "function",
    "function": {"name", "arguments": {...}}}. OpenAI's API carries the arguments as a JSON string,
    which a template would print quoted: they are read back into an object here. `where` names the
    call ("messages.1.tool_calls.0"); an `InvalidArgumentError` names the field at fault under it
    (`.argument`: "messages.1.tool_calls.0.function.arguments")."""
    field_ = f"{where}.function.arguments"
    if isinstance(arguments, str):
        _check_unicode(arguments, field_)  # before the nesting scan and the parser, which encode it
        if too_deep(arguments, MAX_NESTING):
            raise InvalidArgumentError(
                f"{where} ({name!r}) has arguments nested more than {MAX_NESTING} levels deep", field_
            )
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:  # a JSONDecodeError, or a number too long to read
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else exc
            raise InvalidArgumentError(
                f"{where} ({name!r}) has arguments that are not valid JSON: {reason}", field_
            ) from None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise InvalidArgumentError(
            f"{where} needs a string name and an object of arguments, got {name!r} and {arguments!r}",
            f"{where}.function",
        )
    _check_unicode(name, f"{where}.function.name")
    _check_unicode(arguments, field_)  # as parsed: its escapes may write a lone surrogate
    _check_unicode(call_id, f"{where}.id")
    return {"id": call_id or where, "type": "function", "function": {"name": name, "arguments": arguments}}


def _check_unicode(value: Any, field_: str) -> None:
    found = unencodable(value)
    if found is not None:
        path, reason = found
        inside = f" at {'.'.join(map(str, path))}" if path else ""
        raise InvalidArgumentError(f"{field_} is not valid Unicode text{inside} ({reason})", field_)


def call_id_prefix(messages: list[dict], text: str) -> str:
    """Call ids that are the same for the same prompt and answer (invoke and stream agree; greedy
    answers repeat) and differ between turns of a conversation."""
    digest = hashlib.sha1(json.dumps([messages, text], ensure_ascii=False, sort_keys=True, default=str).encode())
    return f"call_{digest.hexdigest()[:16]}"


class HeldText:
    """Streams an answer that may contain tool calls: text is emitted once nothing after it can turn
    it into part of a call; what could is held back to the end, when the whole answer is parsed.

    Everything emitted is a prefix of the content `parse_tool_calls` leaves, so the streamed content
    adds up to invoke's. Held: an answer that starts with whitespace, whole; elsewhere, from where a
    call may begin on (a "<tool_call>" tag, a fence opening a JSON object, a JSON object whose first
    key is "name", with doubled braces too), and the whitespace before it.
    """

    def __init__(self) -> None:
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> str:
        """The new text that is safe to emit now."""
        self.text += delta
        safe = self._safe_length()
        if safe <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted : safe], safe
        return out

    def finish(self, content: str) -> str:
        """The rest of the final content, after what was emitted."""
        return content[self.emitted :]

    def _safe_length(self) -> int:
        text = self.text
        if not text or text[0].isspace():
            return 0
        # What was emitted held no possible call start when it was, and a start ruled out stays ruled out.
        for p in range(self.emitted, len(text)):
            if may_start_call(text, p):
                return len(text[:p].rstrip())
        return len(text.rstrip())
