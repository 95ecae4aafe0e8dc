"""The generated tokens and text, and where generation must end.

Tokens are taken one at a time so that EOS, a stop string or `max_new_tokens` end generation at
exactly the token plain decoding would end at, even when a verification step accepted more.
Streamed text holds back anything that could still become a stop string or half a character.
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedModel, PreTrainedTokenizerBase


class OutputTracker:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: frozenset[int],
        stop: list[str],
        max_new_tokens: int,
    ):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.stop = stop
        self.max_new_tokens = max_new_tokens
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._text = ""
        self._stop_at: int | None = None
        self._emitted = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def extend(self, tokens: Iterable[int]) -> int:
        """Append tokens until generation must end; returns how many were taken."""
        taken = 0
        for token in tokens:
            if self.done:
                break
            self.token_ids.append(token)
            taken += 1
            if token in self.eos_token_ids:
                self.finish_reason = "eos"
            elif self.stop and self._hit_stop():
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
        self._text = self._decode()
        return taken

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _hit_stop(self) -> bool:
        previous = len(self._text)
        self._text = self._decode()
        # Only a match that this token completed counts: earlier text was already checked.
        window = max(0, previous - max(map(len, self.stop)))
        hits = [i for i in (self._text.find(s, window) for s in self.stop) if i >= 0]
        if hits:
            self._stop_at = min(hits)
        return bool(hits)

    @property
    def text(self) -> str:
        return self._text if self._stop_at is None else self._text[: self._stop_at]

    def delta(self) -> str:
        """New text that is safe to show: never part of a stop string, never half a character."""
        text = self.text
        end = len(text)
        if not self.done:
            end -= self._held_back(text)
        piece = text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return piece

    def _held_back(self, text: str) -> int:
        if text.endswith("\ufffd"):
            # A multi-byte character whose remaining bytes are still to come.
            return len(text) - len(text.rstrip("\ufffd"))
        for size in range(min(len(text), max(map(len, self.stop), default=0)), 0, -1):
            if any(s.startswith(text[-size:]) for s in self.stop):
                return size
        return 0


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids `generate` stops at: the generation config's, else the tokenizer's."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
