"""Quantized formats the CPU kernels read (`cpu/linear_q8.c`, `cpu/linear.c`), and how weights get there.

Two formats, each a scale (and for 4 bits an offset) per group of 2**group_shift values along a row:

- q8: int8 values, w = scale * q, multiplied by int8 activations: each row of x is quantized on
  its own per block of the weights' group, at least 32 and at most 128 values
  (`quantize_activations`; 32 is how llama.cpp quantizes them for its Q8_0 products), so the
  products are integer dot products, scaled once a block;
- q4: 4-bit values in [0, 15], w = fma(q, scale, offset), packed two to a byte in the kernel's
  order (per 16 values, 8 bytes: the low dword holds the values at even places, the high one those
  at odd places, 4 bits each from the lowest), multiplied by activations in the model's dtype.

Either way a row's result depends on that row alone, so speculation over a quantized model gives
exactly what `generate` of the same quantized model gives. For q4 a weight's fp32 value is computed
once, exactly as written, and summed as an fp32 weight: the layer computes what an fp32 layer
holding `dequantize(weight)` computes. Scales and offsets are fp32, so a GGUF file's blocks (a
half-precision scale times a small integer) are held exactly (`quantization/gguf.py`).

    weight = quantize(linear.weight, "int4")   # QuantizedWeight, q4 in groups of 32
    dequantize(weight)                         # the fp32 weights the kernels multiply by
    quantize(linear.weight, "int8").group      # 128 where the layer's inputs allow it
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cpu.linear import activation_block
from ..errors import InvalidArgumentError

# Values per group of our own 4-bit quantization: as fine as GGUF's Q4_K.
GROUP = 32
# Values per group of our own int8 quantization, and so per activation block, the largest that
# divides a layer's inputs. On AVX2 a block's scaling costs as much as its integer products, so
# blocks of 128 compute faster than Q8_0's of 32 (docs/design.md: how much, and what it costs in
# quality).
INT8_GROUPS = (128, 64, 32)


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] weight in one of the kernel's formats, on the CPU."""

    format: str  # "q8" or "q4"
    values: torch.Tensor  # q8: int8 [out, in] in [-128, 127]; q4: uint8 [out, in / 2], packed
    scale: torch.Tensor  # fp32 [out, groups]
    offset: torch.Tensor | None  # fp32 [out, groups] for q4, else None
    group_shift: int
    shape: tuple[int, int]

    @property
    def group(self) -> int:
        return 1 << self.group_shift

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads: values, scales and offsets."""
        tensors = [self.values, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def quantize(weight: torch.Tensor, method: str, group: int | None = None) -> QuantizedWeight:
    """`weight` [out, in] as "int8" (symmetric, a scale per `group` values: its largest magnitude
    over 127, as GGUF's Q8_0 for groups of 32; by default the largest of `INT8_GROUPS` that divides
    the inputs) or "int4" (a scale and an offset per `group` values, by default 32: the group's
    minimum and its range over 15 steps)."""
    if method not in ("int8", "int4"):
        raise InvalidArgumentError(f"unknown quantization {method!r}: 'int8' or 'int4'", "quantization")
    w = weight.detach().to(torch.float32, copy=True).cpu()
    out_features, in_features = w.shape
    group = group or default_group(in_features, method)
    groups = w.reshape(out_features, in_features // group, group)
    shift = group.bit_length() - 1
    if method == "int8":
        scale = groups.abs().amax(dim=2, keepdim=True) / 127
        q = torch.round(groups / torch.where(scale > 0, scale, 1)).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("q8", q.reshape(out_features, in_features).contiguous(), scale[..., 0].contiguous(), None, shift,
                               (out_features, in_features))  # fmt: skip
    low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    scale = (high - low) / 15
    q = torch.round((groups - low) / torch.where(scale > 0, scale, 1)).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(
        "q4", pack_q4(q.reshape(out_features, in_features)), scale[..., 0].contiguous(), low[..., 0].contiguous(),
        shift, (out_features, in_features),
    )  # fmt: skip


def default_group(in_features: int, method: str) -> int:
    """The group `quantize` uses for a layer of `in_features` inputs."""
    if method == "int8":
        return next((g for g in INT8_GROUPS if in_features % g == 0), INT8_GROUPS[-1])
    return GROUP


def fits(in_features: int, method: str, group: int | None = None) -> str:
    """Why a layer of `in_features` inputs cannot take `method` ("" when it can): the kernels read
    whole groups, and int8 activations come in blocks of at least 32."""
    group = group or default_group(in_features, method)
    block = activation_block(group.bit_length() - 1)
    if method == "int8" and in_features % block:
        return f"{in_features} inputs is not a multiple of the activation block of {block}"
    if in_features % group:
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


def quantize_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Activations `x` [..., in] as a q8 layer sees them, in fp32: each row per `block` values
    (`activation_block`), d = max|x| / 127 and q = round(x * (127 / max|x|)) (ties to even), as
    `linear_q8.c` quantizes them; here q * d (the kernel keeps q and d apart and sums q's integer
    products)."""
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], -1, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0))
    return (q * (amax / 127)).reshape(x.shape)


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
