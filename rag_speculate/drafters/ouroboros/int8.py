"""Int8 draft models: linear layers computing in int8, for a draft model on a CPU."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from ...devices import cpu_flags
from ...errors import InvalidArgumentError


def int8_draft_model(model: PreTrainedModel) -> PreTrainedModel:
    """Convert a CPU draft model's linear layers, in place, to compute in int8 (`Int8Linear`).

    For draft models only: the target verifies every drafted token, so the output never changes;
    a draft model that agrees less with the target just gets fewer tokens accepted. On a CPU an
    int8 forward of a small draft model is several times cheaper than an fp32 one, so a draft
    token costs a much smaller share of a target step.
    """
    if model.device.type != "cpu":
        raise InvalidArgumentError(f"int8 drafting is for CPU models; this one is on {model.device}")
    quantize = getattr(getattr(torch, "ao", None), "quantization", None)
    if quantize is None or not hasattr(quantize, "quantize_dynamic"):
        raise InvalidArgumentError(f"torch {torch.__version__} has no torch.ao.quantization.quantize_dynamic for int8 drafting")
    with warnings.catch_warnings():
        # Eager-mode quantization is deprecated in favour of torchao, and still works in the pinned torch.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        quantize.quantize_dynamic(model.float(), {torch.nn.Linear: quantize.per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    full_range = cpu_has_vnni()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.ao.nn.quantized.dynamic.Linear):
                setattr(parent, name, Int8Linear(child._packed_params._packed_params, reduce_range=not full_range))
    return model.eval()


class Int8Linear(torch.nn.Module):
    """A linear layer in int8: fbgemm's packed weight, one scale per output channel, and activations
    quantized to 8 bits per call, or 7 (`reduce_range`) where the CPU lacks VNNI.

    torch.ao's own dynamic Linear always takes 7 bits, which avoids an int16 overflow in AVX2's
    product instruction; VNNI's has none. There per-channel weights and 8-bit activations keep a
    draft agreeing with the target's greedy token nearly as often as in fp32, at the same speed,
    where torch.ao's 7-bit defaults lose noticeably more agreement.
    """

    def __init__(self, packed: torch.ScriptObject, reduce_range: bool):
        super().__init__()
        self.packed, self.reduce_range = packed, reduce_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, reduce_range=self.reduce_range)

    @classmethod
    def fused(cls, layers: Sequence[Int8Linear]) -> Int8Linear:
        """One layer computing `layers`' products of one input side by side (the lean forward's
        queries, keys and values, and gate and up): in a small draft model keys and values are so
        small that a call of their own costs more than their weights (k: 128 x 896 for the 0.5B
        Qwen). Each output row keeps its own channel's scale, so the results are the same. fbgemm's
        packed weights cannot be shared as views, so the fused weights are a copy: the draft's
        projections are held twice while its lean forward lives, the price of its fewer calls."""
        weights, biases = zip(*(m.weight_and_bias() for m in layers))
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([torch.zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases)])
        return cls.of(torch.cat([w.int_repr() for w in weights]), torch.cat([w.q_per_channel_scales() for w in weights]),
                      torch.cat([w.q_per_channel_zero_points() for w in weights]), bias, layers[0].reduce_range)  # fmt: skip

    @classmethod
    def of(cls, ints: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, bias: torch.Tensor | None, reduce_range: bool) -> Int8Linear:
        """The layer of integer weights `ints` [out, in] at per-output-row `scales`."""
        packed = torch.ops.quantized.linear_prepack(torch._make_per_channel_quantized_tensor(ints, scales, zero_points, 0), bias)
        return cls(packed, reduce_range)

    @property
    def out_features(self) -> int:
        return self.weight_and_bias()[0].shape[0]

    def weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The quantized weight (per channel) and the fp32 bias."""
        return torch.ops.quantized.linear_unpack(self.packed)


def cpu_has_vnni() -> bool:
    """Whether this CPU has an int8 dot product without AVX2's int16 overflow (AVX512-VNNI or AVX-VNNI)."""
    return bool({"avx512_vnni", "avx_vnni"} & cpu_flags())
