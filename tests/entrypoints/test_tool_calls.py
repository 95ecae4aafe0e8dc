"""Tool calling at the engine: tools reach the chat template, calls are parsed back, output unchanged."""

from __future__ import annotations

import pytest
from conftest import char_tokenizer, hf_greedy, tiny_model

from rag_speculate import InvalidArgumentError, SpeculativeEngine
from rag_speculate.engine.inputs import check_tools
from rag_speculate.entrypoints.tool_calls import ToolCall, parse_tool_calls

SEARCH = {"type": "function", "function": {"name": "search", "description": "search the docs",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)


@pytest.mark.parametrize(
    "text,calls,content",
    [
        ('<tool_call>\n{"name": "search", "arguments": {"query": "warranty"}}\n</tool_call>',
         [ToolCall("search", {"query": "warranty"}, "call_0")], ""),
        ('Let me look.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
         [ToolCall("a", {}, "call_0"), ToolCall("b", {"x": 1}, "call_1")], "Let me look."),
        ('```json\n{"name": "search", "arguments": {"query": "water damage"}}\n```', [ToolCall("search", {"query": "water damage"}, "call_0")], ""),
        ('{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}', [ToolCall("search", {"query": "q"}, "call_0")], ""),
        ("The warranty covers parts for two years.", [], "The warranty covers parts for two years."),
        # The packaged Qwen2.5-Coder's template shows the format with doubled braces, and the model copies them.
        ('<tool_call>\n{{"name": "search", "arguments": {"query": "q"}}}}\n</tool_call>', [ToolCall("search", {"query": "q"}, "call_0")], ""),
        ('Searching. {{"name": "search", "arguments": {"query": "q"}}} Done.', [ToolCall("search", {"query": "q"}, "call_0")], "Searching.  Done."),
        ('```json\n{"answer": 42}\n```', [], '```json\n{"answer": 42}\n```'),
    ],
)
def test_calls_are_read_in_every_shape_models_write_them(text, calls, content):
    parsed = parse_tool_calls(text)
    assert parsed.calls == calls and parsed.content == content and parsed.error == ""


@pytest.mark.parametrize(
    "text,error",
    [
        ('<tool_call>{"name": "search", "arguments": {"query": </tool_call>', "tool call 0 is not valid JSON"),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "needs a string 'name' and an object 'arguments'"),
        ('{"name": "search", "arguments": {"query": "unterminated}', "not valid JSON"),
    ],
)
def test_a_malformed_call_comes_back_as_content_with_the_reason(text, error):
    parsed = parse_tool_calls(text)
    assert parsed.calls == [] and parsed.content == text and error in parsed.error


@pytest.mark.parametrize(
    "text,calls,content",
    [
        # What the packaged Qwen2.5-Coder-1.5B wrote, its template showing the format as {{"name": ...}}.
        ('{{"name": "search_passages", "arguments": {"query": "Nobel"}}}}', [("search_passages", {"query": "Nobel"})], ""),
        ('{{"name": "search_passages", "arguments": {"query": "q"}}}', [("search_passages", {"query": "q"})], ""),
        ('Let me look.\n<tool_call>\n{{"name": "a", "arguments": {}}}\n</tool_call>', [("a", {})], "Let me look."),
        ('{{"name": "a", "arguments": {}}}\n{{"name": "b", "arguments": "{\\"x\\": 1}"}}', [("a", {}), ("b", {"x": 1})], ""),
        ('{{"name": "a", "arguments": {"q": }}}', [], '{{"name": "a", "arguments": {"q": }}}'),
        ("Use {{name}} here.", [], "Use {{name}} here."),
    ],
)
def test_calls_with_doubled_braces_are_read_too(text, calls, content):
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == calls and parsed.content == content
    assert [c.id for c in parsed.calls] == [f"call_{i}" for i in range(len(calls))]


@pytest.mark.parametrize(
    "tools,match",
    [
        ("search", "tools must be a list"),
        ([{"name": "search"}], r"tools\[0\] must be"),
        ([{"type": "function", "function": {"name": "has space"}}], r"tools\[0\] must be"),
        ([{"type": "function", "function": {"name": "s", "parameters": {"type": "array"}}}], "tool 's': parameters must be"),
        ([SEARCH, SEARCH], "tool 'search' is given twice"),
    ],
)
def test_bad_tools_are_refused_naming_the_tool(tools, match):
    with pytest.raises(InvalidArgumentError, match=match):
        check_tools(tools)


def test_tools_reach_the_template_and_greedy_output_stays_generates():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    model = tiny_model("qwen2")
    engine = SpeculativeEngine(model, tokenizer)
    messages = [{"role": "user", "content": "find the warranty"}]
    ids = engine.encode_prompt(messages, chat=True, tools=[SEARCH])
    assert tokenizer.decode(ids).startswith("tools: search\nuser: find the warranty")
    result = engine.generate(messages, chat=True, tools=[SEARCH], max_new_tokens=24)
    assert result.token_ids == hf_greedy(model, ids, 24)
    # A tool result closes the history; its text feeds the drafters too.
    history = [*messages, {"role": "assistant", "content": "searching"}, {"role": "tool", "content": "parts for two years"}]
    request = engine.prepare(history, chat=True, tools=[SEARCH])
    assert tokenizer.encode("parts for two years", add_special_tokens=False) in request.document_ids


def test_a_template_without_tools_and_tools_without_chat_are_refused(tokenizer):
    plain = char_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    engine = SpeculativeEngine(tiny_model("llama"), plain)
    with pytest.raises(InvalidArgumentError, match="chat template takes no tools"):
        engine.stream([{"role": "user", "content": "hi"}], chat=True, tools=[SEARCH])
    with pytest.raises(InvalidArgumentError, match="need chat=True"):
        engine.stream("hi", tools=[SEARCH])
