"""The quantized formats: int8 and 4-bit weights round-trip within half a step, the 4-bit packing is
its own inverse (the 6-bit too), and both kernels (the 4-bit one also for GGUF's Q6_K) compute the product of the dequantized weights and
`quantize_activations(x)` (exact integer products, fp32 rounding only), for any number of rows, fp32
and bf16 activations, on every instruction set this CPU builds."""

from __future__ import annotations

import pytest
import torch

from conftest import random_q6

from rag_speculate import InvalidArgumentError
from rag_speculate.cpu.linear import _Q4_SOURCE, _Q8_SOURCE, activation_block, build_linear_q4, build_linear_q8, run_quantized
from rag_speculate.quantization.formats import (
    QuantizedWeight, dequantize, fits, pack_q4, pack_q6, quantize, quantize_activations, unpack_q4, unpack_q6,
)  # fmt: skip

ISAS = ["AVX2", "AVX512"]


def built(isa: str, weights: str):
    if isa == "AVX512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip(f"this CPU has no AVX-512 (torch reports {torch.backends.cpu.get_cpu_capability()})")
    library, reason = build_linear_q8(_Q8_SOURCE, isa) if weights == "q8" else build_linear_q4(_Q4_SOURCE, isa)
    if library is None:
        pytest.skip(reason)
    return library


def test_packing_4_bit_values_is_its_own_inverse():
    q = torch.randint(0, 16, (7, 128), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_q4(q)
    assert packed.shape == (7, 64) and torch.equal(unpack_q4(packed, 128), q)
    # As Q4_K packs them: byte b of each 32 holds value b in its low nibble and value 32 + b in its high one.
    assert packed[0, 5] == q[0, 5] | (q[0, 37] << 4) and packed[0, 40] == q[0, 72] | (q[0, 104] << 4)


def test_packing_6_bit_values_is_its_own_inverse():
    q = torch.randint(0, 64, (7, 256), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_q6(q)
    assert packed.shape == (7, 192) and torch.equal(unpack_q6(packed, 256), q)
    # Each 64 values in 48 bytes: their low 4 bits as Q4_K's, then byte 32 + b holds the high 2 bits
    # of values b, 16 + b, 32 + b and 48 + b from its low bits up.
    assert packed[0, 53] == (q[0, 69] & 15) | ((q[0, 101] & 15) << 4)
    high = packed[0, 48 + 32 + 3]
    assert [(high >> s) & 3 for s in (0, 2, 4, 6)] == [q[0, 64 + 16 * run + 3] >> 4 for run in range(4)]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_weights_come_back_within_half_a_step(method):
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    w[3] = w[3].abs() + 1  # rows all positive and all negative: minimums of 0 and of the range
    w[4] = -w[4].abs()
    weight = quantize(w, method)
    error = (dequantize(weight) - w).abs()
    if method == "int8":  # a scale per 128 values (the largest group that divides 512 inputs)
        assert weight.values.dtype == torch.int8 and weight.scale.shape == (64, 4) and weight.offset is None
        assert torch.all(error <= weight.scale.repeat_interleave(weight.group, dim=1) / 2 + 1e-6)
    else:  # Q4_K: super-blocks of 256, each a d and an offset, and a 6-bit scale and minimum per 32
        assert weight.values.shape == (64, 256) and weight.scale.shape == weight.offset.shape == (64, 2) and weight.sub.shape == (64, 32)
        sub = weight.sub.reshape(64, 2, 2, 8).float()
        step = (weight.scale[..., None] * sub[:, :, 0]).repeat_interleave(32, dim=2).reshape(64, 512)
        dmin = (-weight.offset).repeat_interleave(256, dim=1)
        assert torch.all(error <= step / 2 + dmin + 1e-6) and (error <= step / 2 + 1e-6).float().mean() > 0.99
        assert torch.equal(weight.scale, weight.scale.half().float()) and torch.all(weight.offset <= 0)  # halves, as Q4_K's
    # Bytes per weight: int8 one and 4 of fp32 scale per 128; 4 bits half a byte, and per 256 an fp32 d and offset and 16 bytes.
    assert weight.nbytes == w.numel() * (1 + 4 / 128 if method == "int8" else 0.5 + 24 / 256)


def test_int8_groups_are_the_largest_that_divide_the_inputs():
    assert [quantize(torch.ones(2, n), "int8").group for n in (1536, 8960, 96, 160)] == [128, 128, 32, 32]
    assert quantize(torch.ones(2, 192), "int8").group == 64 and quantize(torch.ones(2, 128), "int8", group=32).group == 32


def test_what_does_not_fit_is_named():
    assert fits(128, "int4") == "" and fits(64, "int8") == "" and fits(576, "int4") == ""  # 576: super-blocks of 64
    assert "activation block of 32" in fits(48, "int8") and "activation block of 128" in fits(64, "int8", group=128)
    assert "super-block of 64" in fits(96, "int4") and "not 32" in fits(256, "int4", group=32)
    with pytest.raises(InvalidArgumentError, match="unknown quantization 'int3'") as raised:
        quantize(torch.zeros(4, 16), "int3")
    assert raised.value.argument == "quantization"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [256, 128, 64])
def test_the_4_bit_kernel_multiplies_the_dequantized_weights_by_the_quantized_activations(size, dtype, isa):
    """A 4-bit layer computes the dequantized weights times each row's activations quantized per
    super-block: its integer products are exact, so it differs from that product, taken in float64,
    by fp32 rounding only. Any rows, on and off the kernel's tiles and its prefill's chunks of k."""
    library = built(isa, "q4")
    generator = torch.Generator().manual_seed(2)
    for out_features, in_features in ((37, 2 * size), (300, 4608)):
        weight = quantize(torch.randn(out_features, in_features, generator=generator), "int4", size)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        for rows in (1, 4, 5, 48, 70):
            x = (torch.randn(rows, in_features, generator=generator) * torch.rand(rows, in_features, generator=generator) * 8).to(dtype)
            got = run_quantized(library, x, weight.values, weight.scale, weight.offset, weight.group_shift, out_features, bias, weight.sub)
            want = quantize_activations(x, size).double() @ dequantize(weight).double().T + bias.double()
            assert got.dtype == dtype
            tolerance = (2e-2 if dtype == torch.bfloat16 else 1e-5) * (want.abs().max() + 1)
            assert (got.double() - want).abs().max() <= tolerance, (out_features, rows)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("method", ["int8", "int4", "q6"])
def test_bf16_activations_cross_the_kernel_as_torch_converts_them(method, isa):
    """bf16 activations are widened and the outputs rounded in C, not by torch each side of the call:
    the same bits as the fp32 product of the widened rows, rounded to bf16 by torch (ties to even)."""
    library = built(isa, "q8" if method == "int8" else "q4")
    generator = torch.Generator().manual_seed(4)
    weight = random_q6(37, 512, generator) if method == "q6" else quantize(torch.randn(37, 512, generator=generator), method)
    bias = torch.randn(37, generator=generator).to(torch.bfloat16)

    def run(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return run_quantized(library, x, weight.values, weight.scale, weight.offset, weight.group_shift, 37, bias, weight.sub)

    for rows in (1, 3, 70):  # the decoding tiles and the prefill's product
        x = torch.randn(rows, 512, generator=generator).to(torch.bfloat16)
        got = run(x, bias)
        assert got.dtype == torch.bfloat16 and torch.equal(got, run(x.float(), bias.float()).to(torch.bfloat16)), rows


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_6_bit_kernel_multiplies_the_dequantized_weights_by_the_quantized_activations(dtype, isa):
    """A GGUF file's Q6_K (q6, through the 4-bit kernel: m = sc, o = -32 d) likewise, activations per
    super-block of 256: fp32 rounding only, on and off the tiles and the prefill's lanes."""
    library = built(isa, "q4")
    generator = torch.Generator().manual_seed(3)
    for out_features, in_features in ((37, 512), (300, 4608)):
        weight = random_q6(out_features, in_features, generator)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        for rows in (1, 4, 5, 48, 70):
            x = (torch.randn(rows, in_features, generator=generator) * torch.rand(rows, in_features, generator=generator) * 8).to(dtype)
            got = run_quantized(library, x, weight.values, weight.scale, weight.offset, weight.group_shift, out_features, bias, weight.sub)
            want = quantize_activations(x, 256).double() @ dequantize(weight).double().T + bias.double()
            tolerance = (2e-2 if dtype == torch.bfloat16 else 1e-5) * (want.abs().max() + 1)
            assert got.dtype == dtype and (got.double() - want).abs().max() <= tolerance, (out_features, rows)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [16, 32, 64, 128, 1024])
def test_the_int8_kernel_multiplies_the_dequantized_weights_by_the_quantized_activations(group, dtype, isa):
    """An int8 layer computes the dequantized weights times each row's activations quantized per
    block (the group, from 32 to 128 values): the integer products are exact, so it differs from
    that product, taken in float64, by fp32 rounding only. Groups of 16 (lane by lane), 32 (Q8_0),
    64, 128 (ours) and one per row; weights of -128 (GGUF allows them) included."""
    library = built(isa, "q8")
    generator = torch.Generator().manual_seed(2)
    for out_features, in_features in ((37, 128), (300, 1024)):
        values = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
        scale = torch.rand(out_features, max(1, in_features // group), generator=generator) / 64
        weight = QuantizedWeight("q8", values, scale, None, group.bit_length() - 1, (out_features, in_features))
        bias = torch.randn(out_features, generator=generator).to(dtype)
        for rows in (1, 2, 5, 70):
            x = (torch.randn(rows, in_features, generator=generator) * torch.rand(rows, in_features, generator=generator) * 8).to(dtype)
            got = run_quantized(library, x, values, scale, None, weight.group_shift, out_features, bias)
            want = quantize_activations(x, activation_block(weight.group_shift)).double() @ dequantize(weight).double().T + bias.double()
            assert got.dtype == dtype
            tolerance = (2e-2 if dtype == torch.bfloat16 else 1e-5) * (want.abs().max() + 1)
            assert (got.double() - want).abs().max() <= tolerance, (out_features, rows)


def test_activations_are_quantized_per_row_and_block_of_32():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2, 1, 32)
    x[1, 32:] = 1000.0
    q = quantize_activations(x)
    # Block (0, 0): steps of 2 / 127, the largest magnitude exact; all-zero blocks stay zero.
    assert torch.allclose(q[0, :32], x[0, :32], atol=1 / 127 + 1e-6) and q[0, 0] == -2
    assert torch.equal(q[0, 32:], x[0, 32:]) and torch.equal(q[1, :32], x[1, :32]) and torch.equal(q[1, 32:], x[1, 32:])


def test_weights_of_another_shape_are_refused():
    library = built("AVX2", "q8")
    weight = quantize(torch.randn(8, 64), "int8")
    with pytest.raises(ValueError, match="do not take 32 features"):
        run_quantized(library, torch.randn(2, 32), weight.values, weight.scale, None, weight.group_shift, 8, None)
    with pytest.raises(ValueError, match="do not take 48 features"):  # int8 activations come in blocks of 32
        run_quantized(library, torch.randn(2, 48), torch.zeros(8, 48, dtype=torch.int8), torch.ones(8, 3), None, 4, 8, None)
    with pytest.raises(ValueError, match="do not take 96 features"):  # and of 128 for groups of 128
        run_quantized(library, torch.randn(2, 96), torch.zeros(8, 96, dtype=torch.int8), torch.ones(8, 1), None, 7, 8, None)
    q4 = built("AVX2", "q4")
    weight = quantize(torch.randn(8, 256), "int4")
    with pytest.raises(ValueError, match="do not take 128 features"):  # 4-bit super-blocks are whole
        run_quantized(q4, torch.randn(2, 128), weight.values, weight.scale, weight.offset, weight.group_shift, 8, None, weight.sub)
    with pytest.raises(ValueError, match="6-bit scale and minimum for every 32"):
        run_quantized(q4, torch.randn(2, 256), weight.values, weight.scale, weight.offset, weight.group_shift, 8, None)
