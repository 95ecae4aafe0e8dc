"""The core (decoding, drafters, retrieval) stands without the CPU kernel layer."""

from __future__ import annotations

import subprocess
import sys

KERNEL_MODULES = ("rag_speculate.cpu.kernels", "rag_speculate.cpu.linear", "rag_speculate.cpu.attention", "rag_speculate.cpu.build")


def _loaded_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint(' '.join(m for m in sys.modules if m.startswith('rag_speculate')))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=300).stdout
    return set(out.split())


def test_importing_the_package_the_engine_and_the_drafters_loads_no_kernel_module():
    loaded = _loaded_after("import rag_speculate, rag_speculate.drafters, rag_speculate.decoding.engine, rag_speculate.retrieval.corpus")
    assert "rag_speculate.decoding.engine" in loaded and "rag_speculate.drafters.ouroboros.drafter" in loaded
    assert not loaded & set(KERNEL_MODULES)


def test_an_engine_without_the_cpu_kernels_never_loads_them():
    code = (
        "import torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "from tokenizers import Tokenizer, models\n"
        "from rag_speculate import SpeculativeEngine\n"
        "torch.manual_seed(0)\n"
        "model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))\n"
        "vocab = {chr(97 + i): i for i in range(26)} | {'<eos>': 26}\n"
        "tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token='a')), eos_token='<eos>')\n"
        "engine = SpeculativeEngine(model, tokenizer, fast_kernels=False)\n"
        "assert engine.generate([1, 2, 3, 1, 2], max_new_tokens=4).token_ids\n"
    )
    assert not _loaded_after(code) & set(KERNEL_MODULES)
