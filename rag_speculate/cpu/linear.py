"""Linear layers through one kernel that computes each row as if it were alone (`linear.c`).

Every row a forward feeds, whether it is one decoding step, a draft tree being verified, a whole
prefill, or the part of a prompt a cache hit left over, gets the same products from the same
operations (the invariant, `kernels.py`). So where the prompt cache cut a prompt, or which rows a
forward held beside a token, never changes that token's logits: a warm request answers exactly as
a cold one, and a bf16 verification forward gives every accepted token the logits plain decoding
through the same kernel gives it.

The kernel is compiled here on first use (a C compiler and AVX2 + FMA needed; AVX-512 used where
torch found it) and reads the weights in place: no copy, no repacking, the model untouched. Few
rows are bound by reading the weights, which it reads once for all rows (torch's fp32 product reads
them poorly for a few rows); many rows are bound by arithmetic, where it keeps a block of weights
in the cache while the rows pass it. bf16 sums pairs of products in fp32 where the CPU has
AVX512-BF16, and otherwise widens each bf16 to fp32 (exactly) and multiplies in fp32.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from ..devices import cpu_flags
from .build import BASE_FLAGS, compile_kernel

_SOURCE = Path(__file__).with_name("linear.c")
# Quantized weights take int8 activations: integer products, kernels of their own (fp32 in and out):
# int8 weights (AVX2), 4-bit ones in GGUF's Q4_K layout (AVX2, or AVX-512 with VNNI where the CPU has it).
_Q8_SOURCE = Path(__file__).with_name("linear_q8.c")
_Q4_SOURCE = Path(__file__).with_name("linear_q4.c")
# AVX-512 where torch found it (more registers: larger tiles), else AVX2.
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}
# The integer kernels' AVX-512 builds use byte and word instructions, and AVX2's beside them.
_AVX512_INTEGER = ["-mavx512bw", "-mavx512vl", "-mavx2"]
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# Values per 4-bit super-block the kernel takes: Q4_K's 256, or fewer where a layer's inputs need it.
Q4_SIZES = (256, 128, 64)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return run_linear(linear_library(x.dtype)[0], x, weight, bias)


def run_linear(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through a kernel built for their dtype (`weight` contiguous)."""
    _check_cpu_tensors("the linear kernel", x.dtype, x, weight, bias)
    if weight.dim() != 2 or not weight.is_contiguous() or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"the linear kernel needs a contiguous 2D weight of {x.shape[-1]} columns, got {tuple(weight.shape)}")
    features = x.shape[-1]
    rows = x.numel() // features
    flat = x.reshape(rows, features).contiguous()
    # On the CPU whatever torch's default device: the kernel writes through this pointer.
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device="cpu")
    library.linear(
        flat.data_ptr(), weight.data_ptr(), None if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(), rows, weight.shape[0], features, torch.get_num_threads(),
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _check_cpu_tensors(kernel: str, dtype: torch.dtype, *tensors: torch.Tensor | None) -> None:
    """A kernel reads and writes raw pointers: anything but strided CPU tensors of its dtype is refused."""
    for t in tensors:
        if t is not None and (t.device.type != "cpu" or t.dtype != dtype or t.layout != torch.strided):
            raise ValueError(f"{kernel} takes strided {dtype} tensors on the CPU, got {t.layout} {t.dtype} on {t.device}")


def linear_kernel_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The kernel `FastKernels` runs `F.linear(x, weight, bias)` with, or None for torch's own."""
    if (
        _plain(x)
        and _plain(weight)
        and x.device.type == weight.device.type == "cpu"
        and (bias is None or (bias.device.type == "cpu" and bias.dtype == x.dtype))
        and x.dtype == weight.dtype
        and x.dtype in _KERNEL_DTYPES
        and x.layout == weight.layout == torch.strided
        and x.shape[-1] > 0
        and weight.dim() == 2
        and weight.is_contiguous()
        and linear_library(x.dtype)[0] is not None
    ):
        return _linear
    return None


def _plain(tensor: torch.Tensor) -> bool:
    """A tensor whose memory holds its values (no subclass: the kernel reads through its pointer)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


@functools.cache
def linear_library(dtype: torch.dtype = torch.float32, weights: str = "") -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel for activations of `dtype` and weights in `dtype` ("") or a quantized
    format ("q8", "q4", or "q6", which the 4-bit kernel serves), built into the cache on first use;
    or None and why not."""
    capability = torch.backends.cpu.get_cpu_capability()
    if weights == "q8":
        return build_linear_q8(_Q8_SOURCE, capability)
    if weights in ("q4", "q6"):
        return build_linear_q4(_Q4_SOURCE, capability)
    return build_linear(_SOURCE, dtype, capability)


def isa_unsupported(isa: str, what: str) -> str:
    """Why `what` (a kernel here, all written for x86-64 with AVX2 and FMA) cannot be built on this
    CPU, whose instruction set torch reports as `isa`; "" when it can."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{what} is written for x86-64, this CPU is {platform.machine()}"
    if isa not in ISA_FLAGS:
        return f"{what} needs AVX2 and FMA; torch reports {isa}"
    return ""


def build_linear(source_path: Path, dtype: torch.dtype, isa: str) -> tuple[ctypes.CDLL | None, str]:
    """`source_path` (the kernel, or another version of it that a benchmark compares) compiled for
    `dtype` and the instruction set `isa` ("AVX512" or "AVX2") into the cache unless already there,
    and loaded; or None and why not."""
    reason = isa_unsupported(isa, "the linear kernel")
    if reason:
        return None, reason
    if dtype not in _KERNEL_DTYPES:
        return None, f"the linear kernel is for fp32 and bf16, not {dtype}"
    flags = [*BASE_FLAGS, *ISA_FLAGS[isa]]
    if dtype == torch.bfloat16:
        flags.append("-DLINEAR_BF16")
        if isa == "AVX512" and "avx512_bf16" in cpu_flags():
            flags += ["-mavx512bf16", "-DBF16_DOT"]
    lib, reason = compile_kernel(source_path, flags, f"linear-{str(dtype).removeprefix('torch.')}-{isa.lower()}", "the linear kernel")
    if lib is None:
        return None, reason
    lib.linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.linear.restype = None
    return lib, ""


def build_linear_q8(source_path: Path, isa: str) -> tuple[ctypes.CDLL | None, str]:
    """`source_path` (`linear_q8.c`, or a version a benchmark compares) compiled for AVX-512 with VNNI
    where `isa` is "AVX512" and the CPU has VNNI (many rows then take its lanes-as-rows product), else
    for AVX2, into the cache unless already there, and loaded; or None and why not."""
    reason = isa_unsupported(isa, "the int8 kernel")
    if reason:
        return None, reason
    vnni = isa == "AVX512" and "avx512_vnni" in cpu_flags()
    flags = [*BASE_FLAGS, *ISA_FLAGS["AVX512"], *_AVX512_INTEGER, "-mavx512vnni"] if vnni else [*BASE_FLAGS, *ISA_FLAGS["AVX2"]]
    lib, reason = compile_kernel(source_path, flags, "linear-q8-avx512-vnni" if vnni else "linear-q8-avx2", "the int8 kernel")
    if lib is not None:
        lib.linear_quantized.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
        lib.linear_quantized.restype = None
    return lib, reason


def build_linear_q4(source_path: Path, isa: str) -> tuple[ctypes.CDLL | None, str]:
    """`source_path` (`linear_q4.c`, or a version a benchmark compares) compiled for `isa` ("AVX512",
    with VNNI where the CPU has it, or "AVX2") into the cache unless already there, and loaded; or
    None and why not."""
    reason = isa_unsupported(isa, "the 4-bit kernel")
    if reason:
        return None, reason
    flags = [*BASE_FLAGS, *ISA_FLAGS[isa]]
    if isa == "AVX512":
        flags += [*_AVX512_INTEGER] + (["-mavx512vnni"] if "avx512_vnni" in cpu_flags() else [])
    vnni = "-vnni" if "-mavx512vnni" in flags else ""
    lib, reason = compile_kernel(source_path, flags, f"linear-q4-{isa.lower()}{vnni}", "the 4-bit kernel")
    if lib is not None:
        lib.linear_q4.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
        lib.linear_q4.restype = None
    return lib, reason


def activation_block(group_shift: int) -> int:
    """Values per activation scale for q8 weights in groups of 2**group_shift (`linear_q8.c`): the
    group, at least 32 (a register of int8) and at most 128, so a block lies within one weight
    scale (or spans two groups of 16)."""
    return min(max(1 << group_shift, 32), 128)


def run_quantized(
    library: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
    group_shift: int, out_features: int, bias: torch.Tensor | None, sub: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`F.linear(x, w, bias)` for the quantized weights `w` through `library`, with x quantized to
    int8 row by row (bf16 in and out as fp32 are: widened, and rounded as torch rounds, by the
    kernel's threads): q8 values `q` [out, in] int8 with an fp32 `scale` per group of
    2**group_shift (`linear_q8.c`); or q4 values packed [out, in / 2] uint8
    in super-blocks of 2**group_shift, each with an fp32 `scale` (d) and `offset`, and per sub-block of
    32 a 6-bit scale and minimum in `sub` uint8; or q6 values packed [out, 3 in / 4] uint8 (6 bits
    each, `formats.pack_q6`) in super-blocks of 256, with d and offset, and per sub-block of 16 a
    signed scale in `sub` int8 (`linear_q4.c`)."""
    _check_cpu_tensors("the linear kernel", x.dtype, x, bias)
    features = x.shape[-1]
    int8, q6 = q.dtype == torch.int8, sub is not None and sub.dtype == torch.int8
    per_row, block = (features, activation_block(group_shift)) if int8 else (features * 3 // 4, 256) if q6 else (features // 2, 1 << group_shift)
    sizes = (256,) if q6 else Q4_SIZES
    if q.shape != (out_features, per_row) or not q.is_contiguous() or features % block or (not int8 and 1 << group_shift not in sizes):
        raise ValueError(f"quantized weights of shape {tuple(q.shape)} do not take {features} features")
    if not int8 and (sub is None or sub.shape != (out_features, features // 16) or not sub.is_contiguous()):
        what = "an 8-bit scale for every 16" if q6 else "a 6-bit scale and minimum for every 32"
        raise ValueError(f"{'6' if q6 else '4'}-bit weights need {what} of their {features} features")
    rows, bf16 = x.numel() // features, x.dtype == torch.bfloat16
    flat = x.reshape(rows, features)
    flat = (flat if bf16 else flat.to(torch.float32)).contiguous()
    bias = None if bias is None else bias.to(torch.float32).contiguous()
    out = torch.empty(rows, out_features, dtype=torch.bfloat16 if bf16 else torch.float32, device="cpu")
    rest = (None if bias is None else bias.data_ptr(), out.data_ptr(), rows, out_features, features, torch.get_num_threads(), bf16)
    if int8:
        library.linear_quantized(flat.data_ptr(), q.data_ptr(), scale.data_ptr(), None, group_shift, *rest)
    else:
        library.linear_q4(flat.data_ptr(), q.data_ptr(), sub.data_ptr(), scale.data_ptr(), offset.data_ptr(), 1 << group_shift, q6, *rest)
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


def linear_unsupported(model: torch.nn.Module) -> str:
    """Why `model`'s linear layers cannot run through the kernel here ("" where they can): it must build
    for the model's dtype, and agree with torch's product on the model's own first linear layer.
    Weights that are tensor subclasses (torchao's quantized tensors, say) are theirs to run: a
    model holding any runs through torch. Layers that say they compute each row alone
    (`rows_alone`: `rag_speculate`'s quantized ones, which run this kernel themselves) need no
    check, and the model's attention still runs ours."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    subclassed = next((m.weight for m in linears if not _plain(m.weight)), None)
    if subclassed is not None:
        return f"its linear layers hold {type(subclassed).__name__} weights, which their own kernels run"
    if not linears:
        if any(getattr(m, "rows_alone", False) for m in model.modules()):
            return ""
        return "the model has no torch.nn.Linear layers"
    linear = linears[0]
    weight = linear.weight
    if weight.device.type != "cpu" or weight.dtype not in _KERNEL_DTYPES:
        return f"the fast linear kernel is for fp32 or bf16 on CPU only; the model is {weight.dtype} on {weight.device}"
    library, reason = linear_library(weight.dtype)
    if library is None:
        return reason
    # bf16 outputs keep 8 bits: torch's and ours may round a sum to neighbouring values.
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for rows in (1, 5, 70):
            x = torch.linspace(-1, 1, rows * weight.shape[1], dtype=weight.dtype).reshape(rows, -1)
            want = F.linear(x, weight, linear.bias)
            try:
                got = _linear(x, weight, linear.bias)
            except (RuntimeError, ValueError) as exc:
                return f"the fast kernel refused the model's linear layer: {exc}"
            if not torch.allclose(got, want, rtol=tolerance, atol=tolerance * (want.abs().max().item() + 1)):
                return f"the fast kernel disagrees with torch's on the model's first linear layer ({rows} rows)"
    return ""
