"""The verification step in fixed shapes on a preallocated cache: `StaticStep`.

Every forward a step runs has one of a few shapes, buckets of rows (1, 2, 4, ... `rows`) by tokens
per row (1, 2, 4, ... `tokens`, the draft budget + 1): the rows a step feeds are padded to the next
bucket with rows of padding, and their tokens likewise. Every input is written in place into its
bucket's own buffers (token ids, positions, each row's length and whom its tokens see, which row it
reads, where each token writes) and sent to the device in two copies; the mask over the whole
capacity is built from them on the device, and the cache is written at fixed-shape indices and read
whole, as gpt-fast's static cache is. A bucket's forward so runs the same kernels on the same
tensors at every step, which a CUDA graph captures once and replays (`rag_speculate/cuda/graphs.py`
hands the step its `replay`). Keeping the accepted path moves entries at fixed-shape indices too.
The step reads nothing back to the host: a step's one read is the scheduler's
(`verify.greedy_choices`).

Rows of padding read the cache's spare row, and every padding token writes there, at its own place
in the step; nothing real reads it. A prompt's chunks, whose lengths follow the prompt, run through
`BatchForward` on the same cache (reading only the entries held), eagerly.

On a CPU the engine keeps the growing cache and `BatchForward` by default: the CPU kernels gain
from reading only the entries held, and there are no kernel launches to save; the engine's
`static_step=True` runs this step there too, which is how the CPU tests cover it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..errors import RagSpeculateError
from .batch import BatchCache, BatchForward, Fed
from .forward import shared_kv_heads
from .tree import capacity_mask, fed_depths, fed_visibility

Shape = tuple[int, int]  # a bucket: rows, tokens per row
# How a bucket's forward runs: given the bucket and the forward, its logits (CUDA graphs replay it).
Replay = Callable[[Shape, Callable[[], torch.Tensor]], torch.Tensor]


def buckets(largest: int) -> list[int]:
    """1, 2, 4, ... below `largest`, then `largest`."""
    return [1 << i for i in range(max(largest - 1, 0).bit_length()) if 1 << i < largest] + [largest]


def bucket(n: int, largest: int) -> int:
    """The smallest bucket up to `largest` that holds `n`."""
    if not 0 < n <= largest:
        raise RagSpeculateError(f"a fixed-shape step takes 1 to {largest}, not {n}")
    return min(largest, 1 << (n - 1).bit_length())


class _Buffers:
    """Named arrays of one dtype packed in one host tensor (pinned beside a GPU) and one device tensor:
    written on the host through numpy views, sent in one copy, read on the device through views that
    never move."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device):
        sizes = [math.prod(shape) for shape in shapes.values()]
        self.host = torch.zeros(sum(sizes), dtype=dtype, device="cpu", pin_memory=device.type == "cuda")
        self.device = torch.zeros(sum(sizes), dtype=dtype, device=device)
        # The host is written again only once the last copy from it is done (at once: a step's read waited for it).
        self._sent = torch.cuda.Event() if device.type == "cuda" else None
        host, spans = self.host.numpy(), list(zip(shapes.items(), np.cumsum([0, *sizes]), np.cumsum(sizes)))
        self.on_host = {name: host[a:b].reshape(shape) for (name, shape), a, b in spans}
        self.on_device = {name: self.device[a:b].view(shape) for (name, shape), a, b in spans}

    def writable(self) -> dict[str, np.ndarray]:
        """The host's arrays, once the last copy has read them."""
        if self._sent is not None:
            self._sent.synchronize()
        return self.on_host

    def send(self) -> None:
        """The host's arrays to the device's, in stream order (the host goes on without waiting)."""
        self.device.copy_(self.host, non_blocking=True)
        if self._sent is not None:
            self._sent.record()


class StaticStep:
    """Verification forwards over rows of a preallocated `BatchCache` (built with `rows` and
    `capacity`) in bucketed shapes, and the keeping of their accepted entries; `replay` runs each
    bucket's forward (None: eagerly)."""

    def __init__(self, forward: BatchForward, cache: BatchCache, tokens: int, replay: Replay | None = None):
        if cache.fixed_rows is None or cache.capacity < tokens:
            raise RagSpeculateError(f"a fixed-shape step needs a preallocated cache of rows with room for {tokens} tokens")
        self.forward, self.cache, self.tokens = forward, cache, tokens
        self.replay: Replay = replay or (lambda shape, run: run())
        self._inputs: dict[Shape, tuple[_Buffers, _Buffers]] = {}
        self._moves: dict[Shape, _Buffers] = {}

    def shapes(self) -> list[Shape]:
        """Every bucket a step may run in."""
        return [(b, q) for b in buckets(self.cache.fixed_rows) for q in buckets(self.tokens)]

    def shape(self, rows: int, tokens: int) -> Shape:
        return bucket(rows, self.cache.fixed_rows), bucket(tokens, self.tokens)

    @torch.inference_mode()
    def __call__(self, inputs: Sequence[Fed]) -> list[torch.Tensor]:
        """Logits `[len(tokens), vocab]` per input, in order, as `BatchForward` gives them; views of the
        bucket's output, valid until its next forward."""
        shape = self.shape(len(inputs), max(len(item.tokens) for item in inputs))
        logits = self._run(shape, inputs)
        return [logits[b, : len(item.tokens)] for b, item in enumerate(inputs)]

    @torch.inference_mode()
    def padding(self, shape: Shape) -> torch.Tensor:
        """A step of the bucket over padding alone, its buffers written and sent as any step's are: it
        costs what a step in that bucket costs (every row's whole capacity is read, whatever it holds)
        and writes only the spare row, so the engine's cost curve times it between steps."""
        return self._run(shape, [])

    def _run(self, shape: Shape, inputs: Sequence[Fed]) -> torch.Tensor:
        """The bucket's forward over `inputs`, the rest of it padding; its logits `[rows, tokens, vocab]`."""
        cache = self.cache
        ints, seen = (buffers.writable() for buffers in self._buffers(shape))
        self._pad(ints, seen)
        for b, item in enumerate(inputs):
            n, start = len(item.tokens), cache.lengths[item.row]
            if start + n > cache.capacity:
                raise RagSpeculateError(f"row {item.row} holds {start} entries: {n} more overflow its {cache.capacity}")
            ints["ids"][b, :n] = item.tokens
            ints["positions"][b] = start  # padding at the row's next position: any will do, none overflows
            ints["positions"][b, :n] += fed_depths(item.parents, n)
            ints["lengths"][b], ints["read"][b], ints["write_row"][b, :n] = start, item.row, item.row
            ints["write_at"][b, :n] = start + np.arange(n)
            seen["visible"][b, :n, :n] = fed_visibility(item.parents, n)
        for buffers in self._inputs[shape]:
            buffers.send()
        return self.bucket(shape)()

    def bucket(self, shape: Shape) -> Callable[[], torch.Tensor]:
        """The bucket's forward as a step runs it (through `replay`), on its buffers as they stand: all
        padding until a step fills them, so running it alone, as a benchmark times it, writes only the
        spare row."""
        ints, seen = (buffers.on_device for buffers in self._buffers(shape))
        cache, forward = self.cache, self.forward

        def run() -> torch.Tensor:
            cache.fix(ints["read"], ints["write_row"], ints["write_at"])
            mask = capacity_mask(ints["lengths"], seen["visible"], cache.capacity, forward.mask_dtype)
            with shared_kv_heads(forward.device):
                return forward.logits(cache, input_ids=ints["ids"], position_ids=ints["positions"], attention_mask=mask)

        return lambda: self.replay(shape, run)

    @torch.inference_mode()
    def keep(self, kept: dict[int, list[int]]) -> None:
        """`BatchCache.keep`, moving entries at a bucket's fixed-shape indices."""
        kept = {row: offsets for row, offsets in kept.items() if offsets}
        if not kept:
            return
        shape = self.shape(len(kept), max(len(offsets) for offsets in kept.values()))
        if shape not in self._moves:
            self._moves[shape] = _Buffers({"moves": (3, *shape)}, torch.int64, self.cache.device)
        buffers = self._moves[shape]
        moves = buffers.writable()["moves"]
        moves[:] = 0
        moves[0] = self.cache.spare_row  # rows beyond those kept move the spare row's first entry onto itself
        self.cache.keep_moves(kept, moves)
        buffers.send()
        self.cache.move(*buffers.on_device["moves"])
        self.cache.advance_kept(kept)

    def _buffers(self, shape: Shape) -> tuple[_Buffers, _Buffers]:
        """The bucket's input buffers (made on first use, all padding), the integers and whom each token sees."""
        if shape not in self._inputs:
            b, q = shape
            device = self.cache.device
            ints = _Buffers({"ids": (b, q), "positions": (b, q), "lengths": (b,), "read": (b,), "write_row": (b, q),
                             "write_at": (b, q)}, torch.int64, device)  # fmt: skip
            seen = _Buffers({"visible": (b, q, q)}, torch.bool, device)
            self._pad(ints.on_host, seen.on_host)
            ints.send()
            seen.send()
            self._inputs[shape] = ints, seen
        return self._inputs[shape]

    def _pad(self, ints: dict[str, np.ndarray], seen: dict[str, np.ndarray]) -> None:
        """Every row padding: token 0 at position 0 of the spare row, each token writing there at its
        own place and seeing only that place."""
        for name in ("ids", "positions", "lengths"):
            ints[name][:] = 0
        for name in ("read", "write_row"):
            ints[name][:] = self.cache.spare_row
        ints["write_at"][:] = np.arange(ints["write_at"].shape[1])
        seen["visible"][:] = np.eye(seen["visible"].shape[1], dtype=bool)
