"""Warm files (`rag-speculate serve --warm FILE`): each line read or named as the error, and each
prompt built by the server's prompt builder and prefilled into the prompt cache."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_model

from rag_speculate import InvalidArgumentError, SpeculativeEngine
from rag_speculate.entrypoints.prompt import prepare
from rag_speculate.entrypoints.warm import WarmPrompt, read_warm_file, warm

SYSTEM = {"role": "system", "content": "answer from the passages: the fox is quick and brown."}
USER = {"role": "user", "content": "what colour is the fox?"}


def test_a_warm_file_gives_its_prompts_in_order(tmp_path):
    path = tmp_path / "warm.jsonl"
    lines = ['"a text prompt"', "", json.dumps({"prompt": "another"}), json.dumps({"messages": [SYSTEM]})]
    path.write_text("\n".join(lines))
    assert read_warm_file(path) == (WarmPrompt(1, "a text prompt"), WarmPrompt(3, "another"), WarmPrompt(4, (SYSTEM,)))


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "line 2"),
        ("3", "got int"),
        (json.dumps({"prompt": "a", "messages": []}), "nothing else"),
        (json.dumps({"prompt": 3}), '"prompt" must be a string'),
        (json.dumps({"messages": [{"role": "user"}]}), '"messages" must be a list'),
        (json.dumps({"prompt": "a", "documents": ["b"]}), "nothing else"),
    ],
)
def test_a_bad_line_is_named(tmp_path, line, problem):
    path = tmp_path / "warm.jsonl"
    path.write_text('"fine"\n' + line)
    with pytest.raises(InvalidArgumentError, match=problem) as raised:
        read_warm_file(path)
    assert raised.value.argument == "warm" and str(path) in str(raised.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(InvalidArgumentError, match="cannot be read"):
        read_warm_file(tmp_path / "absent.jsonl")


def test_warming_prefills_what_the_prompt_builder_builds(tokenizer):
    tokenizer = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    engine = SpeculativeEngine(tiny_model("llama"), tokenizer)
    prompts = (WarmPrompt(1, "the quick brown fox"), WarmPrompt(2, (SYSTEM, USER)))
    built = [prepare(engine, list(p.prompt) if p.chat else p.prompt, chat=p.chat).request.prompt_ids for p in prompts]
    assert warm(engine, prompts) == sum(len(ids) for ids in built)
    # A request with the same prompt now reuses all but its last token.
    request = prepare(engine, [SYSTEM, USER], chat=True, max_new_tokens=2).request
    assert engine.stream_request(request).collect().stats.cached_prompt_tokens == len(built[1]) - 1
    with pytest.raises(InvalidArgumentError, match="line 7"):
        warm(engine, (WarmPrompt(7, "x" * 600),))  # longer than the model's 512 positions
