"""A Llama-family RMS norm in one call (`norm.c`), bit for bit the module's own torch operators.

A one-token forward of the 1.5B runs 57 norms, each seven small torch operators; in one C call
each costs a few microseconds instead of tens. `norm_for` hands out the call only for a module it
has checked: on probe rows in its weight's dtype (fp32 or bf16), the kernel's output must equal the
module's forward exactly.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from .build import BASE_FLAGS, compile_kernel

_SOURCE = Path(__file__).with_name("norm.c")
# The floats in the vectors torch's sum runs in on x86 (norm.c's LANES): 8 under AVX-512 as well,
# where torch dispatches its sum to the AVX2 build.
_LANES = 8


_DTYPES = {torch.float32: [], torch.bfloat16: ["-DVALUES_BF16"]}


@functools.cache
def norm_library(dtype: torch.dtype = torch.float32) -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel for rows of `dtype` (fp32 or bf16), built into the cache on first use; or
    None and why not."""
    stem = f"norm-{str(dtype).removeprefix('torch.')}"
    lib, reason = compile_kernel(_SOURCE, [*BASE_FLAGS, *_DTYPES[dtype]], stem, "the norm kernel")
    if lib is not None:
        lib.rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
        lib.rms_norm.restype = None
    return lib, reason


def on_x86() -> bool:
    """Whether torch's sums here run in the order the kernel follows: its x86 builds'."""
    return platform.machine().lower() in ("x86_64", "amd64")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`weight * (x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))` for `x` and `weight` both fp32
    on the CPU (for both bf16: x widened to fp32 and `x * rsqrt(...)` rounded back before the weight,
    as the Llama-family modules compute it), through the kernel; None where it does not serve them
    (another dtype or device, rows shorter than torch's vectors, no kernel built)."""
    n = x.shape[-1]
    if not on_x86() or n < _LANES or not _on_cpu_in(x.dtype, x, weight) or weight.shape != (n,):
        return None
    library = norm_library(x.dtype)[0]
    return None if library is None else _run(library.rms_norm, x, weight.contiguous(), eps)


def _on_cpu_in(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """Whether all of `tensors` are on the CPU in `dtype`, one the kernel is built for."""
    return dtype in _DTYPES and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


def _run(kernel: Callable, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(flat)
    kernel(flat.data_ptr(), weight.data_ptr(), out.data_ptr(), flat.shape[0], flat.shape[1], eps)
    return out.view(x.shape)


@torch.inference_mode()
def norm_for(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`module`'s forward through the kernel, or None: unless the module holds `weight` and
    `variance_epsilon` and its forward gives the kernel's bits on probe rows, it keeps its own."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(eps, float) or weight.dim() != 1:
        return None
    generator = torch.Generator().manual_seed(0)
    # Rows of several magnitudes, so the sum's order shows in the last bits; dozens, since another order
    # still gives the same bits on most rows (on three in four 64-float rows, 16 lanes' order for 8's).
    probe = torch.randn(48, weight.shape[0], generator=generator) * torch.tensor([1e-3, 1.0, 30.0]).repeat(16)[:, None]
    # A bf16 module's fp32 rows too (its weight widened, the fp32 kernel's formula): its output's
    # rounding to bf16 hides most of what another order of the sum changes.
    for rows in [probe] if weight.dtype == torch.float32 else [probe.to(weight.dtype), probe]:
        got = rms_norm(rows, weight.to(rows.dtype), eps)
        if got is None or not torch.equal(got, module(rows)):
            return None
    dtype, kernel, weight = weight.dtype, norm_library(weight.dtype)[0].rms_norm, weight.contiguous()

    def forward(x: torch.Tensor) -> torch.Tensor:
        # The weight was checked once; a step's inputs only need to be on the CPU in its dtype.
        return _run(kernel, x, weight, eps) if _on_cpu_in(dtype, x) else module(x)

    return forward
