"""Checking JSON read back from disk before it is used: against a schema of its fields (`fields`,
`integer`, `text`, ...), each failure a `FieldError` naming the field, and for nesting too deep to parse
(`load_json`, `too_deep`)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any


def load_json(data: str | bytes) -> Any:
    """Parsed JSON; nesting too deep for the parser is malformed JSON too (`ValueError`)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


# A JSON token for `nesting`: a string, a bracket, or a run of anything else (numbers, commas, colons, blanks).
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]|[^"\[\]{}]+')


def too_deep(data: str | bytes, limit: int) -> list[str | int] | None:
    """Where JSON `data` first nests more than `limit` arrays and objects deep: the keys and indexes
    that lead there, or None if it never does. A scan rather than a parse, so it is safe where
    parsing would recurse past Python's limit; nothing but the nesting is checked."""
    data = data.encode() if isinstance(data, str) else data
    if data.count(b"[") + data.count(b"{") <= limit:
        return None
    path: list[str | int | None] = []
    for match in _JSON_TOKEN.finditer(data):
        token = match.group()
        first = token[:1]
        if first == b'"':
            if path and path[-1] is None:  # an object's key
                path[-1] = token[1:-1].decode(errors="replace")
        elif first in (b"[", b"{"):
            path.append(0 if first == b"[" else None)
            if len(path) > limit:
                return path
        elif first in (b"]", b"}"):
            if not path:
                return None
            path.pop()
        elif path and b"," in token:
            path[-1] = path[-1] + token.count(b",") if isinstance(path[-1], int) else None
    return None


class FieldError(Exception):
    """A field read back is missing or has the wrong type or value; the message names the field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field {field or '(top level)'} {problem}")
        self.field = field


# A check takes a value and the field's name, and raises FieldError if the value is not allowed.
Check = Callable[[Any, str], None]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def integer(low: int = 0, high: int | None = None) -> Check:
    """An int (not a bool) in [low, high]."""

    def check(value: Any, field: str) -> None:
        if type(value) is not int or value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise FieldError(field, f"must be an integer {bound}, got {_shown(value)}")

    return check


def text(pattern: str | None = None) -> Check:
    """A string, matching `pattern` (a regex) if given."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, str) or (pattern is not None and not re.fullmatch(pattern, value)):
            kind = "a string" if pattern is None else f"a string matching {pattern}"
            raise FieldError(field, f"must be {kind}, got {_shown(value)}")

    return check


SHA256 = text(r"[0-9a-f]{64}")


def of_type(*types: type) -> Check:
    """An instance of one of `types` (a bool is no int here)."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise FieldError(field, f"must be {names}, got {_shown(value)}")

    return check


def optional(inner: Check) -> Check:
    """None, or what `inner` allows."""

    def check(value: Any, field: str) -> None:
        if value is not None:
            inner(value, field)

    return check


def list_of(item: Check, length: int | None = None) -> Check:
    """A list of items `item` allows, of `length` items if given."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, list) or (length is not None and len(value) != length):
            raise FieldError(field, f"must be a list{'' if length is None else f' of {length}'}, got {_shown(value)}")
        for i, entry in enumerate(value):
            item(entry, f"{field}[{i}]")

    return check


def mapping(name: Check, value: Check) -> Check:
    """A JSON object of any fields, each name allowed by `name` and each value by `value`."""

    def check(obj: Any, field: str) -> None:
        if not isinstance(obj, dict):
            raise FieldError(field, f"must be an object, got {_shown(obj)}")
        for key, entry in obj.items():
            name(key, f"{field} (a name)")
            value(entry, f"{field}.{key}")

    return check


def fields(schema: dict[str, Check]) -> Check:
    """A JSON object with (at least) every field of `schema`, each allowed by its check."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, dict):
            raise FieldError(field, f"must be an object, got {_shown(value)}")
        for name, inner in schema.items():
            inner_field = f"{field}.{name}" if field else name
            if name not in value:
                raise FieldError(inner_field, "is missing")
            inner(value[name], inner_field)

    return check
