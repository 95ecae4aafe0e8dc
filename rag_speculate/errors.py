"""The project's exceptions: catch `RagSpeculateError` to catch everything this library raises on purpose."""


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
    """A packaged model is missing or corrupt; the message gives the command that fixes it."""
