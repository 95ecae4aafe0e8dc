"""A layer's queries and keys turned in one call (`rotary.c`), bit for bit the model's rotary function.

transformers' `apply_rotary_pos_emb` runs ten small torch operators for a layer's queries and keys;
a one-token forward of the 1.5B calls it 28 times. `rotary_for` hands out the kernel only for a
model's function it has checked: on probe heads in fp32 and in bf16, both outputs must equal the
function's exactly (a dtype whose check fails keeps the function).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from .build import BASE_FLAGS, compile_kernel

_SOURCE = Path(__file__).with_name("rotary.c")

Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


_DTYPES = {torch.float32: [], torch.bfloat16: ["-DVALUES_BF16"]}


@functools.cache
def rotary_library(dtype: torch.dtype = torch.float32) -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel for heads of `dtype` (fp32 or bf16), built into the cache on first use; or
    None and why not."""
    stem = f"rotary-{str(dtype).removeprefix('torch.')}"
    lib, reason = compile_kernel(_SOURCE, [*BASE_FLAGS, *_DTYPES[dtype]], stem, "the rotary kernel")
    if lib is not None:
        lib.rotary.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 11
        lib.rotary.restype = None
    return lib, reason


def _served(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Heads [batch, heads, rows, dims] with contiguous vectors, cos and sin [batch, rows, dims]
    contiguous, all on the CPU in one dtype."""
    batch, _, rows, dims = query.shape
    return (
        query.dtype == key.dtype == cos.dtype == sin.dtype
        and cos.device.type == "cpu"
        and query.device == key.device == cos.device == sin.device
        and key.shape[0] == batch and key.shape[2:] == query.shape[2:]
        and query.stride(-1) == key.stride(-1) == 1
        and cos.shape == sin.shape == (batch, rows, dims)
        and cos.is_contiguous() and sin.is_contiguous()
    )  # fmt: skip


def _rotated(kernel: Callable, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    q_out, k_out = query.new_empty(query.shape), key.new_empty(key.shape)
    batch, heads, rows, dims = query.shape
    kernel(query.data_ptr(), key.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
           batch, rows, dims, heads, *query.stride()[:3], key.shape[1], *key.stride()[:3])  # fmt: skip
    return q_out, k_out


@torch.inference_mode()
def rotary_for(apply_rotary: Rotary, dims: int) -> Rotary | None:
    """`apply_rotary(query, key, cos, sin)` through the kernel for heads of `dims`, or None where the
    kernel does not give the function's bits on probe heads (another formula keeps its own)."""
    if dims % 2:
        return None
    generator = torch.Generator().manual_seed(0)
    # Heads as a forward holds them: views of one product's output, [batch, rows, heads, dims] transposed.
    heads = torch.randn(2, 3, 5, dims, generator=generator).transpose(1, 2)
    cos, sin = (torch.randn(2, 3, dims, generator=generator) for _ in range(2))
    kernels = {}
    for dtype in _DTYPES:
        library, _ = rotary_library(dtype)
        probe = [t.to(dtype) for t in (heads[:, :4], heads[:, 4:], cos, sin)]
        try:
            want = apply_rotary(*probe)
        except Exception:  # noqa: BLE001 - a function that takes other arguments keeps its own
            return None
        if library is not None and all(torch.equal(g, w) for g, w in zip(_rotated(library.rotary, *probe), want)):
            kernels[dtype] = library.rotary
    if not kernels:
        return None

    def rotate(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kernel = kernels.get(query.dtype)
        if kernel is not None and _served(query, key, cos, sin):
            return _rotated(kernel, query, key, cos, sin)
        return apply_rotary(query, key, cos, sin)

    return rotate
