"""The lean forward gives a model's own logits bit for bit (through torch or the CPU kernels, dense
or quantized, one row or a batch), and refuses models it does not compute."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import DEVICE, VOCAB, tiny_model
from transformers import DynamicCache

from rag_speculate.decoding.batch import BatchCache, BatchForward, Fed
from rag_speculate.decoding.kv_cache import cache_keyword
from rag_speculate.decoding.lean_forward import Kernels, lean_forward
from rag_speculate.decoding.tree import DraftTree, tree_attention_mask, tree_position_ids

needs_cpu = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU kernels and quantized layers run on the CPU")


def _kernels(model, through: str):
    """The kernels and the context the engine would run `model`'s forwards with."""
    if through == "torch":
        return Kernels(), contextlib.nullcontext
    from rag_speculate.cpu import forward_context, kernel_functions

    context, reason = forward_context(model)
    assert context is not None, reason
    return Kernels(*kernel_functions()), context


def _forwards(model, forward) -> list[torch.Tensor]:
    """Logits of a prefill (its last row's, as the engine keeps), a one-token step, a chain and a
    tree-masked step on top, through `forward`."""
    cache = DynamicCache(config=model.config)
    tree = DraftTree([5, 6, 7, 8], [-1, 0, -1, 2])
    return [
        forward(input_ids=torch.tensor([[(5 * i + 2) % VOCAB for i in range(10)]], device=DEVICE), cache=cache, logits_to_keep=1),
        forward(input_ids=torch.tensor([[9]], device=DEVICE), cache=cache),
        forward(input_ids=torch.tensor([[3, 11, 12]], device=DEVICE), cache=cache),
        forward(
            input_ids=torch.tensor([[4, *tree.tokens]], device=DEVICE), cache=cache,
            attention_mask=tree_attention_mask(tree, 14, model.dtype, DEVICE), position_ids=tree_position_ids(tree, 14, DEVICE),
        ),
    ]  # fmt: skip


def _own(model, context):
    def forward(cache, **inputs):
        with context():
            return model(**inputs, **{cache_keyword(model): cache}, use_cache=True).logits

    return forward


def _lean_gives_the_models_own_bits(model, through: str):
    """The lean forward the engine would build for `model`, having checked its logits on
    `_forwards` against the model's own, bit for bit."""
    kernels, context = _kernels(model, through)
    lean, reason = lean_forward(model, kernels, exact=True, context=context)
    assert lean is not None, reason
    with torch.inference_mode():
        want, got = _forwards(model, _own(model, context)), _forwards(model, lean)
    for ours, theirs in zip(got, want):
        assert torch.equal(ours, theirs)
    return lean


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("through", ["torch", pytest.param("kernels", marks=needs_cpu)])
def test_logits_are_the_models_own_bit_for_bit(arch, through):
    _lean_gives_the_models_own_bits(tiny_model(arch, seed=1), through)


@needs_cpu
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_models_logits_are_its_own_bit_for_bit(method, dtype):
    from rag_speculate.quantization.layer import QuantizedLinear, quantize_model

    model = tiny_model("qwen2", seed=1, dtype=dtype)
    quantize_model(model, method)
    lean = _lean_gives_the_models_own_bits(model, "kernels")
    # Queries, keys and values are one product now; the model's own layers read the same weights.
    attention = model.model.layers[0].self_attn
    fused = lean._layers[0][1]
    storage = attention.q_proj.values.untyped_storage().data_ptr()
    assert isinstance(attention.q_proj, QuantizedLinear) and attention.k_proj.values.untyped_storage().data_ptr() == storage
    assert len(fused(torch.zeros(1, 1, attention.q_proj.in_features, dtype=dtype))) == 3


@needs_cpu
def test_a_prefill_through_the_kernels_runs_its_last_layer_for_the_kept_row_only():
    from rag_speculate.quantization.layer import quantize_model

    model = tiny_model("llama", seed=4)
    quantize_model(model, "int8")
    lean = _lean_gives_the_models_own_bits(model, "kernels")  # the rows skipped change no logit
    rows = {}
    for i in (0, -1):
        model.model.layers[i].mlp.down_proj.register_forward_hook(lambda m, args, out, i=i: rows.setdefault(i, args[0].shape[1]))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        lean(torch.tensor([[3, 4, 5, 6, 7, 8]], device=DEVICE), cache, logits_to_keep=1)
    assert rows == {0: 6, -1: 1} and cache.get_seq_length() == 6  # every row's keys and values are kept


@needs_cpu
def test_layers_of_other_formats_run_one_call_each_with_the_same_bits():
    # As a GGUF file's layers sit: q and k in 4 bits, v in another format (Q4_K beside Q6_K; here int8).
    from rag_speculate.quantization.formats import quantize
    from rag_speculate.quantization.layer import QuantizedLinear, quantize_model

    model = tiny_model("qwen2", seed=3)
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            names[name] = quantize(module.weight, "int8" if name.endswith("v_proj") else "int4")
    quantize_model(model, "gguf", names)
    assert isinstance(model.model.layers[0].self_attn.v_proj, QuantizedLinear)
    _lean_gives_the_models_own_bits(model, "kernels")


@pytest.mark.parametrize("through", ["torch", pytest.param("kernels", marks=needs_cpu)])
def test_a_batch_through_the_lean_forward_gets_the_models_own_logits(through):
    model = tiny_model("qwen2", seed=2)
    kernels, context = _kernels(model, through)
    lean, reason = lean_forward(model, kernels, exact=True, context=context)
    assert lean is not None, reason
    got = []
    for forward in (BatchForward(model, forward=lean), BatchForward(model, context=context)):
        cache = BatchCache(model)
        rows = [cache.add_row(), cache.add_row()]
        prompts = [[3, 4, 5, 6, 7], [8, 9]]
        forward(cache, [Fed(r, p) for r, p in zip(rows, prompts)])
        for r, p in zip(rows, prompts):
            cache.advance(r, len(p))
        got.append(forward(cache, [Fed(rows[0], [10, 11, 12], [-1, 0, 0]), Fed(rows[1], [13])]))
    for ours, theirs in zip(*got):
        assert torch.equal(ours, theirs)


def test_only_the_last_rows_logits_are_computed_when_asked():
    model = tiny_model("qwen2", seed=1)
    lean, _ = lean_forward(model, exact=True)
    ids = torch.tensor([[3, 4, 5, 6]], device=DEVICE)
    with torch.inference_mode():
        full = lean(ids, DynamicCache(config=model.config))
        last = lean(ids, DynamicCache(config=model.config), logits_to_keep=1)
    assert last.shape == (1, 1, VOCAB)
    torch.testing.assert_close(last[0, 0], full[0, -1])  # torch's product rounds by its rows


@pytest.mark.parametrize(
    "arch, overrides, named",
    [
        ("gpt2", {}, "not a Llama-family decoder"),
        ("gemma3", {}, "normalises queries and keys"),
        ("mistral", {"sliding_window": 64}, "sliding-window"),
    ],
)
def test_models_of_other_shapes_are_refused_with_the_reason(arch, overrides, named):
    lean, reason = lean_forward(tiny_model(arch, **overrides), exact=True)
    assert lean is None
    assert named in reason


def test_a_model_that_computes_otherwise_is_caught_by_the_probe():
    # An MLP whose own forward does more than its modules (another family might): the lean forward
    # calls the modules, not that forward, so only the probe can tell.
    model = tiny_model("llama", seed=1)
    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x: mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)) * 1.5
    lean, reason = lean_forward(model, exact=True)
    assert lean is None
    assert "differ from the model's own" in reason
