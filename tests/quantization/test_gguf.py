"""A GGUF file's own quantized tensors: Q8_0, Q4_0, Q4_K and Q6_K repacked into the kernel's formats
hold exactly the weights the `gguf` package (llama.cpp's reference) dequantizes them to; on the
packaged 1.5B, where it is installed, its layers keep their GGUF tensors and the model answers
exactly as `generate` of the same quantized model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from packaged_fixtures import installed

from rag_speculate.quantization.formats import dequantize
from rag_speculate.quantization.gguf import read_quantized

TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K]
# Where each type keeps its half-precision scales in a block: (offset, count).
HALVES = {GGMLQuantizationType.Q8_0: (0, 1), GGMLQuantizationType.Q4_0: (0, 1), GGMLQuantizationType.Q4_K: (0, 2),
          GGMLQuantizationType.Q6_K: (208, 1)}  # fmt: skip


def random_blocks(kind: GGMLQuantizationType, rows: int, columns: int, generator: np.random.Generator) -> np.ndarray:
    """Blocks of random bits with finite, varied scales: every code path of the type's layout."""
    block, size = GGML_QUANT_SIZES[kind]
    blocks = generator.integers(0, 256, (rows * columns // block, size), dtype=np.uint8)
    offset, count = HALVES[kind]
    halves = generator.uniform(-0.05, 0.05, (len(blocks), count)).astype(np.float16)
    blocks[:, offset : offset + 2 * count] = halves.view(np.uint8)
    return blocks.reshape(rows, -1)


def test_every_kernel_type_is_repacked_exactly(tmp_path):
    generator = np.random.default_rng(0)
    path = tmp_path / "tensors.gguf"
    writer = GGUFWriter(path, "llama")
    written = {}
    for kind in TYPES:
        name = f"{kind.name.lower()}.weight"
        written[name] = (kind, random_blocks(kind, 48, 512, generator))
        writer.add_tensor(name, written[name][1], raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    kept, other = read_quantized(GGUFReader(path), set(written) | {"absent.weight"})
    assert other == {} and set(kept) == set(written)
    for name, (kind, blocks) in written.items():
        want = torch.from_numpy(gguf_dequantize(blocks, kind).reshape(48, 512).astype(np.float32))
        got = dequantize(kept[name])
        fmt = {GGMLQuantizationType.Q4_K: "q4", GGMLQuantizationType.Q6_K: "q6"}.get(kind, "q8")
        assert kept[name].shape == (48, 512) and kept[name].format == fmt
        assert torch.equal(got, want), (kind.name, (got - want).abs().max())


def test_a_type_without_a_kernel_is_reported(tmp_path):
    path = tmp_path / "q5.gguf"
    writer = GGUFWriter(path, "llama")
    kind = GGMLQuantizationType.Q5_0
    writer.add_tensor("q5.weight", np.zeros((4, 32 // 32 * GGML_QUANT_SIZES[kind][1] * 8), dtype=np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    kept, other = read_quantized(GGUFReader(path), {"q5.weight"})
    assert kept == {} and other == {"q5.weight": "Q5_0"}


TARGET = "qwen2.5-coder-1.5b-instruct"


@pytest.mark.skipif(not installed(TARGET), reason=f"the packaged {TARGET} is not installed (bash scripts/setup.sh demo installs it)")
def test_the_packaged_target_keeps_its_gguf_tensors_and_answers_as_its_own_generate():
    from rag_speculate import NGramTrieDrafter, SpeculativeEngine
    from rag_speculate.quantization.layer import QuantizedLinear

    engine = SpeculativeEngine.from_pretrained(TARGET, NGramTrieDrafter(), dtype=torch.float32, device="cpu", quantization="gguf")
    layers = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
    # Every projection of the 28 blocks and the output: Q4_K and Q6_K tensors, none left in fp32.
    assert len(layers) == 28 * 7 + 1 and not any(isinstance(m, torch.nn.Linear) for m in engine.model.modules())
    prompt = engine.encode_prompt([{"role": "user", "content": "Write a Python function that adds two numbers."}], chat=True)
    ids = torch.tensor([prompt])
    reference = engine.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)[0, len(prompt):]
    assert engine.generate(prompt, max_new_tokens=12).token_ids == reference.tolist()
