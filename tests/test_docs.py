"""Every Python snippet of the README and docs/ runs as written, page by page, with the small packaged
model in place of the 1.5B (and fewer new tokens): a snippet that stops running fails here. And every
file, folder and dotted name the pages cite in backticks exists: a page that names what was renamed or
removed fails here.

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
import subprocess
from pathlib import Path

import pytest
import torch
from packaged_fixtures import DOCUMENT, MODEL, QWEN_TOOLS_TEMPLATE

from rag_speculate.entrypoints import engines
from rag_speculate.models import loading
from rag_speculate.entrypoints.openai import Server
from rag_speculate.entrypoints.openai.app import create_app
from rag_speculate.entrypoints.openai.background import running
from rag_speculate.retrieval.corpus import CorpusIndex, Document

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
PAGES_WITH_CODE = [page for page in PAGES if "```python" in (REPO / page).read_text()]
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
    loaded = loading.load_model

    def with_tools_template(*args, **kwargs):
        model, tokenizer = loaded(*args, **kwargs)
        tokenizer.chat_template = QWEN_TOOLS_TEMPLATE
        return model, tokenizer

    # Where `SpeculativeEngine.from_pretrained` and the shared engines load a model.
    monkeypatch.setattr(loading, "load_model", with_tools_template)
    monkeypatch.setattr(engines, "load_model", with_tools_template)
    documents = [
        Document(id="eiffel", text=DOCUMENT, title="Eiffel Tower"),
        Document(id="warranty", text="The warranty covers parts and labour for two years.", title="Warranty"),
    ]
    index = CorpusIndex.build(documents, tmp_path / "my_index", tokenizer=loading.load_tokenizer(MODEL))
    engine = engines.shared_engine(MODEL, device="cpu", index=index)
    with running(create_app(Server(engine, MODEL, index))) as url:
        yield url


@pytest.mark.parametrize("page", PAGES_WITH_CODE)
def test_every_snippet_of_the_page_runs(page, page_setup):
    namespace: dict = {"__name__": "__doc_page__"}
    for number, snippet in enumerate(SNIPPET.findall((REPO / page).read_text()), 1):
        code = compile(_small(snippet, page_setup), f"{page} snippet {number}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        awaited = eval(code, namespace)  # noqa: S307 - the repo's own documentation
        if asyncio.iscoroutine(awaited):
            asyncio.run(awaited)


# What the pages cite in backticks that is not ours, recognised by its owner's prefix: torch's and
# transformers' names (a cache layer's `layer.crop`), Ray Serve's (`serve.run`), and the objects of
# the OpenAI, LangChain (`llm.bind`, a Runnable's) and LlamaIndex APIs the adapter and server pages use.
NOT_OURS = ("torch.", "F.", "np.", "transformers.", "ray.", "serve.", "model.generate", "layer.crop", "llm.bind",
            "message.", "usage.", "stream_options.", "prompt_tokens_details.", "metadata.", "BaseTool.",
            "HuggingFacePipeline.", "MessageRole.")  # fmt: skip
# Functions and classes of theirs cited by a bare call: LangChain's and LlamaIndex's, and torch's
# batch-invariant mode.
NOT_OUR_CALLS = {"from_model_id", "invoke", "with_structured_output", "as_structured_llm", "FunctionAgent",
                 "set_batch_invariant_mode"}  # fmt: skip
# Cited files of other projects: torch's cascade sum, which the norm kernel follows.
NOT_OUR_FILES = {"SumKernel.cpp"}
PATH = re.compile(r"[\w-][\w.-]*(/[\w.-]+)*\.(py|c|cpp|h|sh|md|toml|json|jsonl|log|txt|gz)")
FOLDER = re.compile(r"[\w-][\w.-]*(/[\w.-]+)*/")
DOTTED = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(\(.*\))?")
CALL = re.compile(r"([A-Za-z_]\w*)\(.*\)")


def _cited(page: str) -> list[str]:
    """Every inline code span of the page, fenced blocks left out (their code runs above)."""
    text = re.sub(r"```.*?```", "", (REPO / page).read_text(), flags=re.S)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text)]


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment statement binds, tuples unpacked; nothing for any other node."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    else:
        targets = [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
    return [name for target in targets for name in (target.elts if isinstance(target, ast.Tuple) else [target])]


class _Source:
    """Our Python as ast sees it: each module's top-level names under every dotted suffix of its path
    (`verify`, `decoding.verify`, `rag_speculate.decoding.verify`), each class's members (`self.x`
    included) and what type an attribute is built or annotated as, and every string the code holds
    (the file names it writes)."""

    def __init__(self, files: list[str]):
        self.modules: dict[str, list[set[str]]] = {}
        self.members: dict[str, set[str]] = {}
        self.bases: dict[str, set[str]] = {}
        self.types: dict[tuple[str, str], set[str]] = {}
        self.strings: set[str] = set()
        for file in files:
            tree = ast.parse((REPO / file).read_text())
            # An integration's distribution folder (integrations/<name>/) is no part of its import path.
            parts = Path(file).with_suffix("").parts[2 if file.startswith("integrations/") else 0 :]
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names}
            defined = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
            names |= {node.name for node in tree.body if isinstance(node, defined)}
            names |= {target.id for node in tree.body for target in _targets(node) if isinstance(target, ast.Name)}
            for start in range(len(parts)):
                self.modules.setdefault(".".join(parts[start:]), []).append(names)
            self.strings |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and type(n.value) is str}
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self._add_class(node)

    def _add_class(self, node: ast.ClassDef) -> None:
        members = self.members.setdefault(node.name, set())
        self.bases.setdefault(node.name, set()).update(ast.unparse(base).split(".")[-1] for base in node.bases)
        for child in node.body:
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                members.add(child.name)
            for target in _targets(child):
                if isinstance(target, ast.Name):
                    members.add(target.id)
                    self._typed(node.name, target.id, child)
        for child in ast.walk(node):
            for target in _targets(child):
                if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                    members.add(target.attr)
                    self._typed(node.name, target.attr, child)

    def _typed(self, cls: str, attr: str, node: ast.stmt) -> None:
        """The classes of ours an attribute is annotated as, or built by (`X(...)`, `X.make(...)`)."""
        source = node.annotation if isinstance(node, ast.AnnAssign) else getattr(node, "value", None)
        if isinstance(source, ast.Call):
            source = source.func.value if isinstance(source.func, ast.Attribute) else source.func
        named = {n.id for n in ast.walk(source) if isinstance(n, ast.Name)} if source is not None else set()
        self.types.setdefault((cls, attr), set()).update(named)

    def _class_members(self, cls: str, seen: frozenset = frozenset()) -> set[str]:
        if cls in seen or cls not in self.members:
            return set()
        return self.members[cls].union(*(self._class_members(base, seen | {cls}) for base in self.bases[cls]))

    def _in_classes(self, classes: set[str], rest: list[str]) -> bool:
        """`rest` is an attribute chain of one of `classes`; past an attribute of no known type, each
        further name need only be a member of some class of ours."""
        if not rest:
            return True
        for cls in classes:
            if rest[0] in self._class_members(cls):
                built = {t for c in [cls, *self.bases.get(cls, ())] for t in self.types.get((c, rest[0]), ())}
                types = built & self.members.keys()
                if types:
                    return self._in_classes(types, rest[1:])
                return all(self.has(name) for name in rest[1:])
        return False

    def has(self, name: str) -> bool:
        """`name` is defined somewhere: a module's name, or a class's member."""
        return any(name in names for modules in self.modules.values() for names in modules) or any(
            name in members for members in self.members.values()
        )

    def defines(self, dotted: str) -> bool:
        """A module's name (`files.recover`), a class's (`TreeForward.chain`), or an instance's, named
        after the end of its class's name (`engine.prepare`: `SpeculativeEngine.prepare`)."""
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            rest = parts[end:]
            for names in self.modules.get(".".join(parts[:end]), []):
                if not rest or rest[0] in names and (len(rest) == 1 or self._in_classes({rest[0]}, rest[1:])):
                    return True
        instance = parts[0].replace("_", "").lower()
        classes = {cls for cls in self.members if cls == parts[0] or cls.lower().endswith(instance)}
        return self._in_classes(classes, parts[1:])


@pytest.fixture(scope="module")
def repo_files() -> list[str]:
    """The repo's files, new ones not yet committed included."""
    command = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [file for file in listed if (REPO / file).is_file()]


@pytest.fixture(scope="module")
def source(repo_files) -> _Source:
    roots = ("rag_speculate/", "integrations/", "benchmarks/", "examples/", "scripts/")
    return _Source([file for file in repo_files if file.endswith(".py") and file.startswith(roots)])


@pytest.mark.parametrize("page", PAGES)
def test_every_cited_file_and_name_exists(page, repo_files, source):
    """A file is found under the repo root or any folder below it (a page names `forward.py` inside
    its `decoding/` paragraph), or is one the code writes (`gpu_check.json`); a dotted name is
    defined in our source."""
    folders = {"/".join(Path(file).parts[:n]) + "/" for file in repo_files for n in range(1, len(Path(file).parts))}

    def found(path: str) -> bool:
        if path.endswith("/"):
            return any(folder == path or folder.endswith("/" + path) for folder in folders)
        return (path in NOT_OUR_FILES or any(file == path or file.endswith("/" + path) for file in repo_files)
                or any(Path(path).name in text for text in source.strings))  # fmt: skip

    missing = []
    for span in _cited(page):
        words = [span] if FOLDER.fullmatch(span) else [word for word in span.split() if PATH.fullmatch(word)]
        missing += [f"file {word}" for word in words if not found(word)]
        dotted, call = DOTTED.fullmatch(span), CALL.fullmatch(span)
        if not words and dotted and not dotted[1].startswith(NOT_OURS) and not source.defines(dotted[1]):
            missing.append(f"name {span}")
        if call and call[1] not in NOT_OUR_CALLS and not source.has(call[1]):
            missing.append(f"call {span}")
    assert not missing, f"{page} cites what the repo does not have: {missing}"
