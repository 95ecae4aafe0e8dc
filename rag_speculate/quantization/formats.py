"""Quantized formats the CPU kernels read (`cpu/linear_q8.c`, `cpu/linear_q4.c`), and how weights get there.

Three formats, all multiplied by int8 activations: each row of x is quantized on its own, per block
(`quantize_activations`), so the products are integer dot products, scaled once a block:

- q8: int8 values with a scale per group of 2**group_shift values along a row, w = scale * q; the
  activations in blocks of the group, at least 32 and at most 128 values (32 is how llama.cpp
  quantizes them for its Q8_0 products);
- q4: GGUF's Q4_K. A row in super-blocks of 2**group_shift values (256; 128 or 64 where the inputs
  need it), each with an fp32 scale d and offset o, cut into sub-blocks of 32 with a 6-bit scale sc
  and minimum m (`sub`: the super-block's scales, then its minimums): w = d sc q + o m, q in [0, 15],
  two to a byte as Q4_K packs them (each 64 values in 32 bytes, the first 32 in the low nibbles);
  the activations in blocks of the super-block, as llama.cpp's Q8_K;
- q6: GGUF's Q6_K, which only GGUF files hold (`quantization/gguf.py`): super-blocks of 256 with an
  fp32 d, sub-blocks of 16 with a signed 8-bit scale sc (`sub`), w = d sc (q - 32), q in [0, 63] in
  6 bits (`pack_q6`: q4's nibbles, then the high 2 bits); the 4-bit kernel runs it as q4 with m = sc
  and o = -32 d (`offset`).

Either way a row's result depends on that row alone, so speculation over a quantized model gives
exactly what `generate` of the same quantized model gives. Scales are fp32, so a GGUF file's blocks
(half-precision scales times small integers) are held exactly (`quantization/gguf.py`).

    weight = quantize(linear.weight, "int4")   # QuantizedWeight, q4 in super-blocks of 256
    dequantize(weight)                         # the weights the kernels multiply by
    quantize(linear.weight, "int8").group      # 128 where the layer's inputs allow it
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cpu.linear import Q4_SIZES, activation_block
from ..errors import InvalidArgumentError

# Values per 4-bit sub-block, each with its own 6-bit scale and minimum (Q4_K's).
SUB = 32
# Values per group of our own int8 quantization, and so per activation block, the largest that
# divides a layer's inputs. On AVX2 a block's scaling costs as much as its integer products, so
# blocks of 128 compute faster than Q8_0's of 32 (docs/design.md: how much, and what it costs in
# quality).
INT8_GROUPS = (128, 64, 32)


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] weight in one of the kernel's formats, on the CPU."""

    format: str  # "q8", "q4" or "q6"
    values: torch.Tensor  # q8: int8 [out, in] in [-128, 127]; q4: uint8 [out, in / 2], packed; q6: uint8 [out, 3 in / 4], packed
    scale: torch.Tensor  # fp32 [out, groups]
    offset: torch.Tensor | None  # fp32 [out, groups] for q4 and q6, else None
    group_shift: int
    shape: tuple[int, int]
    # [out, in / 16]: q4 uint8, per super-block its sub-blocks' scales, then minimums; q6 int8, its sub-blocks' scales
    sub: torch.Tensor | None = None

    @property
    def group(self) -> int:
        return 1 << self.group_shift

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads: values, scales and offsets."""
        tensors = [t for t in (self.values, self.scale, self.offset, self.sub) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def quantize(weight: torch.Tensor, method: str, group: int | None = None) -> QuantizedWeight:
    """`weight` [out, in] as "int8" (symmetric, a scale per `group` values: its largest magnitude
    over 127, as GGUF's Q8_0 for groups of 32; by default the largest of `INT8_GROUPS` that divides
    the inputs) or "int4" (Q4_K in super-blocks of `group` values, by default the largest of
    `Q4_SIZES` that divides the inputs: each sub-block's minimum, at most 0, and range over 15 steps,
    as 6-bit multiples of the super-block's half-precision d and dmin, rounded up; a value comes back
    within half a step, or within dmin where the rounded minimum lifts it past 15 steps)."""
    if method not in ("int8", "int4"):
        raise InvalidArgumentError(f"unknown quantization {method!r}: 'int8' or 'int4'", "quantization")
    w = weight.detach().to(torch.float32, copy=True).cpu()
    out_features, in_features = w.shape
    group = group or default_group(in_features, method)
    shift = group.bit_length() - 1
    if method == "int8":
        groups = w.reshape(out_features, in_features // group, group)
        scale = groups.abs().amax(dim=2, keepdim=True) / 127
        q = torch.round(groups / torch.where(scale > 0, scale, 1)).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("q8", q.reshape(out_features, in_features).contiguous(), scale[..., 0].contiguous(), None, shift,
                               (out_features, in_features))  # fmt: skip
    subs = w.reshape(out_features, in_features // group, group // SUB, SUB)
    low = subs.amin(dim=3).clamp(max=0)
    step, lift = (subs.amax(dim=3) - low).clamp(min=0) / 15, -low
    # Each super-block's d and dmin: its largest step and lift over 63, in half precision, as Q4_K
    # holds them; each sub-block's scale and minimum rounded up, so its values stay within 16 steps.
    d, dmin = (_half_up(t.amax(dim=2) / 63) for t in (step, lift))
    sc = torch.ceil(step / torch.where(d > 0, d, 1)[..., None]).clamp(0, 63)
    m = torch.ceil(lift / torch.where(dmin > 0, dmin, 1)[..., None]).clamp(0, 63)
    scale, floor = sc * d[..., None], m * dmin[..., None]
    q = torch.round((subs + floor[..., None]) / torch.where(scale > 0, scale, 1)[..., None]).clamp(0, 15).to(torch.uint8)
    sub = torch.cat([sc, m], dim=2).to(torch.uint8).reshape(out_features, in_features // 16)
    return QuantizedWeight("q4", pack_q4(q.reshape(out_features, in_features)), d.contiguous(), (-dmin).contiguous(), shift,
                           (out_features, in_features), sub.contiguous())  # fmt: skip


def _half_up(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded up to a half-precision value: the largest step still fits 63 of them."""
    half = x.to(torch.float16).to(torch.float32)
    return torch.where(half < x, torch.nextafter(half.half(), torch.tensor(torch.inf, dtype=torch.float16)).float(), half)


def default_group(in_features: int, method: str) -> int:
    """The group (int8) or super-block (int4) `quantize` uses for a layer of `in_features` inputs."""
    sizes = INT8_GROUPS if method == "int8" else Q4_SIZES
    return next((g for g in sizes if in_features % g == 0), sizes[-1])


def fits(in_features: int, method: str, group: int | None = None) -> str:
    """Why a layer of `in_features` inputs cannot take `method` ("" when it can): the kernels read
    whole groups, and int8 activations come in blocks of at least 32."""
    group = group or default_group(in_features, method)
    if method == "int4" and group not in Q4_SIZES:
        return f"4-bit super-blocks are of {', '.join(map(str, Q4_SIZES))} values, not {group}"
    block = activation_block(group.bit_length() - 1) if method == "int8" else group
    if method == "int8" and in_features % block:
        return f"{in_features} inputs is not a multiple of the activation block of {block}"
    if in_features % group:
        return f"{in_features} inputs is not a multiple of the {'group' if method == 'int8' else 'super-block'} of {group}"
    return ""


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The fp32 weights the kernels multiply by: for q4 and q6, each w = d sc q + o m rounded once
    from its exact value, as llama.cpp dequantizes Q4_K and Q6_K."""
    out_features, in_features = weight.shape
    group = min(1 << weight.group_shift, in_features)
    if weight.format == "q8":
        scale = weight.scale.repeat_interleave(group, dim=1)[:, :in_features]
        return weight.values.to(torch.float32) * scale
    if weight.format == "q6":
        d = weight.scale.to(torch.float64).repeat_interleave(group, dim=1)
        sc = weight.sub.to(torch.float64).repeat_interleave(16, dim=1)
        return (d * sc * (unpack_q6(weight.values, in_features).to(torch.float64) - 32)).to(torch.float32)
    subs = group // SUB
    sub = weight.sub.reshape(out_features, -1, 2, subs).to(torch.float64)
    # Per sub-block: d sc and o m, then each of its 32 values; exact in float64, rounded once.
    scale = (weight.scale.to(torch.float64)[..., None] * sub[:, :, 0]).reshape(out_features, -1).repeat_interleave(SUB, dim=1)
    floor = (weight.offset.to(torch.float64)[..., None] * sub[:, :, 1]).reshape(out_features, -1).repeat_interleave(SUB, dim=1)
    return (unpack_q4(weight.values, in_features).to(torch.float64) * scale + floor).to(torch.float32)


def input_block(fmt: str, group_shift: int) -> int:
    """Values per activation scale for a layer of format `fmt`: q8's `activation_block`, q4's and q6's super-block."""
    return activation_block(group_shift) if fmt == "q8" else 1 << group_shift


def quantize_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Activations `x` [..., in] as a quantized layer sees them, in fp32: each row per `block` values
    (`input_block`), d = max|x| / 127 and q = round(x * (127 / max|x|)) (ties to even), as the
    kernels quantize them (`cpu/quantize.h`); here q * d (the kernels keep q and d apart and sum q's
    integer products)."""
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], -1, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # A tensor over a tensor: `127 / amax` is torch's 127 * (1 / amax), rounded twice, as C's 127.0f / amax is not.
    q = torch.round(blocks * torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0))
    return (q * (amax / 127)).reshape(x.shape)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """[rows, n] values in [0, 15] (n a multiple of 64) packed as Q4_K packs them, [rows, n / 2]: each
    64 values in 32 bytes, the first 32 in the low nibbles, the next 32 in the high ones."""
    rows, n = q.shape
    chunks = q.to(torch.uint8).reshape(rows, n // 64, 2, 32)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(rows, n // 2).contiguous()


def unpack_q4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_q4`'s inverse: [rows, n] values in [0, 15]."""
    chunks = packed.reshape(packed.shape[0], n // 64, 1, 32)
    return torch.cat([chunks & 15, chunks >> 4], dim=2).reshape(packed.shape[0], n)


# Where each of the 4 runs of 16 values in 64 keeps its high 2 bits in `pack_q6`'s 16 bytes.
_HIGH_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def pack_q6(q: torch.Tensor) -> torch.Tensor:
    """[rows, n] values in [0, 63] (n a multiple of 64) in 6 bits, [rows, 3 n / 4]: each 64 values in
    48 bytes, their low 4 bits as `pack_q4` packs them, then 16 bytes whose byte b holds the high 2
    bits of values b, 16 + b, 32 + b and 48 + b from its low bits up (so the kernels widen them
    a 128-bit lane at a time, each lane one sub-block)."""
    rows, n = q.shape
    q = q.to(torch.uint8)
    low = pack_q4(q & 15).reshape(rows, n // 64, 32)
    high = ((q >> 4).reshape(rows, n // 64, 4, 16) << _HIGH_SHIFTS[:, None]).sum(dim=2, dtype=torch.uint8)
    return torch.cat([low, high], dim=2).reshape(rows, n // 64 * 48).contiguous()


def unpack_q6(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_q6`'s inverse: [rows, n] values in [0, 63]."""
    chunks = packed.reshape(packed.shape[0], n // 64, 48)
    low = unpack_q4(chunks[:, :, :32].reshape(packed.shape[0], n // 2), n)
    high = (chunks[:, :, None, 32:] >> _HIGH_SHIFTS[:, None]) & 3
    return low | (high.reshape(packed.shape[0], n) << 4)
