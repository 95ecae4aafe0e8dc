"""Cutting a document into overlapping chunks of target-model tokens."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class ChunkingOptions:
    """How an index is built: the chunks, and the FAISS index over their vectors (IVF where a
    linear scan of a large corpus is too slow)."""

    chunk_tokens: int = 256
    chunk_overlap: int = 32
    ivf_lists: int = 0  # 0: exact inner product; n: IVF with n lists
    ivf_probe: int = 8

    def check(self) -> None:
        for name in ("chunk_tokens", "chunk_overlap", "ivf_lists", "ivf_probe"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"{name} must be an integer >= 0, got {value!r}")
        if self.chunk_tokens < 1 or self.chunk_overlap >= self.chunk_tokens:
            raise InvalidArgumentError(
                f"need chunk_tokens >= 1 and chunk_overlap < chunk_tokens, got {self.chunk_tokens} and {self.chunk_overlap}"
            )
        if self.ivf_probe < 1:
            raise InvalidArgumentError(f"ivf_probe must be >= 1, got {self.ivf_probe}")


def chunk_document(
    text: str, tokenizer: PreTrainedTokenizerBase, options: ChunkingOptions
) -> tuple[list[int], list[tuple[str, list[int]]]]:
    """The document's token ids, and its chunks as (text, token ids).

    A fast tokenizer's character offsets cut each chunk's text out of the source, so what the
    prompt shows is the source's own text; a slow one's chunks are decoded instead.
    """
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
    ids = encoded["input_ids"]
    step = options.chunk_tokens - options.chunk_overlap
    pieces = []
    for start in range(0, max(len(ids) - options.chunk_overlap, 1), step):
        piece = ids[start : start + options.chunk_tokens]
        if tokenizer.is_fast:
            offsets = encoded["offset_mapping"]
            chunk_text = text[offsets[start][0] : offsets[start + len(piece) - 1][1]]
        else:
            chunk_text = tokenizer.decode(piece)
        pieces.append((chunk_text.strip(), piece))
    return ids, pieces
