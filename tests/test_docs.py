"""Every Python snippet of the README and docs/ runs as written, page by page, with the small packaged
model in place of the 1.5B (and fewer new tokens): a snippet that stops running fails here.

A page's snippets run in order in one namespace, as a reader runs them. What the page assumes is set
up around them: `my_index` (the README's `rag-speculate index ... --out my_index`) in the working
folder, a server on 127.0.0.1 (docs/serving.md) and the CPU where a page names CUDA and none is here.
SmolLM2's own chat template renders no tools, so the model the pages load gets Qwen2.5's (the same
special tokens), as the adapters' tests give it.
"""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path

import pytest
import torch
from packaged_fixtures import DOCUMENT, MODEL, QWEN_TOOLS_TEMPLATE

from rag_speculate import SpeculativeEngine
from rag_speculate.entrypoints import engines
from rag_speculate.entrypoints.openai import Server
from rag_speculate.entrypoints.openai.app import create_app
from rag_speculate.entrypoints.openai.background import running
from rag_speculate.retrieval.corpus import CorpusIndex, Document

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
PAGES = [page for page in PAGES if "```python" in (REPO / page).read_text()]
SNIPPET = re.compile(r"```python\n(.*?)```", re.S)


def _small(code: str, url: str) -> str:
    code = code.replace("qwen2.5-coder-1.5b-instruct", MODEL).replace("http://127.0.0.1:8000/v1", url)
    code = re.sub(r"(max_new_tokens|max_tokens)=\d+", r"\1=16", code)
    return code if torch.cuda.is_available() else code.replace('device="cuda"', 'device="cpu"')


@pytest.fixture
def page_setup(tmp_path, monkeypatch):
    """A working folder with `my_index`, a server on it, and a fresh engine per name the page loads."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(engines, "_engines", {})
    loaded = SpeculativeEngine.from_pretrained.__func__

    def with_tools_template(cls, *args, **kwargs):
        engine = loaded(cls, *args, **kwargs)
        engine.tokenizer.chat_template = QWEN_TOOLS_TEMPLATE
        return engine

    monkeypatch.setattr(SpeculativeEngine, "from_pretrained", classmethod(with_tools_template))
    engine = engines.shared_engine(MODEL, dtype="auto", device="cpu", draft_budget=None)
    documents = [
        Document(id="eiffel", text=DOCUMENT, title="Eiffel Tower"),
        Document(id="warranty", text="The warranty covers parts and labour for two years.", title="Warranty"),
    ]
    index = CorpusIndex.build(documents, tmp_path / "my_index", tokenizer=engine.tokenizer)
    with running(create_app(Server(engines.rag_engine(engine, index), MODEL, index))) as url:
        yield url


@pytest.mark.parametrize("page", PAGES)
def test_every_snippet_of_the_page_runs(page, page_setup):
    namespace: dict = {"__name__": "__doc_page__"}
    for number, snippet in enumerate(SNIPPET.findall((REPO / page).read_text()), 1):
        code = compile(_small(snippet, page_setup), f"{page} snippet {number}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        awaited = eval(code, namespace)  # noqa: S307 - the repo's own documentation
        if asyncio.iscoroutine(awaited):
            asyncio.run(awaited)
