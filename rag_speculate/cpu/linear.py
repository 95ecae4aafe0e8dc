"""Linear layers of decoding and verification forwards through faster kernels, on CPUs.

Decoding multiplies 1 token's activations by every weight; verifying a draft, 2 to 17 tokens'.
Both are bound by reading the weights, and torch's fp32 kernel (MKL) reads them poorly for a few
rows. Two kernels do better, on the same weights in place (no copy, no repacking, the model
untouched):

- `small_linear.c`, compiled here on first use (a C compiler and AVX2 + FMA needed, AVX-512 used
  where present): each weight row is read once and used against up to 48 rows, in larger tiles
  where AVX-512's registers allow.
- oneDNN's inner product, which torch ships, for 49 to 64 rows (and from 2 rows where the kernel
  above cannot be built).
- In bf16, the same kernel built for AVX512-BF16 (where the CPU has it) for up to 48 rows: it
  reads the weights faster than torch's bf16 product for a few rows.

Prefills (more than 64 rows in fp32, 48 in bf16) keep torch's kernel. Any of these kernels rounds
differently from torch's in the last bits, the same rounding every speculative decoder's
multi-token verification already has; greedy output stays token-identical to `model.generate`
(the fp32 tests compare exactly, the benchmarks report every output). In bf16 no speculative
decoder matches torch's bf16 greedy decoding token for token, as torch rounds a forward over
several rows differently from one over a single row; the bf16 kernel sums each row alike whatever
rows are beside it, as torch's does not.
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

_SMALL_MAX_ROWS = 48  # up to about here the compiled kernel beats oneDNN
_ONEDNN_MIN_ROWS, _ONEDNN_MAX_ROWS = 2, 64
_SOURCE = Path(__file__).with_name("small_linear.c")
# AVX-512 where torch found it (more registers: larger tiles), else AVX2.
_ISA_FLAGS = {"AVX512": ["-mavx512f", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}
_BF16_FLAGS = ["-mavx512bf16", "-DSMALL_LINEAR_BF16"]
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return run_small_linear(small_linear_library(x.dtype)[0], x, weight, bias)


def run_small_linear(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through a small-row kernel built for their dtype (`weight` contiguous)."""
    _check_cpu_tensors("small_linear", x.dtype, x, weight, bias)
    if weight.dim() != 2 or not weight.is_contiguous() or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"small_linear needs a contiguous 2D weight of {x.shape[-1]} columns, got {tuple(weight.shape)}")
    features = x.shape[-1]
    rows = x.numel() // features
    flat = x.reshape(rows, features).contiguous()
    # On the CPU whatever torch's default device: the kernel writes through this pointer.
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device="cpu")
    library.small_linear(
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
    if not (
        x.device.type == weight.device.type == "cpu"
        and (bias is None or bias.device.type == "cpu")
        and x.dtype == weight.dtype
        and x.dtype in _KERNEL_DTYPES
        and x.layout == weight.layout == torch.strided
        and x.shape[-1] > 0
    ):
        return None
    rows = x.numel() // x.shape[-1]
    if (
        rows <= _SMALL_MAX_ROWS
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or bias.dtype == x.dtype)
        and small_linear_library(x.dtype)[0] is not None
    ):
        return _small_linear
    # bf16: torch's own product is oneDNN's already.
    fp32 = x.dtype == torch.float32
    return _onednn_linear if fp32 and _ONEDNN_MIN_ROWS <= rows <= _ONEDNN_MAX_ROWS else None


@functools.cache
def small_linear_library(dtype: torch.dtype = torch.float32) -> tuple[ctypes.CDLL | None, str]:
    """The compiled small-row kernel for `dtype`, built into the cache on first use; or None and why not."""
    return build_small_linear(_SOURCE, dtype)


def build_small_linear(source_path: Path, dtype: torch.dtype = torch.float32) -> tuple[ctypes.CDLL | None, str]:
    """`source_path` (the kernel, or another version of it that a benchmark compares) compiled for
    `dtype` into the cache unless already there, and loaded; or None and why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the small-row kernel is written for x86-64, this CPU is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _ISA_FLAGS:
        return None, f"the small-row kernel needs AVX2 and FMA; torch reports {capability}"
    flags = [*BASE_FLAGS, *_ISA_FLAGS[capability]]
    if dtype not in _KERNEL_DTYPES:
        return None, f"the small-row kernel is for fp32 and bf16, not {dtype}"
    if dtype == torch.bfloat16:
        if capability != "AVX512" or "avx512_bf16" not in cpu_flags():
            return None, "the bf16 small-row kernel needs AVX512-BF16, which this CPU lacks"
        flags += _BF16_FLAGS
    stem = f"small_linear-{str(dtype).removeprefix('torch.')}"
    lib, reason = compile_kernel(source_path, flags, stem, "the small-row kernel")
    if lib is None:
        return None, reason
    lib.small_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.small_linear.restype = None
    return lib, ""


def fast_linear_works(model: torch.nn.Module) -> tuple[bool, str]:
    """Whether `model`'s linear layers can run through these kernels here, and why not.

    Tried on the model's own first linear layer against torch's product: oneDNN's operator may be
    missing from a torch build and refuses dtypes the CPU cannot compute in; the small-row kernel
    may not build (in fp32 it is then left out, and oneDNN serves from 2 rows; bf16 needs it).
    """
    linear = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
    if linear is None:
        return False, "the model has no torch.nn.Linear layers"
    weight = linear.weight
    if weight.device.type != "cpu" or weight.dtype not in _KERNEL_DTYPES:
        return False, f"the fast linear kernels are for fp32 or bf16 on CPU only; the model is {weight.dtype} on {weight.device}"
    if weight.dtype == torch.bfloat16:
        library, reason = small_linear_library(torch.bfloat16)
        if library is None:
            return False, reason
    elif not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not torch.backends.mkldnn.is_available():
        return False, f"torch {torch.__version__} was built without oneDNN's linear operator"
    # bf16 outputs keep 8 bits: torch's and ours may round a sum to neighbouring values.
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for rows in (1, 5, 20):
            x = torch.linspace(-1, 1, rows * weight.shape[1], dtype=weight.dtype).reshape(rows, -1)
            want = F.linear(x, weight, linear.bias)
            kernel = linear_kernel_for(x, weight, linear.bias)
            try:
                got = kernel(x, weight, linear.bias) if kernel else want
            except RuntimeError as exc:
                return False, f"a fast kernel refused the model's linear layer: {exc}"
            if not torch.allclose(got, want, rtol=tolerance, atol=tolerance * (want.abs().max().item() + 1)):
                return False, f"a fast kernel disagrees with torch's on the model's first linear layer ({rows} rows)"
    return True, ""
