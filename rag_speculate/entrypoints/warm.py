"""Prompts to prefill before a server takes requests (`rag-speculate serve --warm FILE`): the system
prompt, tool schemas and passages that later requests begin with, so that their first request hits
the prompt cache (and, with `--prompt-cache-dir`, so does every replica's).

FILE is JSON Lines, one prompt a line: a string, text to complete as /v1/completions takes a prompt;
or an object with "prompt" (the same) or "messages" (a chat, as /v1/chat/completions takes it).
Each is built into token ids by the server's own prompt builder (`prompt.py`), so what is warmed is
what a request with that prompt begins with. Blank lines are skipped. A line that is none of these
is an error naming it, before the server starts; so is a prompt the engine refuses, when it is warmed.

    {"messages": [{"role": "system", "content": "Answer from the passages."}, {"role": "user", "content": "..."}]}
    "Passages:\n[1] The Eiffel Tower ..."
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import SpeculativeEngine
from ..errors import InvalidArgumentError
from ..files.durable import os_reason
from .prompt import prepare


@dataclass(frozen=True)
class WarmPrompt:
    """One line of a warm file: its number and the prompt (text, or a chat's messages)."""

    line: int
    prompt: str | tuple[dict, ...]

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)


def read_warm_file(path: str | os.PathLike) -> tuple[WarmPrompt, ...]:
    """The prompts of a warm file; InvalidArgumentError naming the file and the line at fault."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = os_reason(error) if isinstance(error, OSError) else "it is not UTF-8 text"
        raise InvalidArgumentError(f"warm file {path} cannot be read: {reason}", "warm") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompts.append(_prompt(number, json.loads(line)))
        except (ValueError, RecursionError, _BadLine) as error:
            raise InvalidArgumentError(f"warm file {path}, line {number}: {error}", "warm") from None
    return tuple(prompts)


class _BadLine(Exception):
    """A line that is not a prompt; the message says why."""


def _prompt(number: int, item: Any) -> WarmPrompt:
    if isinstance(item, str):
        return WarmPrompt(number, item)
    if not isinstance(item, dict):
        raise _BadLine(f'expected a string or an object with "prompt" or "messages", got {type(item).__name__}')
    if set(item) not in ({"prompt"}, {"messages"}):
        raise _BadLine(f'an object needs "prompt" or "messages", and nothing else; got {sorted(item)}')
    if "prompt" in item:
        if not isinstance(item["prompt"], str):
            raise _BadLine('"prompt" must be a string')
        return WarmPrompt(number, item["prompt"])
    messages = item["messages"]
    if not isinstance(messages, list) or not messages or not all(_message(m) for m in messages):
        raise _BadLine('"messages" must be a list of {"role": ..., "content": "..."} objects')
    return WarmPrompt(number, tuple(messages))


def _message(message: Any) -> bool:
    return (
        isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)
    )


def warm(engine: SpeculativeEngine, prompts: Sequence[WarmPrompt], source: str = "warm file") -> int:
    """Prefill each prompt in `engine`'s prompt cache (`PromptCache.warm`); the prompt tokens prefilled.
    A prompt the engine refuses is an InvalidArgumentError naming its line."""
    prefilled = 0
    for item in prompts:
        try:
            ids = prepare(engine, list(item.prompt) if item.chat else item.prompt, chat=item.chat).request.prompt_ids
            prefilled += engine.prompt_cache.warm([ids], chat=False)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{source}, line {item.line}: {error}", "warm") from None
    return prefilled
