"""The requests the server reads: OpenAI's chat and text completion bodies, plus two extension fields.

Every field of OpenAI's API is known here. Those the engine honours are read (`tool_choice` and
`response_format` through the prompt: `decoding/instructions.py`); those it cannot honour
are refused with a 400 naming them unless they hold their neutral value (`n=1`, `logprobs=false`,
...), so a client that sends defaults explicitly still works and one that asks for more is told so;
informational fields (`user`, `metadata`, ...) are accepted and ignored. A field OpenAI does not
know is refused, as OpenAI's own API does, and so is a value of another JSON type than the field's
(strict mode: `"10"`, `true` or `2.0` for `max_tokens`, `1` for `stream`), as OpenAI's API is strict
about them; an integer is a number, as in JSON.

The extensions: `documents`, texts the drafters copy from (the retrieved passages, when the client
retrieves), and `retrieve`, how many chunks to fetch from the server's index for the last user turn.

    {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Who wrote Hamlet?"}],
     "max_tokens": 64, "documents": ["Hamlet is a tragedy written by William Shakespeare ..."]}
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..tool_calls import template_tool_call, unencodable

# Chat messages whose "developer" role (OpenAI's newer name for system) chat templates do not know.
ROLE_ALIASES = {"developer": "system"}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    # Messages echoed back from an earlier response carry fields such as "refusal" or "annotations".
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        return self

    def template_message(self, where: str) -> dict[str, Any]:
        """The message (`where`: its place, "messages.1") as chat templates read it: plain text content,
        and the tool calls with their arguments as objects (`InvalidArgumentError` naming the field if
        they are not JSON)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": ROLE_ALIASES.get(self.role, self.role), "content": text}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            functions = [call.get("function") if isinstance(call.get("function"), dict) else {} for call in self.tool_calls]
            out["tool_calls"] = [
                template_tool_call(call.get("id"), f.get("name"), f.get("arguments", {}), f"{where}.tool_calls.{j}")
                for j, (call, f) in enumerate(zip(self.tool_calls, functions))
            ]
        return out


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extension, which clients of OpenAI-compatible servers already send (-1 or 0: off).
    top_k: int = Field(default=0, ge=-1)
    # The extension: texts to draft from (a chat request may also `retrieve`).
    documents: list[str] | None = None
    # Informational in OpenAI's API; nothing here depends on them.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # Honoured only at their neutral value (see `_neutral`).
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        """Refuse text that is not valid Unicode anywhere in the body, naming where, before any field
        is read: nothing after this point (the messages, which a tool call's arguments are parsed from,
        the tools, the schemas, the stop strings, the documents, the error messages) has to expect it."""
        found = unencodable(data)
        if found is not None:
            path, reason = found
            field = ".".join(map(str, path)) or None
            raise RequestError(field, f"{field or 'the body'} is not valid Unicode text ({reason})")
        return data

    @field_validator("stop")
    @classmethod
    def _stop_entries(cls, stop: str | list[str] | None) -> str | list[str] | None:
        entries = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in entries):
            raise ValueError("stop entries must be non-empty strings")
        if len(entries) > 16:
            raise ValueError("at most 16 stop strings")
        return stop

    @field_validator("documents")
    @classmethod
    def _documents(cls, documents: list[str] | None) -> list[str] | None:
        if documents is not None and len(documents) > 256:
            raise ValueError("at most 256 documents")
        # Their size in bytes and tokens is the engine's to bound (engine/inputs.py), for every entrance.
        return documents

    @model_validator(mode="after")
    def _neutral(self) -> _Common:
        """Refuse, by name, what would change the answer in a way this server cannot honour."""
        neutral = {
            "n": (None, 1), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
            "logit_bias": (None, {}), "logprobs": (None, False, 0),
        } | self._more_neutral()
        for name, allowed in neutral.items():
            if getattr(self, name) not in allowed:
                message = f"{name}={getattr(self, name)!r} is not supported by this server"
                raise RequestError(name, message, "unsupported_parameter")
        return self

    def _more_neutral(self) -> dict[str, tuple]:
        return {}


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    retrieve: int | None = Field(default=None, ge=1, le=100)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    def _more_neutral(self) -> dict[str, tuple]:
        return {
            "top_logprobs": (None, 0), "modalities": (None, ["text"]),
            "reasoning_effort": (None,), "audio": (None,), "prediction": (None,),
            "web_search_options": (None,), "functions": (None,), "function_call": (None,),
        }

    @property
    def answer_limit(self) -> tuple[str, int | None]:
        """The field that bounds the answer's tokens (OpenAI's newer max_completion_tokens where set) and its value."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(_Common):
    # One prompt: text, or token ids; a list holding one of those is read as it.
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("this server completes one prompt per request; send a list of one")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt

    def _more_neutral(self) -> dict[str, tuple]:
        return {"echo": (None, False), "best_of": (None, 1), "suffix": (None, "")}

    @property
    def answer_limit(self) -> tuple[str, int | None]:
        """The field that bounds the answer's tokens and its value."""
        return "max_tokens", self.max_tokens


class RequestError(ValueError):
    """A request the server refuses (HTTP 400); `param` names the field at fault, as OpenAI's errors do,
    and `code` says why where OpenAI has a code for it ("unsupported_parameter": a known field set to
    a value this server cannot honour). Raised while a body is validated, pydantic carries it to the
    error handler whole."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


# Every field name a request can hold, to tell them from the union members in a validation error's path.
FIELD_NAMES = frozenset().union(
    *(m.model_fields for m in (ChatCompletionRequest, CompletionRequest, Message, TextPart, StreamOptions))
)
