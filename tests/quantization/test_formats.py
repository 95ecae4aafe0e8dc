"""The quantized formats: int8 and 4-bit weights round-trip within half a step, the 4-bit packing is
its own inverse, and the CPU kernel multiplies by exactly `dequantize(weight)`, bit for bit, for
any number of rows, fp32 and bf16 activations, on every instruction set this CPU builds."""

from __future__ import annotations

import pytest
import torch

from rag_speculate import InvalidArgumentError
from rag_speculate.cpu.linear import _SOURCE, build_linear, run_linear, run_quantized
from rag_speculate.quantization.formats import dequantize, fits, pack_q4, quantize, unpack_q4

ISAS = ["AVX2", "AVX512"]


def built(dtype: torch.dtype, isa: str, weights: str = ""):
    if isa == "AVX512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip(f"this CPU has no AVX-512 (torch reports {torch.backends.cpu.get_cpu_capability()})")
    library, reason = build_linear(_SOURCE, dtype, isa, weights)
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
    if method == "int8":  # one scale per output row
        assert weight.values.dtype == torch.int8 and weight.scale.shape == (64, 1)
        assert torch.all(error <= weight.scale / 2 + 1e-6)
    else:  # a scale and an offset per 32 values
        assert weight.values.shape == (64, 64) and weight.scale.shape == weight.offset.shape == (64, 4)
        assert torch.all(error <= weight.scale.repeat_interleave(32, dim=1) / 2 + 1e-6)
    # Bytes per weight: int8 one and a row scale; 4 bits half a byte and 8 bytes of fp32 scale and offset per 32.
    assert weight.nbytes == w.numel() * (1 if method == "int8" else 0.75) + (64 * 4 if method == "int8" else 0)


def test_what_does_not_fit_is_named():
    assert fits(128, "int4") == "" and fits(64, "int8") == ""
    assert "multiple of 16" in fits(40, "int8")
    assert "group of 32" in fits(48, "int4")
    with pytest.raises(InvalidArgumentError, match="unknown quantization 'int3'") as raised:
        quantize(torch.zeros(4, 16), "int3")
    assert raised.value.argument == "quantization"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_kernel_multiplies_by_exactly_the_dequantized_weights(method, dtype, isa):
    """A quantized layer computes what an fp32 layer holding `dequantize(weight)` computes on the same
    activations, rounded once to their dtype: any rows, on and off the kernel's tiles."""
    quantized, full = built(dtype, isa, "q8" if method == "int8" else "q4"), built(torch.float32, isa)
    generator = torch.Generator().manual_seed(2)
    for out_features, in_features in ((37, 64), (300, 256)):
        weight = quantize(torch.randn(out_features, in_features, generator=generator), method)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        for rows in (1, 4, 5, 48, 70):
            x = torch.randn(rows, in_features, generator=generator).to(dtype)
            got = run_quantized(quantized, x, weight.values, weight.scale, weight.offset, weight.group_shift, out_features, bias)
            want = run_linear(full, x.float(), dequantize(weight), bias.float()).to(dtype)
            assert torch.equal(got, want), (out_features, rows)


def test_weights_of_another_shape_are_refused():
    library = built(torch.float32, "AVX2", "q8")
    weight = quantize(torch.randn(8, 64), "int8")
    with pytest.raises(ValueError, match="do not take 32 features"):
        run_quantized(library, torch.randn(2, 32), weight.values, weight.scale, None, weight.group_shift, 8, None)
