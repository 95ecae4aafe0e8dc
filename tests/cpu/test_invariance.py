"""The kernels' invariant, checked directly: a row computed alone equals the same row computed among
others, bit for bit, for the linear kernel (plain, int8, 4-bit and GGUF's 6-bit weights) and the attention kernel,
fp32 and bf16, on every instruction set this CPU can build them for."""

from __future__ import annotations

import pytest
import torch
from conftest import random_q6

from rag_speculate.cpu.attention import build_attention, run_attention
from rag_speculate.cpu.linear import build_linear, run_linear

# AVX2 builds wherever AVX-512 does; AVX-512 only where torch found it.
ISAS = ["AVX2", "AVX512"]
DTYPES = [torch.float32, torch.bfloat16]
# Rows beside the one checked: alone, among 1, 3, 5, 48 and 300 others (tiles of 2 and 4 rows, lanes past 4).
BESIDE = [0, 1, 3, 5, 48, 300]


def _built(build, dtype: torch.dtype, isa: str):
    if isa == "AVX512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip(f"this CPU has no AVX-512 (torch reports {torch.backends.cpu.get_cpu_capability()})")
    library, reason = build(dtype, isa)
    if library is None:
        pytest.skip(reason)
    return library


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1536, 256), (37, 67)])  # weight rows and features on and off the tiles and lanes
def test_a_linear_row_is_the_same_among_any_other_rows(shape, dtype, isa):
    from rag_speculate.cpu.linear import _SOURCE

    library = _built(lambda d, i: build_linear(_SOURCE, d, i), dtype, isa)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=generator).to(dtype)
    bias = torch.randn(shape[0], generator=generator).to(dtype)
    x = torch.randn(max(BESIDE) + 1, shape[1], generator=generator).to(dtype)
    _same_among_others(lambda rows: run_linear(library, rows, weight, bias), x)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("method", "shape", "group"),
    [
        ("int8", (1536, 256), None),
        # Past 64 rows int8 weights meet x in int16 tiles: several chunks of k, weight rows off the
        # tiles, and every group size (ours, Q8_0's, 16).
        ("int8", (37, 4224), 128),
        ("int8", (37, 4160), 32),
        ("int8", (37, 4160), 16),
        # 4-bit: a decoding step's tiles and a prefill's chunks of k; super-blocks of 256 and 64.
        ("int4", (1536, 256), None),
        ("int4", (37, 4608), 256),
        ("int4", (37, 4160), 64),
        # GGUF's Q6_K through the 4-bit kernel.
        ("q6", (1536, 256), None),
        ("q6", (37, 4608), None),
    ],
)
def test_a_quantized_linear_row_is_the_same_among_any_other_rows(method, shape, group, dtype, isa):
    from rag_speculate.cpu.linear import _Q4_SOURCE, _Q8_SOURCE, build_linear_q4, build_linear_q8, run_quantized
    from rag_speculate.quantization.formats import quantize

    if method == "int8":
        library = _built(lambda d, i: build_linear_q8(_Q8_SOURCE, i), dtype, isa)
    else:
        library = _built(lambda d, i: build_linear_q4(_Q4_SOURCE, i), dtype, isa)
    generator = torch.Generator().manual_seed(0)
    weight = random_q6(*shape, generator) if method == "q6" else quantize(torch.randn(*shape, generator=generator), method, group)
    if method == "int8":
        weight.values[::3, ::5] = -128  # as a GGUF Q8_0 file may hold
    bias = torch.randn(shape[0], generator=generator).to(dtype)
    x = torch.randn(max(BESIDE) + 1, shape[1], generator=generator).to(dtype)
    _same_among_others(
        lambda rows: run_quantized(library, rows, weight.values, weight.scale, weight.offset, weight.group_shift, shape[0], bias, weight.sub),
        x,
    )


def _same_among_others(linear, x: torch.Tensor) -> None:
    alone = linear(x[:1])
    for others in BESIDE[1:]:
        together = linear(x[: others + 1])
        assert torch.equal(together[:1], alone), others
        # ... and wherever it sits among them.
        assert torch.equal(linear(x[others : others + 1]), together[others:]), others


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_attention_row_is_the_same_among_any_other_rows_and_any_masked_entries(dtype, isa):
    library = _built(build_attention, dtype, isa)
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dims, past = 6, 2, 64, 20
    rows = max(BESIDE) + 1
    q = torch.randn(1, heads, rows, dims, generator=generator).to(dtype)
    k, v = (torch.randn(1, kv_heads, past + rows, dims, generator=generator).to(dtype) for _ in range(2))

    def run(q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return run_attention(library, q_rows, keys, values, mask, False, dims**-0.5)

    # The last row, alone after everything before it (as decoding computes it)...
    alone = run(q[:, :, -1:], k, v, None)
    for others in BESIDE[1:]:
        # ... and as the last of `others + 1` rows verified together, each seeing the past and the rows before it.
        start = rows - others - 1
        keep = torch.ones(others + 1, past + rows, dtype=torch.bool)
        keep[:, past + start :] = torch.ones(others + 1, others + 1, dtype=torch.bool).tril()
        keep = keep[:, : past + rows]
        together = run(q[:, :, start:], k, v, keep[None, None])
        assert torch.equal(together[:, :, -1:], alone), others
    # A draft tree's row sees its ancestors only: the siblings masked between them add nothing.
    keep = torch.ones(1, past + rows, dtype=torch.bool)
    keep[0, past : past + rows - 1 : 2] = False
    seen = keep[0].nonzero()[:, 0]
    assert torch.equal(run(q[:, :, -1:], k, v, keep[None, None]), run(q[:, :, -1:], k[:, :, seen], v[:, :, seen], None))

