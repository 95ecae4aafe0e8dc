"""The 4-bit draft layers: the kernel computes what its layout and quantization say, forwards over
few rows take it and larger ones int8, and a draft model through it keeps the output identical."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, tiny_model
from test_ouroboros import PROMPTS, make_drafter, make_engine
from transformers import DynamicCache

from rag_speculate import cpu_linear
from rag_speculate.errors import InvalidArgumentError
from rag_speculate.lean_forward import lean_forward
from rag_speculate.loading import Int4Linear, Int8Linear, int8_draft_model

library, why_not = cpu_linear.int4_linear_library()
needs_kernel = pytest.mark.skipif(library is None, reason=f"4-bit kernel unavailable: {why_not}")
WIDE = {"hidden_size": 128, "intermediate_size": 256}  # every layer's input a multiple of 128


def dequantized(nibbles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weights `int4_weights` stored, read back by its documented layout."""
    out = nibbles.shape[0]
    low, high = (nibbles & 15).to(torch.float32) - 8, (nibbles >> 4).to(torch.float32) - 8
    blocks = torch.stack([low.reshape(out, -1, 32), high.reshape(out, -1, 32)], dim=2)  # [out, blocks, 2, 32]
    return (blocks.reshape(out, -1, cpu_linear.INT4_GROUP) * scales[..., None]).reshape(out, -1)


def in_int8_groups(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel quantizes it: each row's groups of 128 to int8 with their own scale."""
    groups = x.reshape(*x.shape[:-1], -1, cpu_linear.INT4_GROUP)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((groups / scale).round().clamp(-128, 127) * scale).reshape(x.shape)


def test_weights_are_stored_as_the_layout_says():
    torch.manual_seed(0)
    weight = torch.randn(3, 256)
    weight[1, :128] = 0.0  # a group of zeros keeps a usable scale
    nibbles, scales = cpu_linear.int4_weights(weight)
    assert nibbles.dtype == torch.uint8 and nibbles.shape == (3, 128) and scales.shape == (3, 2)
    back = dequantized(nibbles, scales)
    # Each group to 16 levels of its own scale: within half a level, and its largest weight exact.
    assert ((back - weight).abs() <= scales.repeat_interleave(128, dim=1) / 2 + 1e-6).all()
    assert torch.equal(back[1, :128], torch.zeros(128))
    assert torch.allclose(back.abs().reshape(3, 2, 128).amax(-1), weight.abs().reshape(3, 2, 128).amax(-1))


def test_rows_that_are_not_whole_groups_are_refused():
    with pytest.raises(ValueError, match="multiple of 128"):
        cpu_linear.int4_weights(torch.randn(4, 96))


@needs_kernel
def test_the_kernel_computes_the_stored_weights_on_int8_groups_of_x():
    torch.manual_seed(1)
    weight, bias = torch.randn(37, 384) * 0.1, torch.randn(37)  # 37: a remainder past the kernel's row tiles
    x = torch.randn(6, 384)
    x[2, 5] = 40.0  # an outlier coarsens only its own group
    nibbles, scales = cpu_linear.int4_weights(weight)
    got = cpu_linear.run_int4_linear(library, x, nibbles, scales, bias)
    want = torch.nn.functional.linear(in_int8_groups(x).double(), dequantized(nibbles, scales).double(), bias.double())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    # Each row alone gives the same bits: no row's result depends on the others.
    for i in range(len(x)):
        assert torch.equal(cpu_linear.run_int4_linear(library, x[i : i + 1], nibbles, scales, bias), got[i : i + 1])


@needs_kernel
def test_forwards_over_few_rows_run_in_four_bits_and_larger_ones_in_int8():
    model = int8_draft_model(tiny_model("qwen2", seed=0, **WIDE), int4_rows=2)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    linears = 7 * 2 + 1  # q, k, v, o, gate, up, down in two layers, and the head
    assert len(layers) == linears and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(1, 3, 256)
    assert torch.equal(layer(x[:, :2]), cpu_linear.run_int4_linear(library, x[:, :2], layer.nibbles, layer.scales, layer.bias))
    assert torch.equal(layer(x), layer.int8(x))


@needs_kernel
def test_only_layers_of_whole_groups_get_four_bits_and_none_when_asked():
    narrow = int8_draft_model(tiny_model("qwen2", seed=0))  # hidden 64: only down_proj reads 128 values
    assert {type(m.mlp.down_proj) for m in narrow.model.layers} == {Int4Linear}
    assert isinstance(narrow.model.layers[0].self_attn.q_proj, Int8Linear)
    none = int8_draft_model(tiny_model("qwen2", seed=0, **WIDE), int4_rows=0)
    assert not any(isinstance(m, Int4Linear) for m in none.modules())


def test_a_negative_row_count_is_refused():
    with pytest.raises(InvalidArgumentError, match="int4_rows"):
        int8_draft_model(tiny_model("qwen2", seed=0), int4_rows=-1)


@needs_kernel
def test_the_lean_forward_keeps_four_bit_logits_with_fused_projections_and_a_restricted_head():
    model = int8_draft_model(tiny_model("qwen2", seed=1, **WIDE))
    lean, reason = lean_forward(model)
    assert lean is not None, reason
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        want = model(input_ids=ids[:, 4:], past_key_values=None).logits  # two rows: 4 bits
        got = lean(ids[:, 4:], DynamicCache(config=model.config))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        columns = torch.tensor([0, 7, 33])
        lean.restrict_head(columns)
        restricted = lean(ids[:, 4:], DynamicCache(config=model.config))
    torch.testing.assert_close(restricted, want[..., columns], rtol=0, atol=1e-5)


@needs_kernel
def test_a_four_bit_draft_model_keeps_the_output_identical(tokenizer):
    target = tiny_model("qwen2", seed=0, **WIDE)
    draft = int8_draft_model(tiny_model("qwen2", seed=0, **WIDE))
    engine = make_engine(target, tokenizer, make_drafter(draft, tokenizer))
    ids = tokenizer.encode(PROMPTS[0])
    result = engine.generate(ids, max_new_tokens=40)
    assert result.token_ids == hf_greedy(target, ids, 40)
    # In 4 bits, the copy of the target still predicts it: its drafts get accepted.
    assert result.stats.accepted_tokens["draft_model"] > 10
