"""A corpus's documents, read from a folder of text files or a JSONL file, and the chunks retrieved from them."""

from __future__ import annotations

import gzip
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError

_CORPUS_SUFFIXES = (".txt", ".md")
# Key under which a chunk's token ids (from the target's tokenizer) travel in a framework's document
# metadata, so the drafters get them without tokenizing the text again.
TOKEN_IDS_KEY = "token_ids"


@dataclass(frozen=True)
class Document:
    text: str
    title: str = ""
    id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Chunk:
    """A retrieved chunk: its text and source, its similarity to the query, and its token ids."""

    text: str
    score: float
    title: str
    id: str
    metadata: dict[str, Any]
    token_ids: list[int]
    chunk: int


def read_corpus(path: str | Path, *, text_field: str = "text") -> list[Document]:
    """A folder of .txt/.md files (searched recursively) or a JSONL file (.jsonl or .jsonl.gz)
    with a `text_field` and optional `title`, `id` and `metadata`.

    Unreadable or non-UTF-8 files and rows without text are skipped with a warning that counts
    them and names the first few; an empty corpus is an error.
    """
    path = Path(path)
    if path.is_dir():
        documents, skipped = _read_folder(path)
    elif path.is_file() and path.name.endswith((".jsonl", ".jsonl.gz")):
        documents, skipped = _read_jsonl(path, text_field)
    elif path.exists():
        raise InvalidArgumentError(f"corpus {path} must be a folder of .txt/.md files or a .jsonl(.gz) file")
    else:
        raise InvalidArgumentError(f"corpus {path} does not exist")
    if skipped:
        shown = "; ".join(skipped[:5]) + ("; ..." if len(skipped) > 5 else "")
        warnings.warn(f"skipped {len(skipped)} unreadable entries of corpus {path}: {shown}", RuntimeWarning, stacklevel=2)
    if not documents:
        raise InvalidArgumentError(f"corpus {path} has no documents with text" + (f" ({len(skipped)} skipped)" if skipped else ""))
    return documents


def _read_folder(folder: Path) -> tuple[list[Document], list[str]]:
    documents, skipped = [], []
    for file in sorted(p for p in folder.rglob("*") if p.suffix.lower() in _CORPUS_SUFFIXES and p.is_file()):
        name = str(file.relative_to(folder))
        try:
            text = file.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            skipped.append(f"{name} ({type(error).__name__})")
            continue
        if text.strip():
            documents.append(Document(text, title=file.stem, id=name))
        else:
            skipped.append(f"{name} (empty)")
    return documents, skipped


def _read_jsonl(file: Path, text_field: str) -> tuple[list[Document], list[str]]:
    documents, skipped = [], []
    opener = gzip.open if file.name.endswith(".gz") else open
    try:
        with opener(file, "rt", encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                document = _jsonl_document(line, text_field, number)
                if isinstance(document, str):
                    skipped.append(document)
                else:
                    documents.append(document)
    except (OSError, UnicodeDecodeError, EOFError) as error:
        raise InvalidArgumentError(f"corpus {file} cannot be read: {error}") from None
    return documents, skipped


def _jsonl_document(line: str, text_field: str, number: int) -> Document | str:
    """The line's document, or why it was skipped."""
    try:
        row = json.loads(line)
    except ValueError:
        return f"line {number} (not JSON)"
    text = row.get(text_field) if isinstance(row, dict) else None
    if not isinstance(text, str) or not text.strip():
        return f"line {number} (no text in field {text_field!r})"
    metadata = row.get("metadata")
    return Document(text, str(row.get("title") or ""), str(row.get("id", number)), metadata if isinstance(metadata, dict) else {})
