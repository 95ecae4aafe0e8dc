"""The project's exceptions: catch `RagSpeculateError` to catch everything this library raises on purpose.
Also the argument checks every floor shares, which raise them."""

from __future__ import annotations

from typing import Any


class RagSpeculateError(Exception):
    """Base class of every error raised on purpose by rag_speculate."""


class InvalidArgumentError(RagSpeculateError, ValueError):
    """An argument is outside its allowed range. The message names the argument and the range;
    `argument` holds the argument's name (None where no single one is at fault), so that a caller
    maps it to its own field (a server's request field, say) without reading the message."""

    def __init__(self, message: str, argument: str | None = None):
        super().__init__(message)
        self.argument = argument


class CorpusIndexError(RagSpeculateError):
    """An index cannot be built or loaded; the message names the folder, the problem and the fix."""


class ModelPackageError(RagSpeculateError):
    """A model does not load: a packaged model missing or corrupt (the message gives the command that
    fixes it), or a model file, folder or hub id that is missing or not a usable model (the message
    names it and what is wrong)."""


def argument_of(what: str) -> str:
    """The argument a place inside one names: "documents" for "documents[3]"."""
    return what.split("[", 1)[0].split(".", 1)[0]


def check_int(value: Any, what: str, least: int) -> int:
    """`value`, an int (not a bool) of at least `least`; else InvalidArgumentError naming `what`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise InvalidArgumentError(f"{what} must be an integer >= {least}, got {value!r}", argument_of(what))
    return value
