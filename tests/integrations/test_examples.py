"""Both RAG examples, run as the README runs them but with the small model and part of the corpus,
so they never rot."""

from __future__ import annotations

import importlib

import pytest

from .conftest import DTYPE, MODEL

ARGS = ["--model", MODEL, "--dtype", DTYPE, "--passages", "40", "--questions", "2", "--max-tokens", "16"]


@pytest.mark.parametrize("example", ["langchain_rag", "llamaindex_rag"])
def test_example_answers_with_sources_and_stats(example, capsys):
    results = importlib.import_module(example).main(ARGS)
    printed = capsys.readouterr().out
    assert len(results) == 2
    for result in results:
        assert result["answer"].strip() and result["answer"].strip() in printed
        assert result["stats"]["new_tokens"] >= 1 and result["stats"]["target_forwards"] >= 1
        assert result["gold"] and "tokens/forward" in printed
    # Every corpus question has its gold passage among the 40 indexed: retrieval finds it.
    assert "List of Nobel laureates in Physics" in results[0]["sources"]
    assert "Deadpool 2" in results[1]["sources"]


def test_example_refuses_a_missing_model():
    with pytest.raises(ValueError, match="unknown model"):
        importlib.import_module("langchain_rag").main(
            ["--model", "no-such-model", "--passages", "2", "--questions", "1"]
        )
