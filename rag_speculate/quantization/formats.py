"""Weight-only quantized formats the CPU kernel reads (`cpu/linear.c`), and how weights get there.

Two formats, each a scale (and for 4 bits an offset) per group of 2**group_shift values along a row:

- q8: int8 values, w = scale * q;
- q4: 4-bit values in [0, 15], w = fma(q, scale, offset), packed two to a byte in the kernel's
  order (per 16 values, 8 bytes: the low dword holds the values at even places, the high one those
  at odd places, 4 bits each from the lowest).

A weight's fp32 value is computed once, exactly as written (one rounding), wherever it is read, and
is then summed as an fp32 weight: a quantized layer computes what an fp32 layer holding
`dequantize(weight)` computes. Scales and offsets are fp32, so a GGUF file's blocks (a half-precision
scale times a small integer) are held exactly (`quantization/gguf.py`).

    weight = quantize(linear.weight, "int4")   # QuantizedWeight, q4 in groups of 32
    dequantize(weight)                         # the fp32 weights the kernel multiplies by
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError

# group_shift for one group per row (per output channel): past any row's length.
PER_ROW = 62
# Values per group of our own 4-bit quantization: as fine as GGUF's Q4_K.
INT4_GROUP = 32


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] weight in one of the kernel's formats, on the CPU."""

    format: str  # "q8" or "q4"
    values: torch.Tensor  # q8: int8 [out, in]; q4: uint8 [out, in / 2], packed
    scale: torch.Tensor  # fp32 [out, groups]
    offset: torch.Tensor | None  # fp32 [out, groups] for q4, else None
    group_shift: int
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads: values, scales and offsets."""
        tensors = [self.values, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def quantize(weight: torch.Tensor, method: str, group: int = INT4_GROUP) -> QuantizedWeight:
    """`weight` [out, in] as "int8" (symmetric, one scale per output row) or "int4" (a scale and
    an offset per `group` values: the group's minimum and its range over 15 steps)."""
    w = weight.detach().to(torch.float32, copy=True).cpu()
    out_features, in_features = w.shape
    if method == "int8":
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        q = torch.round(w / torch.where(scale > 0, scale, 1)).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("q8", q.contiguous(), scale.contiguous(), None, PER_ROW, (out_features, in_features))
    if method == "int4":
        groups = w.reshape(out_features, in_features // group, group)
        low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
        scale = (high - low) / 15
        q = torch.round((groups - low) / torch.where(scale > 0, scale, 1)).clamp(0, 15).to(torch.uint8)
        return QuantizedWeight(
            "q4", pack_q4(q.reshape(out_features, in_features)), scale[..., 0].contiguous(), low[..., 0].contiguous(),
            group.bit_length() - 1, (out_features, in_features),
        )  # fmt: skip
    raise InvalidArgumentError(f"unknown quantization {method!r}: 'int8' or 'int4'", "quantization")


def fits(in_features: int, method: str, group: int = INT4_GROUP) -> str:
    """Why a layer of `in_features` inputs cannot take `method` ("" when it can): the kernel reads
    whole groups of 16 values."""
    if in_features % 16:
        return f"{in_features} inputs is not a multiple of 16"
    if method == "int4" and in_features % group:
        return f"{in_features} inputs is not a multiple of the group of {group}"
    return ""


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The fp32 weights the kernel multiplies by, bit for bit."""
    out_features, in_features = weight.shape
    group = min(1 << weight.group_shift, in_features)
    scale = weight.scale.repeat_interleave(group, dim=1)[:, :in_features]
    if weight.format == "q8":
        return weight.values.to(torch.float32) * scale
    offset = weight.offset.repeat_interleave(group, dim=1)[:, :in_features]
    q = unpack_q4(weight.values, in_features)
    # fma(q, scale, offset), rounded once: q * scale is exact in float64, and so is the sum for
    # the offsets and scales of one group, which are of a size.
    return (q.to(torch.float64) * scale.to(torch.float64) + offset.to(torch.float64)).to(torch.float32)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """[rows, n] values in [0, 15] (n a multiple of 16) packed in the kernel's order, [rows, n / 2]."""
    rows, n = q.shape
    pairs = q.to(torch.uint8).reshape(rows, n // 16, 8, 2)
    # Bytes 0-3 of each 8: the values at even places, two per byte, the lower place in the low bits.
    halves = [pairs[..., 0], pairs[..., 1]]
    packed = [h.reshape(rows, n // 16, 4, 2) for h in halves]
    packed = [p[..., 0] | (p[..., 1] << 4) for p in packed]
    return torch.cat(packed, dim=-1).reshape(rows, n // 2).contiguous()


def unpack_q4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_q4`'s inverse: [rows, n] values in [0, 15]."""
    rows = packed.shape[0]
    blocks = packed.reshape(rows, n // 16, 2, 4)
    halves = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(rows, n // 16, 2, 8)
    return torch.stack([halves[:, :, 0], halves[:, :, 1]], dim=-1).reshape(rows, n)
