"""One generation's arguments, checked when the call is made: every bad value is refused by name."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError, argument_of
from .sampling import SamplingParams

# The roles chat templates render; a conversation ends with the turn the model answers.
CHAT_ROLES = ("system", "user", "assistant", "tool")
ANSWERED_ROLES = ("user", "tool")


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    document_ids: list[list[int]]
    max_new_tokens: int
    sampling: SamplingParams
    stop: list[str]
    seed: int | None


def check_text(value: str, what: str) -> str:
    """Text that encodes to UTF-8 (no lone surrogates, which no tokenizer can read)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{what} is not valid Unicode text ({exc.reason} at position {exc.start})", argument_of(what)
        ) from None
    return value


def check_seed(seed: Any) -> int | None:
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
        raise InvalidArgumentError(f"seed must be None or an integer in [0, 2**64), got {seed!r}", "seed")
    return seed


def _number(value: Any, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidArgumentError(f"{what} must be a finite number, got {value!r}", what)
    return float(value)


def sampling_params(temperature: Any, top_p: Any, top_k: Any) -> SamplingParams:
    temperature, top_p = _number(temperature, "temperature"), _number(top_p, "top_p")
    if temperature < 0:
        raise InvalidArgumentError(f"temperature must be >= 0 (0 is greedy), got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise InvalidArgumentError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise InvalidArgumentError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}", "top_k")
    return SamplingParams(temperature, top_p, top_k)


def stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if not isinstance(stop, (str, Sequence)) or isinstance(stop, (bytes, bytearray)):
        raise InvalidArgumentError(f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise InvalidArgumentError(f"stop must be a non-empty string or a list of them, got {s!r}", "stop")
        check_text(s, "stop")
    return stops


def check_messages(messages: list[Any]) -> list[dict]:
    """Chat messages a template can render: known roles, string contents, a turn to answer last
    (every entrance's history goes through this one check)."""
    if not messages:
        raise InvalidArgumentError("the chat has no messages: it needs at least one message", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidArgumentError(f"each chat message needs string 'role' and 'content', got {m!r}", "messages")
        if m["role"] not in CHAT_ROLES:
            raise InvalidArgumentError(f"messages[{i}] has role {m['role']!r}; roles are {', '.join(CHAT_ROLES)}", "messages")
        check_text(m["content"], f"messages[{i}].content")
    if not any(m["role"] == "user" for m in messages):
        raise InvalidArgumentError("the chat messages have no user turn", "messages")
    if messages[-1]["role"] not in ANSWERED_ROLES:
        raise InvalidArgumentError(
            f"the chat messages end with a {messages[-1]['role']!r} turn; the chat history must end with a user "
            "message or a tool result, the turn the model answers",
            "messages",
        )
    if messages[-1]["role"] == "user" and not messages[-1]["content"].strip():
        raise InvalidArgumentError("the last user message is empty", "messages")
    return messages


def check_not_bytes(value: Any, what: str) -> None:
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(
            f"{what} must be text (str) or a list of int token ids, got {type(value).__name__}", argument_of(what)
        )
