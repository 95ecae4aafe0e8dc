"""The project's exceptions: catch `RagSpeculateError` to catch everything this library raises on purpose."""


class RagSpeculateError(Exception):
    """Base class of every error raised on purpose by rag_speculate."""


class InvalidArgumentError(RagSpeculateError, ValueError):
    """An argument is outside its allowed range; the message names the argument and the range."""


class ModelPackageError(RagSpeculateError):
    """A packaged model is missing or corrupt; the message gives the command that fixes it."""
