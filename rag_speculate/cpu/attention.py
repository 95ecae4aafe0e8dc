"""Attention through one kernel that computes each query row as if it were alone (`attention.c`).

torch's CPU attention kernel blocks its work by the shapes it is given, so a token's result moves
with the rows beside it (a prefill's, a draft tree's, a cache hit's split of a prompt); it is also
slow for the few rows of decoding, in bf16 worst for one row. Here each row runs the same
operations over the entries it sees, so with the linear kernel (`linear.py`) a prefill, a
verification forward and a decoding step give a token the same logits (`kernels.py`), in fp32
and in bf16 (computed in fp32 and rounded once).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .build import BASE_FLAGS, compile_kernel
from .linear import ISA_FLAGS, isa_unsupported

_SOURCE = Path(__file__).with_name("attention.c")
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def attention_library(dtype: torch.dtype = torch.bfloat16) -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel for `dtype`, built into the cache on first use; or None and why not."""
    return build_attention(dtype, torch.backends.cpu.get_cpu_capability())


def build_attention(dtype: torch.dtype, isa: str) -> tuple[ctypes.CDLL | None, str]:
    """The kernel for `dtype` and the instruction set `isa` ("AVX512" or "AVX2"); or None and why not."""
    reason = isa_unsupported(isa, "the attention kernel")
    if reason:
        return None, reason
    if dtype not in _DTYPES:
        return None, f"the attention kernel is for fp32 and bf16, not {dtype}"
    flags = [*BASE_FLAGS, *ISA_FLAGS[isa], *(["-DATTENTION_BF16"] if dtype == torch.bfloat16 else [])]
    stem = f"attention-{str(dtype).removeprefix('torch.')}-{isa.lower()}"
    lib, reason = compile_kernel(_SOURCE, flags, stem, "the attention kernel")
    if lib is None:
        return None, reason
    lib.attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int64, ctypes.c_int]
    lib.attention.restype = None
    return lib, ""


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """`F.scaled_dot_product_attention` with the same arguments through the compiled kernel; None
    where it does not serve them (torch's kernel then runs): not fp32 or bf16 on CPU, dropout,
    `is_causal` after cached entries, a mask per head, head dims not a multiple of 16, or no kernel
    built here. A batch runs one sequence at a time, so a batched forward's row gets what the same
    row gets alone (the batched cache's padding is masked, and a masked entry adds nothing)."""
    if not (
        query.device.type == key.device.type == value.device.type == "cpu"
        and (attn_mask is None or attn_mask.device.type == "cpu")
        and query.layout == key.layout == value.layout == torch.strided
        and query.dtype == key.dtype == value.dtype
        and query.dtype in _DTYPES
        and query.dim() == key.dim() == value.dim() == 4
        and query.shape[0] == key.shape[0] == value.shape[0]
        and dropout_p == 0.0
    ):
        return None
    batch, heads, rows, dims = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if (
        (is_causal and (attn_mask is not None or rows != length))
        or heads % kv_heads
        or (kv_heads != heads and not enable_gqa)
        or key.shape != value.shape
        or key.shape[3] != dims
        or dims % 16
        or (attn_mask is not None and (attn_mask.dim() != 4 or attn_mask.shape[1] != 1))
        or (attn_mask is not None and attn_mask.shape[0] not in (1, batch))
    ):
        return None
    library = attention_library(query.dtype)[0]
    if library is None:
        return None
    scale = dims**-0.5 if scale is None else scale
    if batch == 1:
        return run_attention(library, query, key, value, attn_mask, is_causal, scale)
    masks = [None] * batch if attn_mask is None else attn_mask.expand(batch, *attn_mask.shape[1:]).split(1)
    # One sequence at a time: each gets exactly what it gets in a forward of its own.
    sequences = zip(query.split(1), key.split(1), value.split(1), masks)
    outs = [run_attention(library, q, k, v, m, is_causal, scale) for q, k, v, m in sequences]
    return torch.cat(outs)


def run_attention(
    library: ctypes.CDLL, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attn_mask: torch.Tensor | None, is_causal: bool, scale: float,
) -> torch.Tensor:
    """Attention through a kernel built for the tensors' dtype, on arguments `attention` has checked
    (one batch, a mask broadcast over the heads, grouped key/value heads)."""
    _, heads, rows, dims = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    # The cache's heads may sit apart (a cropped view); within a head, entries must be contiguous.
    key, value = (t if t.stride()[2:] == (dims, 1) else t.contiguous() for t in (key, value))
    query = query.contiguous()
    # On the CPU whatever torch's default device: the kernel reads and writes through these pointers.
    mask = None
    if attn_mask is not None:
        bias = attn_mask.expand(1, 1, rows, length)[0, 0]
        if bias.dtype == torch.bool:
            mask = torch.zeros(rows, length, device="cpu").masked_fill_(~bias, float("-inf"))
        else:
            mask = bias.float().contiguous()
    out = torch.empty_like(query)
    library.attention(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), None if mask is None else mask.data_ptr(), out.data_ptr(),
        heads, kv_heads, rows, length, dims, key.stride(1), value.stride(1), scale, 0 if is_causal else -1,
        torch.get_num_threads(),
    )  # fmt: skip
    return out
