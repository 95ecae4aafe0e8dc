"""Quantized targets: a model whose linear layers are quantized (int8, int4) answers through the
engine exactly as its own `generate` does (greedy, fp32), alone and batched, through both forward
paths; in bf16 speculation gives the quantized model's own plain decoding; a model quantized
through transformers' `quantization_config` (torchao, bitsandbytes) works unchanged; bad requests are named."""

from __future__ import annotations

import tempfile

import pytest
import torch
from conftest import DEVICE, hf_greedy, tiny_model
from packaged_fixtures import DOCUMENT, MODEL, installed

from rag_speculate import InvalidArgumentError, NGramTrieDrafter, SpeculativeEngine
from rag_speculate.decoding.budget import CostModel
from rag_speculate.models.loading import _check_quantization, load_model
from rag_speculate.quantization.layer import QuantizedLinear, quantize_model

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick", "a tall oak tree, as foxes", "one two three four"]


def quantized(arch: str, method: str, dtype: torch.dtype = torch.float32):
    model = tiny_model(arch, dtype=dtype)
    assert quantize_model(model, method) == {}
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    return model


@pytest.mark.usefixtures("forward_path")
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_speculation_over_a_quantized_model_is_its_own_generate(arch, method, tokenizer):
    model = quantized(arch, method)
    engine = SpeculativeEngine(model, tokenizer, NGramTrieDrafter())
    # A flat cost curve: drafts always pay, whatever a loaded machine's timing said.
    engine.cost_model = CostModel({1: 1.0, engine.draft_budget + 1: 1.0}, learn=False)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    references = [hf_greedy(model, i, 24) for i in ids]
    # Its own continuation as the document: long drafts, accepted, then a miss.
    alone = engine.generate(ids[0], documents=[tokenizer.decode(references[0])], max_new_tokens=24)
    assert alone.token_ids == references[0] and alone.stats.target_forwards < 24
    together = engine.generate_batch(ids, max_new_tokens=24)
    assert [r.token_ids for r in together] == references


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_in_bf16_speculation_is_the_quantized_models_plain_decoding(method, tokenizer):
    model = quantized("llama", method, torch.bfloat16)
    ids = tokenizer.encode(PROMPTS[0])
    plain = SpeculativeEngine(model, tokenizer, draft_budget=0).generate(ids, max_new_tokens=24).token_ids
    engine = SpeculativeEngine(model, tokenizer, NGramTrieDrafter())
    assert engine.traits.kernels
    assert engine.generate(ids, documents=[tokenizer.decode(plain)], max_new_tokens=24).token_ids == plain


def transformers_quantization(kind: str):
    """The `quantization_config` users pass to `from_pretrained` (the dev extra installs both packages;
    a GPU machine may lack one, and then the test skips)."""
    from transformers import BitsAndBytesConfig, TorchAoConfig

    if kind == "torchao-int8":
        pytest.importorskip("torchao")
        from torchao.quantization import Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    pytest.importorskip("bitsandbytes")
    if kind == "bitsandbytes-8bit":
        # No outlier columns: with them a row's result depends on its neighbours (the test below).
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)


@pytest.mark.parametrize("kind", ["torchao-int8", "bitsandbytes-8bit", "bitsandbytes-4bit"])
def test_a_model_quantized_through_transformers_works_unchanged(kind, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    config = transformers_quantization(kind)
    tiny_model("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, dtype=torch.float32,
                                                 device_map=DEVICE).eval()  # fmt: skip
    assert type(model.model.layers[0].mlp.up_proj.weight) is not torch.nn.Parameter
    engine = SpeculativeEngine(model, tokenizer, NGramTrieDrafter())
    assert not engine.traits.kernels  # their tensors run their own kernels
    ids = [tokenizer.encode(p) for p in PROMPTS]
    references = [hf_greedy(model, i, 24) for i in ids]
    alone = engine.generate(ids[0], documents=[tokenizer.decode(references[0])], max_new_tokens=24)
    assert alone.token_ids == references[0] and alone.stats.target_forwards < 24
    assert [r.token_ids for r in engine.generate_batch(ids, max_new_tokens=24)] == references
    with pytest.raises(InvalidArgumentError, match="quantized through transformers") as raised:
        quantize_model(model, "int8")
    assert raised.value.argument == "quantization"


def test_llm_int8_outlier_columns_are_named_as_rows_that_interact(tokenizer, tmp_path):
    """bitsandbytes' default LLM.int8 picks its 16-bit outlier columns over all the rows of a forward
    (on a GPU a batched answer left generate's); the engine says so when it is built."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                                 dtype=torch.float32, device_map=DEVICE)  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"LLM.int8 \(llm_int8_threshold=6.0\).*llm_int8_threshold=0.0"):
        SpeculativeEngine(model, tokenizer)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_fused_layers_give_each_layers_product_and_share_its_weights(method):
    from rag_speculate.quantization.formats import quantize

    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, n, bias=True) for n in (64, 32, 32)]
    parts = [QuantizedLinear(quantize(layer.weight, method), layer.bias) for layer in layers]
    x = torch.randn(3, 256)
    alone = [p(x) for p in parts]
    fused = QuantizedLinear.fused(parts)
    assert all(torch.equal(got, want) for got, want in zip(fused(x).split([64, 32, 32], dim=-1), alone))
    assert all(torch.equal(p(x), want) for p, want in zip(parts, alone))  # they read the fused weights now
    assert parts[1].values.data_ptr() == fused.values[64:].data_ptr()
    again = QuantizedLinear.fused(parts)  # another engine on the same layers: the same weights, no copy
    assert again.values.data_ptr() == fused.values.data_ptr() and again.scale.data_ptr() == fused.scale.data_ptr()
    assert all(torch.equal(got, want) for got, want in zip(again(x).split([64, 32, 32], dim=-1), alone))
    other = QuantizedLinear(quantize(torch.nn.Linear(256, 8).weight, "int4" if method == "int8" else "int8"), None)
    with pytest.raises(ValueError, match="one format"):
        QuantizedLinear.fused([parts[0], other])


def test_layers_that_do_not_fit_stay_as_they_are(tokenizer):
    model = tiny_model("llama", hidden_size=48, intermediate_size=128)  # 48 inputs: no whole 4-bit super-block of 64
    left = quantize_model(model, "int4")
    assert left and all("super-block of 64" in why for why in left.values())
    assert any(isinstance(m, QuantizedLinear) for m in model.modules())  # the 128-input down projections
    ids = tokenizer.encode(PROMPTS[0])
    assert SpeculativeEngine(model, tokenizer).generate(ids, max_new_tokens=12).token_ids == hf_greedy(model, ids, 12)


def test_bad_quantization_requests_are_named():
    model = quantized("llama", "int8")
    for call, problem in [
        (lambda: quantize_model(model, "int8"), "already rag_speculate's quantized layers"),
        (lambda: quantize_model(tiny_model("llama"), "int3"), "unknown quantization 'int3'"),
        (lambda: load_model("x", quantization="fp8", device="cpu"), "unknown quantization 'fp8'"),
        # Checked before anything loads (a GPU machine's device, named here without one).
        (lambda: _check_quantization("x", "int8", torch.bfloat16, torch.device("cuda")), "runs on the CPU kernels, not on cuda"),
        (lambda: load_model(tempfile.gettempdir(), quantization="gguf", device="cpu"), "not a .gguf file or a packaged model"),
        (lambda: SpeculativeEngine.from_pretrained("x", quantization="int5", device="cpu"), "unknown quantization 'int5'"),
    ]:
        with pytest.raises(InvalidArgumentError, match=problem) as raised:
            call()
        assert raised.value.argument == "quantization"


@pytest.mark.skipif(not installed(MODEL), reason=f"the packaged {MODEL} is not installed (bash scripts/setup.sh test installs it)")
def test_every_entrance_takes_the_option_and_answers_as_the_quantized_model():
    """The packaged SmolLM2 in int4 through the entrances' one engine factory, and LangChain's model:
    the answer is the quantized model's own `generate`, and `quantization` beside engine= is refused."""
    from langchain_rag_speculate import SpeculativeHFLLM
    from pydantic import ValidationError

    from rag_speculate.entrypoints.engines import shared_engine

    engine = shared_engine(MODEL, dtype="float32", device="cpu", draft_budget=None, quantization="int4")
    assert not any(isinstance(m, torch.nn.Linear) for m in engine.model.modules())
    prompt = f"{DOCUMENT}\n\nQuestion: Who designed the Eiffel Tower?\nAnswer:"
    expected = engine.generate(prompt, documents=[DOCUMENT], max_new_tokens=12)
    assert expected.token_ids == hf_greedy(engine.model, engine.encode_prompt(prompt, chat=False), 12)
    llm = SpeculativeHFLLM(model=MODEL, dtype="float32", device="cpu", quantization="int4", max_tokens=12)
    assert llm.invoke(prompt) == expected.text
    assert llm.engine is engine  # loaded on first use: the same one
    with pytest.raises(ValidationError, match="quantization configure loading a model"):
        SpeculativeHFLLM(engine=engine, quantization="int8")


@pytest.mark.skipif(not installed(MODEL), reason=f"the packaged {MODEL} is not installed (bash scripts/setup.sh test installs it)")
@pytest.mark.parametrize("method", ["int8", "gguf"])
def test_a_model_the_engine_quantized_answers_through_its_own_generate_as_through_the_engine(method):
    """Outside any mode, in the dtype a user gets by default: the kernels travel with its modules.
    Before they did, its own generate left the engine's answer on one of these prompts in bf16."""
    engine = SpeculativeEngine.from_pretrained(MODEL, device="cpu", quantization=method)
    assert engine.model.config._attn_implementation == "rag_speculate_cpu"
    assert not any(type(m) is torch.nn.Linear for m in engine.model.modules())
    for prompt in ["The Eiffel Tower is in", "Write a haiku about the sea.", "def fibonacci(n):"]:
        ids = engine.encode_prompt(prompt)
        assert engine.generate(ids, max_new_tokens=32).token_ids == hf_greedy(engine.model, ids, 32), prompt


def test_a_model_the_user_passes_is_never_modified(tokenizer):
    model = tiny_model("llama")
    classes, attention = [type(m) for m in model.modules()], model.config._attn_implementation
    SpeculativeEngine(model, tokenizer).generate(tokenizer.encode(PROMPTS[0]), max_new_tokens=4)
    assert [type(m) for m in model.modules()] == classes and model.config._attn_implementation == attention
