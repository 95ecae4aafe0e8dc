"""Bad input raises a ValueError that names the argument and what is allowed."""

from __future__ import annotations

import pytest
from conftest import tiny_model

from rag_speculate import DraftTree, InvalidArgumentError, NGramTrieDrafter, RagSpeculateError, SpeculativeEngine
from rag_speculate.drafters import Drafter


@pytest.fixture(scope="module")
def engine(tokenizer):
    return SpeculativeEngine(tiny_model("llama"), tokenizer)


@pytest.mark.parametrize(
    "prompt,kwargs,match",
    [
        ("", {}, "prompt is empty"),
        ([], {}, "prompt must be"),
        ([1, 2, 999], {}, r"prompt has token ids outside the vocabulary range \[0, 96\)"),
        ([1, -2], {}, "outside the vocabulary"),
        ([1, "a"], {}, "prompt must be a string or a list of int"),
        ("hi", {"documents": "a string, not a list"}, "documents must be a list"),
        ("hi", {"documents": [3.5]}, r"documents\[0\] must be a string or a list of token ids"),
        ("hi", {"documents": [[1, 500]]}, r"documents\[0\] has token ids outside"),
        ("hi", {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ("hi", {"max_new_tokens": 600}, "exceeds the model's position limit of 512"),
        ("hi", {"temperature": -0.1}, "temperature must be >= 0"),
        ("hi", {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ("hi", {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ("hi", {"top_k": -1}, "top_k must be an integer >= 0"),
        ("hi", {"stop": [""]}, "stop must be a non-empty string"),
        ("hi", {"stop": [3]}, "stop must be a non-empty string"),
        ([{"role": "user", "content": "hi"}], {}, "needs chat=True"),
        ([{"role": "user"}], {"chat": True}, "string 'role' and 'content'"),
    ],
)
def test_bad_arguments_name_the_problem(engine, prompt, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match) as caught:
        engine.generate(prompt, **kwargs)
    assert isinstance(caught.value, ValueError)


def test_bad_engine_and_drafter_settings(tokenizer):
    with pytest.raises(InvalidArgumentError, match="draft_budget must be an integer >= 0"):
        SpeculativeEngine(tiny_model("llama"), tokenizer, draft_budget=-1)
    with pytest.raises(InvalidArgumentError, match="max_prefix"):
        NGramTrieDrafter(n=3, max_prefix=3)


def test_a_drafter_proposing_tokens_outside_the_vocabulary_is_caught(tokenizer):
    class Broken(Drafter):
        name = "broken"

        def propose(self, tokens, budget):
            return DraftTree([10_000], [-1])

    engine = SpeculativeEngine(tiny_model("llama"), tokenizer, Broken())
    with pytest.raises(RagSpeculateError, match="drafter 'broken' proposed a token outside"):
        engine.generate("hello", max_new_tokens=5)


def test_malformed_trees_are_rejected():
    with pytest.raises(RagSpeculateError, match="parents must precede children"):
        DraftTree([1, 2], [-1, 1])
    with pytest.raises(RagSpeculateError, match="2 tokens but 1 parents"):
        DraftTree([1, 2], [-1])


def test_unknown_packaged_model_name():
    from rag_speculate.models.loading import load_model

    with pytest.raises(InvalidArgumentError, match="unknown model 'qwen-9000'.*qwen2.5-coder-1.5b-instruct"):
        load_model("qwen-9000")


def test_library_prints_nothing(engine, capsys):
    engine.generate("hello there", documents=["hello there general"], max_new_tokens=10)
    assert capsys.readouterr().out == ""


def test_documents_are_bounded_in_bytes_before_tokenizing_and_in_tokens_before_indexing(engine):
    """Requests just over either limit are refused naming `documents`; requests at them run."""
    from rag_speculate.engine.inputs import MAX_DOCUMENT_BYTES, MAX_DOCUMENT_TOKENS

    half = MAX_DOCUMENT_BYTES // 2
    # Text counts in UTF-8 bytes, not characters: "é" is two.
    over = {
        "text": ["a" * half, "é" * (half // 2) + "a"],
        "token ids": [[5] * (MAX_DOCUMENT_TOKENS // 2), [6] * (MAX_DOCUMENT_TOKENS // 2 + 1)],
        "tokens in all": [[5] * (MAX_DOCUMENT_TOKENS - 1), "ab"],
    }
    for documents in over.values():
        with pytest.raises(InvalidArgumentError, match="over the limit of") as caught:
            engine.prepare("hi", documents=documents, max_new_tokens=2)
        assert caught.value.argument == "documents"
    at_limit = [["a" * half, "é" * (half // 2)], [[5] * (MAX_DOCUMENT_TOKENS - 2), "ab"]]
    for documents in at_limit:
        request = engine.prepare("hi", documents=documents, max_new_tokens=2)
        assert sum(map(len, request.document_ids)) <= MAX_DOCUMENT_TOKENS
        assert len(engine.stream_request(request).collect().token_ids) == 2


def test_a_prompt_too_long_for_any_tokenization_to_fit_is_refused_before_tokenizing(engine):
    """The tiny model has 512 positions: no prompt over 16 bytes a position could fit them."""
    from rag_speculate.engine.inputs import MAX_PROMPT_BYTES_PER_POSITION

    limit = MAX_PROMPT_BYTES_PER_POSITION * 512
    # Counted in UTF-8 bytes: "é" is two. (A chat's rendered template is counted the same way.)
    with pytest.raises(InvalidArgumentError, match=f"hold at most {limit} bytes") as caught:
        engine.prepare("é" * (limit // 2) + "a", max_new_tokens=2)
    assert caught.value.argument == "prompt"
    # At the limit it is tokenized, then refused for the positions it really takes.
    with pytest.raises(InvalidArgumentError, match="exceeds the model's position limit"):
        engine.prepare("a" * limit, max_new_tokens=2)


def test_max_new_tokens_may_follow_from_the_prompts_length(engine):
    lengths = []

    def room(prompt_tokens: int) -> int:
        lengths.append(prompt_tokens)
        return 512 - prompt_tokens

    request = engine.prepare("the quick brown fox", max_new_tokens=room)
    assert lengths == [len(request.prompt_ids)] and request.max_new_tokens == 512 - len(request.prompt_ids)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens must be an integer >= 1"):
        engine.prepare("hi", max_new_tokens=lambda prompt_tokens: 0)
