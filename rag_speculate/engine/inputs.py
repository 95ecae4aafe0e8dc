"""A caller's prompt, tools and documents as checked token ids: what `SpeculativeEngine.prepare` runs.

Every argument is checked when the call is made, and a bad one raises `InvalidArgumentError` naming it
(`.argument`). Checks that cost nothing come before work that costs time: the documents are measured in
bytes before they are tokenized, and in tokens before the drafters index them. Each distinct document
is tokenized once per engine and kept under a byte budget, since RAG pipelines retrieve the same
passages again and again.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..decoding.request import (
    Request,
    check_messages,
    check_not_bytes,
    check_seed,
    check_text,
    sampling_params,
    stop_strings,
)
from ..errors import InvalidArgumentError, check_int

Prompt = str | Sequence[int] | Sequence[dict]
Document = str | Sequence[int]

# Tokenized documents kept per engine, in bytes of token ids: thousands of retrieved passages.
DOCUMENT_CACHE_BYTES = 64 << 20
# What one request's documents may hold in all: their text in UTF-8 bytes, which bounds the time to
# tokenize them, and their tokens, which bounds the time the drafters take to index them on the
# engine's thread before the first step. At both limits a request prepares in well under a second on
# two CPU cores (docs/serving.md); more would be a corpus, which belongs in a REST datastore.
MAX_DOCUMENT_BYTES = 256 << 10
MAX_DOCUMENT_TOKENS = 256 << 10
_CORPUS_ADVICE = "index a corpus this large for the REST drafter instead"
# A prompt's text, in UTF-8 bytes, per position the model has: tokens average a few bytes, so a prompt
# past this could never fit the model's context, and is refused before tokenizing it costs seconds.
MAX_PROMPT_BYTES_PER_POSITION = 16
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class Inputs:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_positions: int | None, name: str):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.name = name
        self.documents = DocumentCache(DOCUMENT_CACHE_BYTES)

    def request(
        self,
        prompt: Prompt,
        *,
        documents: Sequence[Document] | None,
        max_new_tokens: int | Callable[[int], int],
        temperature: float,
        top_p: float,
        top_k: int,
        stop: str | Sequence[str] | None,
        seed: int | None,
        chat: bool,
        tools: Sequence[dict] | None,
    ) -> Request:
        # The cheap checks first: a request refused for its sampling settings tokenizes nothing.
        if not callable(max_new_tokens):
            check_int(max_new_tokens, "max_new_tokens", 1)
        sampling, stops, seed = sampling_params(temperature, top_p, top_k), stop_strings(stop), check_seed(seed)
        tools = check_tools(tools) if tools is not None else None
        document_ids = self.document_ids(documents)
        prompt_ids = self.prompt_ids(prompt, chat=chat, tools=tools)
        if callable(max_new_tokens):  # the room a context leaves, say: known once the prompt is counted
            max_new_tokens = check_int(max_new_tokens(len(prompt_ids)), "max_new_tokens", 1)
        self._check_length(len(prompt_ids), max_new_tokens)
        # The tool schemas and results are parts of the prompt: bounded with it by the check above,
        # not by the documents' limits.
        messages = prompt if chat and not isinstance(prompt, str) else []
        document_ids += [self._tokenized(text) for text in tool_documents(tools, messages)]
        return Request(prompt_ids, document_ids, max_new_tokens, sampling, stops, seed)

    def prompt_ids(self, prompt: Prompt, *, chat: bool = False, tools: Sequence[dict] | None = None) -> list[int]:
        check_not_bytes(prompt, "prompt")
        if tools is not None and not chat:
            raise InvalidArgumentError("tools= reach the model through its chat template: they need chat=True", "tools")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgumentError("prompt is empty", "prompt")
            check_text(prompt, "prompt")
            if chat:
                return self._chat_ids([{"role": "user", "content": prompt}], tools)
            return self.tokenizer.encode(self._fits(prompt))
        if chat and isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt):
            return self._chat_ids(list(prompt), tools)  # an empty chat is refused there, as a chat
        if not isinstance(prompt, Sequence) or not prompt:
            raise InvalidArgumentError(
                "prompt must be a non-empty string, list of token ids or list of chat messages", "prompt"
            )
        if all(isinstance(m, dict) for m in prompt):
            raise InvalidArgumentError("a list of chat messages as prompt needs chat=True", "prompt")
        return self._token_ids(prompt, "prompt")

    def _chat_ids(self, messages: list[dict], tools: Sequence[dict] | None) -> list[int]:
        check_messages(messages)
        if tools is not None and "tools" not in (self.tokenizer.chat_template or ""):
            raise InvalidArgumentError(
                f"{self.name}'s chat template takes no tools: pick a model whose template renders them", "tools"
            )
        extra = {"tools": check_tools(tools)} if tools is not None else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return self.tokenizer.encode(self._fits(text), add_special_tokens=False)

    def _fits(self, text: str) -> str:
        """`text`, unless it is too long ever to fit the model's positions (`MAX_PROMPT_BYTES_PER_POSITION`)."""
        limit = None if self.max_positions is None else MAX_PROMPT_BYTES_PER_POSITION * self.max_positions
        if limit is not None and len(text) > limit // 4 and len(text.encode("utf-8")) > limit:
            raise InvalidArgumentError(
                f"prompt is {len(text.encode('utf-8'))} bytes; the model's {self.max_positions} positions hold "
                f"at most {limit} bytes of text", "prompt",
            )  # fmt: skip
        return text

    def _token_ids(self, ids: Sequence[Any], what: str) -> list[int]:
        argument = what.split("[", 1)[0]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidArgumentError(f"{what} must be a string or a list of int token ids", argument)
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise InvalidArgumentError(f"{what} has token ids outside the vocabulary range [0, {self.vocab_size})", argument)
        return list(ids)

    def document_ids(self, documents: Sequence[Document] | None) -> list[list[int]]:
        documents = check_documents(documents)
        ids = [
            self._tokenized(doc) if isinstance(doc, str) else self._token_ids(doc, f"documents[{i}]")
            for i, doc in enumerate(documents)
        ]
        _check_document_tokens(sum(map(len, ids)))
        return ids

    def _tokenized(self, text: str) -> list[int]:
        ids = self.documents.get(text)
        if ids is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self.documents.put(text, ids)
        return ids

    def _check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        total = prompt_tokens + max_new_tokens
        if self.max_positions is not None and total > self.max_positions:
            raise InvalidArgumentError(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                f"exceeds the model's position limit of {self.max_positions}",
                "max_new_tokens",
            )


class DocumentCache:
    """Token ids of documents seen before, least recently used first out, under a byte budget.

    Ids are kept as 4-byte integers (a Python list of ints takes several times that), so the budget
    is the memory the cache holds; a document larger than the whole budget is not kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._ids: OrderedDict[str, array] = OrderedDict()
        self._lock = threading.Lock()  # requests are checked on their callers' threads

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, text: str) -> list[int] | None:
        key = _key(text)
        with self._lock:
            ids = self._ids.get(key)
            if ids is None:
                return None
            self._ids.move_to_end(key)
            return ids.tolist()

    def put(self, text: str, ids: list[int]) -> None:
        stored = array("i", ids)
        size = stored.itemsize * len(stored)
        if size > self.max_bytes:
            return
        key = _key(text)
        with self._lock:
            if key in self._ids:
                return
            self._ids[key] = stored
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self._ids.popitem(last=False)
                self.bytes -= old.itemsize * len(old)


def _key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def check_documents(documents: Sequence[Document] | None) -> list[Document]:
    """The documents as a list, each a string or a sequence (of token ids, checked when they are
    read), the strings within `MAX_DOCUMENT_BYTES` and the sequences within `MAX_DOCUMENT_TOKENS` in
    all; refused by name before anything is tokenized."""
    if documents is None:
        return []
    if isinstance(documents, (str, bytes, bytearray)) or not isinstance(documents, Sequence):
        raise InvalidArgumentError("documents must be a list of documents (strings or lists of token ids)", "documents")
    text_bytes = given_tokens = 0
    for i, doc in enumerate(documents):
        check_not_bytes(doc, f"documents[{i}]")
        if isinstance(doc, str):
            text_bytes += len(check_text(doc, f"documents[{i}]").encode())
            if text_bytes > MAX_DOCUMENT_BYTES:
                raise InvalidArgumentError(
                    f"the documents' text comes to {text_bytes} bytes (UTF-8) by documents[{i}], over the limit of "
                    f"{MAX_DOCUMENT_BYTES} in all: {_CORPUS_ADVICE}",
                    "documents",
                )
        elif isinstance(doc, Sequence):
            given_tokens += len(doc)
            _check_document_tokens(given_tokens, f" of token ids by documents[{i}]")
        else:
            raise InvalidArgumentError(
                f"documents[{i}] must be a string or a list of token ids, got {type(doc).__name__}", "documents"
            )
    return list(documents)


def _check_document_tokens(tokens: int, where: str = "") -> None:
    """Refuse documents that come to more than `MAX_DOCUMENT_TOKENS` tokens (`where`: how far they were counted)."""
    if tokens > MAX_DOCUMENT_TOKENS:
        raise InvalidArgumentError(
            f"the documents come to {tokens} tokens{where}, over the limit of {MAX_DOCUMENT_TOKENS} in all: "
            + _CORPUS_ADVICE,
            "documents",
        )


def check_tools(tools: Any) -> list[dict]:
    """Tools in OpenAI's function format, each with a name and a JSON Schema object of parameters;
    anything else is refused here, naming the tool, rather than rendered into a prompt."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise InvalidArgumentError(f"tools must be a list of OpenAI-format function tools, got {type(tools).__name__}", "tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise InvalidArgumentError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}} '
                "with a name of letters, digits, '_', '.' or '-'",
                "tools",
            )
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object" or not isinstance(
            parameters.get("properties", {}), dict
        ):
            raise InvalidArgumentError(f"tool {name!r}: parameters must be a JSON Schema object with 'properties'", "tools")
        if name in names:
            raise InvalidArgumentError(f"tool {name!r} is given twice", "tools")
        names.add(name)
    return list(tools)


def tool_documents(tools: Sequence[dict] | None, messages: Sequence[dict]) -> list[str]:
    """What a call's arguments and an answer over tool results copy from: the tools' schemas and the
    tool results in the history, as documents for the drafters."""
    schemas = [json.dumps(tool, ensure_ascii=False) for tool in tools or ()]
    return schemas + [m["content"] for m in messages if isinstance(m, dict) and m.get("role") == "tool" and m.get("content")]
