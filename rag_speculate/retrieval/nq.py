"""The Natural Questions corpus shipped with the package: passages to index, questions to ask them.

2,655 real questions, each with the Wikipedia passage that answers it (nelson-liu/lost-in-the-middle,
MIT); the distinct passages make a 2,600-document corpus of about 270k tokens.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from .documents import Document

_FILE = "nq_open_oracle.jsonl.gz"


@dataclass(frozen=True)
class Question:
    question: str
    answers: list[str]
    title: str = ""  # the article its gold passage comes from


@cache
def _rows() -> tuple[dict, ...]:
    with resources.files("rag_speculate.retrieval.data").joinpath(_FILE).open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return tuple(json.loads(line) for line in lines)


def nq_documents() -> list[Document]:
    """The distinct gold passages, in file order."""
    seen: dict[tuple[str, str], Document] = {}
    for row in _rows():
        passage = row["ctxs"][0]
        key = (passage["title"], passage["text"])
        if key not in seen:
            seen[key] = Document(passage["text"], passage["title"], f"nq-{len(seen)}")
    return list(seen.values())


def nq_questions() -> list[Question]:
    return [Question(row["question"], list(row["answers"]), row["ctxs"][0]["title"]) for row in _rows()]
