"""The quantized formats: int8 and 4-bit weights round-trip within half a step, the 4-bit packing is
its own inverse, the 4-bit kernel multiplies by exactly `dequantize(weight)`, bit for bit, and the
int8 kernel computes the product of the dequantized weights and `quantize_activations(x)`, for any
number of rows, fp32 and bf16 activations, on every instruction set this CPU builds."""

from __future__ import annotations

import pytest
import torch

from rag_speculate import InvalidArgumentError
from rag_speculate.cpu.linear import _Q8_SOURCE, _SOURCE, activation_block, build_linear, build_linear_q8, run_linear, run_quantized
from rag_speculate.quantization.formats import QuantizedWeight, dequantize, fits, pack_q4, quantize, quantize_activations, unpack_q4

ISAS = ["AVX2", "AVX512"]


def built(dtype: torch.dtype, isa: str, weights: str = ""):
    if isa == "AVX512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip(f"this CPU has no AVX-512 (torch reports {torch.backends.cpu.get_cpu_capability()})")
    library, reason = build_linear_q8(_Q8_SOURCE, isa) if weights == "q8" else build_linear(_SOURCE, dtype, isa, weights)
    if library is None:
        pytest.skip(reason)
    return library


def test_packing_4_bit_values_is_its_own_inverse():
    q = torch.randint(0, 16, (7, 96), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_q4(q)
    assert packed.shape == (7, 48) and torch.equal(unpack_q4(packed, 96), q)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_weights_come_back_within_half_a_step(method):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    weight = quantize(w, method)
    error = (dequantize(weight) - w).abs()
    assert torch.all(error <= weight.scale.repeat_interleave(weight.group, dim=1) / 2 + 1e-6)
    if method == "int8":  # a scale per 128 values (the largest group that divides 128 inputs)
        assert weight.values.dtype == torch.int8 and weight.scale.shape == (64, 1) and weight.offset is None
    else:  # a scale and an offset per 32 values
        assert weight.values.shape == (64, 64) and weight.scale.shape == weight.offset.shape == (64, 4)
    # Bytes per weight: int8 one and 4 bytes of fp32 scale per 128; 4 bits half a byte and 8 bytes of scale and offset per 32.
    assert weight.nbytes == w.numel() * (1 + 4 / 128 if method == "int8" else 0.75)


def test_int8_groups_are_the_largest_that_divide_the_inputs():
    assert [quantize(torch.ones(2, n), "int8").group for n in (1536, 8960, 96, 160)] == [128, 128, 32, 32]
    assert quantize(torch.ones(2, 192), "int8").group == 64 and quantize(torch.ones(2, 128), "int8", group=32).group == 32


def test_what_does_not_fit_is_named():
    assert fits(128, "int4") == "" and fits(64, "int8") == ""
    assert "activation block of 32" in fits(48, "int8") and "activation block of 128" in fits(64, "int8", group=128)
    assert "group of 32" in fits(48, "int4")
    with pytest.raises(InvalidArgumentError, match="unknown quantization 'int3'") as raised:
        quantize(torch.zeros(4, 16), "int3")
    assert raised.value.argument == "quantization"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_4_bit_kernel_multiplies_by_exactly_the_dequantized_weights(dtype, isa):
    """A 4-bit layer computes what an fp32 layer holding `dequantize(weight)` computes on the same
    activations, rounded once to their dtype: any rows, on and off the kernel's tiles."""
    quantized, full = built(dtype, isa, "q4"), built(torch.float32, isa)
    generator = torch.Generator().manual_seed(2)
    for out_features, in_features in ((37, 64), (300, 256)):
        weight = quantize(torch.randn(out_features, in_features, generator=generator), "int4")
        bias = torch.randn(out_features, generator=generator).to(dtype)
        for rows in (1, 4, 5, 48, 70):
            x = torch.randn(rows, in_features, generator=generator).to(dtype)
            got = run_quantized(quantized, x, weight.values, weight.scale, weight.offset, weight.group_shift, out_features, bias)
            want = run_linear(full, x.float(), dequantize(weight), bias.float()).to(dtype)
            assert torch.equal(got, want), (out_features, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [16, 32, 64, 128, 1024])
def test_the_int8_kernel_multiplies_the_dequantized_weights_by_the_quantized_activations(group, dtype):
    """An int8 layer computes the dequantized weights times each row's activations quantized per
    block (the group, from 32 to 128 values): the integer products are exact, so it differs from
    that product, taken in float64, by fp32 rounding only. Groups of 16 (GGUF's Q6_K), 32 (Q8_0),
    64, 128 (ours) and one per row; weights of -128 (GGUF allows them) included."""
    library = built(torch.float32, "AVX2", "q8")
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
    library = built(torch.float32, "AVX2", "q8")
    weight = quantize(torch.randn(8, 64), "int8")
    with pytest.raises(ValueError, match="do not take 32 features"):
        run_quantized(library, torch.randn(2, 32), weight.values, weight.scale, None, weight.group_shift, 8, None)
    with pytest.raises(ValueError, match="do not take 48 features"):  # int8 activations come in blocks of 32
        run_quantized(library, torch.randn(2, 48), torch.zeros(8, 48, dtype=torch.int8), torch.ones(8, 3), None, 4, 8, None)
    with pytest.raises(ValueError, match="do not take 96 features"):  # and of 128 for groups of 128
        run_quantized(library, torch.randn(2, 96), torch.zeros(8, 96, dtype=torch.int8), torch.ones(8, 1), None, 7, 8, None)
