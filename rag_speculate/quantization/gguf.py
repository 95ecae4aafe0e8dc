"""A GGUF file's own quantized tensors in the kernel's formats, holding exactly the weights llama.cpp
dequantizes them to.

Q4_K is the kernels' own 4-bit format (`formats.py`): its bytes as they are, its 6-bit scales and
minimums unpacked to a byte each, its two halves d and dmin as fp32 (d and -dmin). Q6_K becomes q6:
its 6-bit values repacked in 6 bits (`pack_q6`), its 8-bit scales per 16 as they are, d as fp32 (and
-32 d as the offset), w = d sc (q - 32). The others become int8 (q8): Q8_0 is int8 with a half-precision scale per
32 values; Q4_0 4 bits with a scale d per 32, w = d (q - 8), held as q - 8. Every product of a half
and a small integer is exact in fp32, so every scale is held exactly, and `dequantize` gives the
weights ggml's dequantization gives. Other types have no kernel here: their tensors stay as the
loaded model holds them.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import Q4_K

from .formats import QuantizedWeight, dequantize, pack_q6

# The types with a kernel, and the values per group (Q4_K: per super-block) each becomes.
GROUPS = {GGMLQuantizationType.Q8_0: 32, GGMLQuantizationType.Q4_0: 32, GGMLQuantizationType.Q4_K: 256, GGMLQuantizationType.Q6_K: 256}


def read_quantized(reader: GGUFReader, names: set[str]) -> tuple[dict[str, QuantizedWeight], dict[str, str]]:
    """The tensors of a GGUF file named in `names`: those of a type with a kernel in the kernel's
    formats, and the others' names with their type."""
    kept, other = {}, {}
    for tensor in reader.tensors:
        if tensor.name not in names:
            continue
        if tensor.tensor_type not in GROUPS:
            other[tensor.name] = tensor.tensor_type.name
            continue
        in_features, out_features = (int(n) for n in tensor.shape)
        block_size, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
        blocks = np.asarray(tensor.data).reshape(-1, type_size)
        kept[tensor.name] = _unpack(tensor.tensor_type, blocks, out_features, in_features)
    return kept, other


def _unpack(kind: GGMLQuantizationType, blocks: np.ndarray, rows: int, columns: int) -> QuantizedWeight:
    group = GROUPS[kind]
    if kind == GGMLQuantizationType.Q8_0:
        d, q = _half(blocks[:, :2]), blocks[:, 2:].view(np.int8)
        return _weight("q8", q, d, None, group, rows, columns)
    if kind == GGMLQuantizationType.Q4_0:
        d, qs = _half(blocks[:, :2]), blocks[:, 2:]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int8) - np.int8(8)  # the low halves are the first 16 values
        return _weight("q8", q, d, None, group, rows, columns)
    if kind == GGMLQuantizationType.Q4_K:
        d, dmin = _half(blocks[:, :2]), _half(blocks[:, 2:4])
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        sub = np.concatenate([sc.reshape(-1, 8), m.reshape(-1, 8)], axis=1).astype(np.uint8)
        return _weight("q4", blocks[:, 16:], d, -dmin, group, rows, columns, sub)
    # Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, a half.
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales, d = blocks[:, 192:208].view(np.int8), _half(blocks[:, 208:210])
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = low.reshape(-1, 2, 4, 32) | (high << 4)
    return _weight("q6", pack_q6(torch.from_numpy(q.reshape(rows, columns))).numpy(), d, -32 * d, group, rows, columns, scales)


def _half(raw: np.ndarray) -> np.ndarray:
    """A block's half-precision field, [blocks, 1] in fp32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _weight(
    fmt: str, q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, group: int, rows: int, columns: int,
    sub: np.ndarray | None = None,
) -> QuantizedWeight:  # fmt: skip
    """q: the values (q8: [rows, columns] int8), q6's packed (`pack_q6`), or Q4_K's packed bytes as they are ([rows, columns / 2])."""
    values = torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1))

    def per_group(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(rows, columns // group))

    return QuantizedWeight(
        fmt, values.contiguous(), per_group(scale), None if offset is None else per_group(offset),
        group.bit_length() - 1, (rows, columns), None if sub is None else torch.from_numpy(np.ascontiguousarray(sub).reshape(rows, -1)),
    )  # fmt: skip


# transformers' module names for the linear layers of a llama-style block, by GGUF's names.
_BLOCK_LAYERS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def gguf_layers(model: torch.nn.Module, path: str) -> dict[str, QuantizedWeight]:
    """The quantized weights of the GGUF file at `path` for `model`'s linear layers (loaded from
    that file), by module name: each checked against the layer's own weights, which transformers
    dequantized from the same tensor, so a layer the names or the row order would mismatch keeps
    its weights."""
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            tensor = _tensor_name(name)
            if tensor is not None:
                names[name] = tensor
    reader = GGUFReader(path)
    if "lm_head" in names and not any(t.name == "output.weight" for t in reader.tensors):
        names["lm_head"] = "token_embd.weight"  # tied embeddings: the output reads the embedding's tensor
    tensors, _ = read_quantized(reader, set(names.values()))
    out = {}
    for name, tensor in names.items():
        weight = tensors.get(tensor)
        if weight is not None and _agrees(weight, model.get_submodule(name).weight):
            out[name] = weight
    return out


def _tensor_name(module: str) -> str | None:
    if module == "lm_head":
        return "output.weight"
    parts = module.split(".")
    if len(parts) == 5 and parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in _BLOCK_LAYERS:
        return f"blk.{parts[2]}.{_BLOCK_LAYERS['.'.join(parts[3:])]}.weight"
    return None


def _agrees(weight: QuantizedWeight, loaded: torch.Tensor, rows: int = 8) -> bool:
    """Whether a few rows of `weight`, dequantized and cast as the model was, equal the loaded ones."""
    if weight.shape != tuple(loaded.shape):
        return False
    picked = torch.linspace(0, weight.shape[0] - 1, rows).long().unique()
    sample = QuantizedWeight(
        weight.format, weight.values[picked], weight.scale[picked], None if weight.offset is None else weight.offset[picked],
        weight.group_shift, (len(picked), weight.shape[1]), None if weight.sub is None else weight.sub[picked],
    )  # fmt: skip
    return torch.equal(dequantize(sample).to(loaded.dtype), loaded.detach()[picked].cpu())
