"""The one prompt builder: a request's messages, tools, tool choice, response format and retrieved
chunks become the model's prompt here, for the server, both framework adapters and the command line
alike, so one request gives one prompt whichever entrance it comes in by.

Nothing constrains decoding (the output stays exactly the model's own, the point of a lossless
decoder), so `tool_choice` and `response_format` act through the chat template's tools and an
instruction in the messages; what they cannot make the model do, nothing forces. Retrieved chunks go
into the last user turn, numbered so that answers can cite them, and to the drafters as documents.

    >>> prepared = prepare(engine, [{"role": "user", "content": "Who wrote Hamlet?"}], chunks=index.search(q, 3),
    ...                    max_new_tokens=64)
    >>> engine.stream_request(prepared.request)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..decoding.request import Request
from ..engine import SpeculativeEngine
from ..engine.inputs import Document, Prompt, check_documents, check_tools
from ..errors import InvalidArgumentError
from ..retrieval.documents import Chunk

RAG_SYSTEM_PROMPT = "Answer the question using the passages."
# What `tool_choice` asks of the answer, when it asks for a call.
CALL_ONE_OF = "Answer by calling one of the tools ({names}) with arguments that fit the request, not with text."
CALL_THIS = "Answer by calling the tool {name} with arguments that fit the request, not with text."


@dataclass(frozen=True)
class Prepared:
    """A request as the engine runs it, and what reading its answer needs."""

    request: Request
    # The conversation as the chat template rendered it (instructions and passages in place); [] for a text prompt.
    messages: list[dict] = field(default_factory=list)
    # The tools the template was given: an answer is read for tool calls when there are any.
    tools: list[dict] | None = None
    # The retrieved chunks the prompt holds.
    sources: list[Chunk] = field(default_factory=list)


def prepare(
    engine: SpeculativeEngine,
    prompt: Prompt,
    *,
    chat: bool = True,
    tools: Sequence[dict] | None = None,
    tool_choice: Any = None,
    response_format: Any = None,
    chunks: Sequence[Chunk] = (),
    documents: Sequence[Document] | None = None,
    **options: Any,
) -> Prepared:
    """`prompt` (chat messages or a question with `chat=True`, else text or token ids to complete)
    with its tools (OpenAI function format), `tool_choice` and `response_format` (OpenAI's,
    LangChain's or LlamaIndex's spellings) and retrieved `chunks` (into the last user turn), checked
    and tokenized by `engine.prepare` with `documents` and `options` (max_new_tokens, temperature, ...).
    `max_new_tokens` may be a function of the prompt's length in tokens (the room a context limit
    leaves, say), called once the prompt is built. A bad argument raises `InvalidArgumentError` naming
    it (`.argument`)."""
    if not chat:
        for name, value in (("tools", tools), ("tool_choice", tool_choice), ("response_format", response_format)):
            if value is not None:
                raise InvalidArgumentError(f"{name} reach the model through its chat template: they need a chat", name)
        if chunks:
            raise InvalidArgumentError("retrieved chunks go into a chat's last user turn: they need a chat", "chunks")
        return Prepared(engine.prepare(prompt, chat=False, documents=documents, **options))
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if messages and not all(isinstance(m, dict) for m in messages):
        raise InvalidArgumentError("a chat prompt is a question or a list of {'role', 'content'} messages", "prompt")
    drafted = documents
    if chunks:
        messages = with_passages(messages, chunks)
        # The caller's documents are checked as given, before the chunks' join them.
        drafted = [*check_documents(documents), *drafting_documents(chunks)]
    offered = check_tools(tools) if tools is not None else []
    template_tools_, call_instruction = template_tools(offered, chosen_tool(tool_choice, offered))
    messages = with_instructions(messages, system=json_instruction(response_format), last=call_instruction)
    request = engine.prepare(messages, chat=True, tools=template_tools_, documents=drafted, **options)
    return Prepared(request, messages, template_tools_, list(chunks))


def rag_messages(question: str, chunks: Sequence[Chunk]) -> list[dict[str, str]]:
    """Chat messages asking `question` over the retrieved chunks, numbered so answers can cite them."""
    return with_passages([{"role": "user", "content": question}], chunks)


def with_passages(messages: list[dict], chunks: Sequence[Chunk]) -> list[dict]:
    """The conversation with its last user turn asking over `chunks`, and the RAG system prompt first
    where the conversation has no system message of its own."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise InvalidArgumentError("retrieved passages go into a user turn, and the chat has none", "messages")
    last = users[-1]
    passages = "\n\n".join(f"[{i}] {c.title}\n{c.text}" if c.title else f"[{i}] {c.text}" for i, c in enumerate(chunks, 1))
    asked = {**messages[last], "content": f"Passages:\n{passages}\n\nQuestion: {messages[last]['content']}"}
    out = [*messages[:last], asked, *messages[last + 1 :]]
    return out if out[0].get("role") == "system" else [{"role": "system", "content": RAG_SYSTEM_PROMPT}, *out]


def drafting_documents(chunks: Sequence[Chunk]) -> list[list[int]]:
    """The chunks' token ids, for `SpeculativeEngine.generate(documents=...)`: nothing to tokenize."""
    return [c.token_ids for c in chunks]


def check_call_arguments(owner: str, kwargs: dict, allowed: tuple[str, ...]) -> None:
    """Reject per-call arguments an adapter would otherwise silently ignore, naming them."""
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(
            f"{owner} got unsupported argument(s) {', '.join(map(repr, unknown))}; "
            f"per-call arguments are {', '.join(allowed)}"
        )
    if "max_tokens" in kwargs and "max_new_tokens" in kwargs:
        raise TypeError("pass max_new_tokens or its alias max_tokens, not both")


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
            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}',
            "tool_choice",
        )
    names = [tool["function"]["name"] for tool in tools]
    if not names:
        raise InvalidArgumentError(f"tool_choice={tool_choice!r} needs tools", "tool_choice")
    if name != "required" and name not in names:
        raise InvalidArgumentError(
            f"tool_choice names the tool {name!r}, which is not among the tools: {', '.join(names)}", "tool_choice"
        )
    return name


def template_tools(tools: Sequence[dict] | None, choice: str) -> tuple[list[dict] | None, str | None]:
    """The tools the chat template gets and the instruction the answered turn gets, for a choice.

    "none" drops the tools, "auto" passes them all, "required" passes them all and asks for a call,
    a name passes only that tool and asks for a call to it. The request goes at the end of the turn
    the model answers, where a small model heeds it even when the question itself calls for no tool.
    """
    if not tools or choice == "none":
        return None, None
    if choice == "auto":
        return list(tools), None
    if choice == "required":
        return list(tools), CALL_ONE_OF.format(names=", ".join(tool["function"]["name"] for tool in tools))
    return [tool for tool in tools if tool["function"]["name"] == choice], CALL_THIS.format(name=choice)


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
    json_schema = response_format.get("json_schema") if kind == "json_schema" else None
    schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
    if not isinstance(schema, dict):
        raise InvalidArgumentError(
            'response_format must be {"type": "json_object"}, {"type": "text"} or {"type": "json_schema", '
            f'"json_schema": {{"name": ..., "schema": {{...}}}}}}, got {response_format!r}',
            "response_format",
        )
    schema_text = json.dumps(schema, ensure_ascii=False)
    return f"Answer with one JSON object that follows this JSON schema, and nothing else:\n{schema_text}"


def with_instructions(messages: list[dict], *, system: str | None = None, last: str | None = None) -> list[dict]:
    """The messages with `system` at the end of the first system message (one is added at the start
    when there is none: templates take a system message first, not anywhere) and `last` at the end
    of the user turn the model answers, or of the system message where it answers a tool's result
    (which stays as the tool returned it). The caller's messages are not modified."""
    out = list(messages)
    if last and out and out[-1]["role"] == "user":
        out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{last}"}
    else:
        system = "\n\n".join(part for part in (system, last) if part)
    if system:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out
