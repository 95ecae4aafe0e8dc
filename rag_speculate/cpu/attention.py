"""Attention of decoding and verification forwards of bf16 models, on CPUs (`small_attention.c`).

torch's CPU attention kernel (flash attention) is slow in bf16 for the few query rows of decoding,
worst for one row without a mask, as in every step of plain decoding (`benchmarks/attention_cost.py`
times it against the kernel here).

The compiled kernel computes it in fp32 from the bf16 cache and rounds once to bf16. Each query
row is computed on its own by the same sequence of operations over the entries it sees (masked
ones add exactly 0 to every sum), so its result depends neither on the rows verified beside it nor on the masked
entries between those it sees: with the linear kernel, which sums each row alike too
(linear.py), a bf16 verification forward gives each accepted token the logits plain decoding
through the same kernels gives it, and bf16 speculative output matches that decoding token for
token (tests/test_cpu_attention.py). fp32 keeps torch's kernel, which is fast there and which the
fp32 losslessness tests compare against.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from pathlib import Path

import torch

from .build import BASE_FLAGS, compile_kernel

# Decoding and verifying drafts; longer prefills keep torch's kernel. Up to the linear kernel's 48
# rows, so every row of a bf16 verification forward is computed as plain decoding computes it.
MAX_ROWS = 48
_SOURCE = Path(__file__).with_name("small_attention.c")


@functools.cache
def small_attention_library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled attention kernel, built into the cache on first use; or None and why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the attention kernel is written for x86-64, this CPU is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None, f"the attention kernel needs AVX-512; torch reports {torch.backends.cpu.get_cpu_capability()}"
    lib, reason = compile_kernel(_SOURCE, [*BASE_FLAGS, "-mavx512f", "-mfma"], "small_attention", "the attention kernel")
    if lib is None:
        return None, reason
    lib.small_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]
    lib.small_attention.restype = None
    return lib, ""


def small_attention(
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
    where it does not serve them (torch's kernel then runs): not bf16 on CPU, a batch of more than
    one, over `MAX_ROWS` query rows (prefills), dropout, `is_causal` after cached entries, a mask
    per head, head dims not a multiple of 16, or no kernel built here."""
    if not (
        query.device.type == key.device.type == value.device.type == "cpu"
        and (attn_mask is None or attn_mask.device.type == "cpu")
        and query.layout == key.layout == value.layout == torch.strided
        and query.dtype == key.dtype == value.dtype == torch.bfloat16
        and query.dim() == key.dim() == value.dim() == 4
        and query.shape[0] == 1
        and query.shape[2] <= MAX_ROWS
        and dropout_p == 0.0
    ):
        return None
    _, heads, rows, dims = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if (
        (is_causal and (attn_mask is not None or rows != length))
        or heads % kv_heads
        or (kv_heads != heads and not enable_gqa)
        or key.shape != value.shape
        or key.shape[3] != dims
        or dims % 16
        or (attn_mask is not None and (attn_mask.dim() != 4 or attn_mask.shape[:2] != (1, 1)))
    ):
        return None
    library = small_attention_library()[0]
    if library is None:
        return None
    # The cache's heads may sit apart (a cropped view); within a head, entries must be contiguous.
    key, value = (t if t.stride()[2:] == (dims, 1) else t.contiguous() for t in (key, value))
    query = query.contiguous()
    # On the CPU whatever torch's default device: the kernel reads and writes through these pointers.
    mask = torch.full((rows, rows), float("-inf"), device="cpu").triu(1) if is_causal else None
    if attn_mask is not None:
        bias = attn_mask.expand(1, 1, rows, length)[0, 0]
        mask = torch.zeros(rows, length, device="cpu").masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else bias.float().contiguous()
    out = torch.empty_like(query)
    library.small_attention(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), None if mask is None else mask.data_ptr(), out.data_ptr(),
        heads, kv_heads, rows, length, dims, key.stride(1), value.stride(1),
        dims**-0.5 if scale is None else scale, torch.get_num_threads(),
    )  # fmt: skip
    return out
