"""A model's linear layers with quantized weights: `quantize_model` replaces them in place.

`QuantizedLinear` computes every row as if it were alone (the CPU kernels' invariant,
`cpu/kernels.py`; each row's activations are quantized on their own), so speculation over a quantized
model gives exactly what `generate` of that same quantized model gives. Off the CPU, or where the
kernel cannot be built, torch computes the same product from the dequantized values (correct, not fast).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..cpu.linear import linear_library, run_quantized
from ..cpu.modules import carry_kernels
from ..errors import InvalidArgumentError
from ..fingerprint import changed_weights
from .formats import INT8_GROUPS, QuantizedWeight, dequantize, fits, input_block, quantize, quantize_activations

logger = logging.getLogger(__name__)

# `quantization=` names: our own int8 and 4-bit, or a GGUF file's own tensors (`models/loading.py`).
METHODS = ("int8", "int4", "gguf")


class QuantizedLinear(torch.nn.Module):
    """`torch.nn.Linear`'s forward over a `QuantizedWeight` (kept on the CPU) and an optional bias."""

    # Every row computed as if alone (the CPU kernel's invariant): what `cpu.linear.linear_unsupported` asks.
    rows_alone = True

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format, self.group_shift = weight.format, weight.group_shift
        self.register_buffer("values", weight.values)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("offset", weight.offset)
        self.register_buffer("sub", weight.sub)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> QuantizedWeight:
        shape = (self.out_features, self.in_features)
        return QuantizedWeight(self.format, self.values, self.scale, self.offset, self.group_shift, shape, self.sub)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        library = _library(x, self.format)
        if library is not None:
            # Plain tensors handed to C by pointer: the torch function mode the engine's forwards
            # run in (`cpu.kernels.FastKernels`) has nothing to reroute here, and a decoding step
            # makes ~200 of these calls, each of a dozen tensor operations.
            with torch._C.DisableTorchFunction():
                bias = None if self.bias is None else self.bias.to(x.dtype)
                return run_quantized(
                    library, x, self.values, self.scale, self.offset, self.group_shift, self.out_features, bias, self.sub
                )  # fmt: skip
        weight = dequantize(self.weight).to(x.device)
        bias = None if self.bias is None else self.bias.to(x.device, torch.float32)
        inputs = quantize_activations(x, input_block(self.format, self.group_shift))
        return F.linear(inputs, weight, bias).to(x.dtype)

    @classmethod
    def fused(cls, layers: Sequence[QuantizedLinear]) -> QuantizedLinear:
        """One layer computing `layers`' products of one input side by side (queries, keys and
        values, say): one kernel call where there were several, and the same bits, as each output
        row is computed alone. The layers keep working, their buffers now views of the fused
        layer's; fused again (another engine on the same model), they give those views' tensors
        back, so the weights are never held twice."""
        first = layers[0]
        if any((m.format, m.group_shift, m.in_features) != (first.format, first.group_shift, first.in_features) for m in layers):
            raise ValueError("only layers of one format, group and input size fuse")
        if any((m.bias is None) != (first.bias is None) for m in layers):
            raise ValueError("layers with and without a bias do not fuse")
        names = [name for name in ("values", "scale", "offset", "sub") if getattr(first, name) is not None]
        tensors = {name: _fused_already(layers, name) for name in names}
        tensors = {name: torch.cat([getattr(m, name) for m in layers]) if t is None else t for name, t in tensors.items()}
        out_features = sum(m.out_features for m in layers)
        weight = QuantizedWeight(first.format, tensors["values"], tensors["scale"], tensors.get("offset"), first.group_shift,
                                 (out_features, first.in_features), tensors.get("sub"))  # fmt: skip
        fused = cls(weight, None if first.bias is None else torch.cat([m.bias for m in layers]))
        start = 0
        for m in layers:
            rows = slice(start, start + m.out_features)
            for name in names:
                setattr(m, name, getattr(fused, name)[rows])
            start = rows.stop
        return fused

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, group={1 << self.group_shift}"


def _fused_already(layers: Sequence[QuantizedLinear], name: str) -> torch.Tensor | None:
    """The tensor whose consecutive rows the layers' `name` buffers are (an earlier `fused`), or None."""
    base = getattr(layers[0], name)._base
    if base is None or base.shape[0] != sum(m.out_features for m in layers):
        return None
    start = base.storage_offset()
    for m in layers:
        part = getattr(m, name)
        if part._base is not base or part.storage_offset() != start:
            return None
        start += part.numel()
    return base


def _library(x: torch.Tensor, fmt: str):
    """The CPU kernel for x's dtype and the weights' format, or None for torch's product."""
    if x.device.type != "cpu":
        return None
    key = (x.dtype, fmt)
    if key not in _libraries:
        library, reason = linear_library(x.dtype, fmt) if x.dtype in (torch.float32, torch.bfloat16) else (None, f"no kernel for {x.dtype}")
        if library is None:
            logger.warning("quantized layers run through torch, slowly: %s", reason)
        _libraries[key] = library
    return _libraries[key]


# Looked up once per activation dtype and format: a decoding step asks ~200 times.
_libraries: dict[tuple[torch.dtype, str], object] = {}


def already_quantized(model: torch.nn.Module) -> str:
    """How `model` is already quantized ("" when it is not)."""
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        return "its linear layers are already rag_speculate's quantized layers"
    config = getattr(model.config, "quantization_config", None)
    if config is not None or getattr(model, "hf_quantizer", None) is not None:
        method = getattr(config, "quant_method", None) or (config.get("quant_method") if isinstance(config, dict) else None)
        return f"it was quantized through transformers ({method or 'quantization_config'})"
    return ""


def quantize_model(
    model: torch.nn.Module, method: str, weights: dict[str, QuantizedWeight] | None = None, group: int | None = None
) -> dict[str, str]:
    """Replace `model`'s linear layers by quantized ones, in place: quantized here by `method`
    ("int8", "int4"; `group` values per scale, by default `formats.default_group`'s), or given in
    `weights` (by module name, from a GGUF file: method "gguf"). On the CPU the rest of its forward
    then runs the kernels too (`cpu.modules.carry_kernels`), so its own `generate` gives the
    engine's answers. Returns the layers left unquantized, with why."""
    if method not in METHODS:
        raise InvalidArgumentError(f"unknown quantization {method!r}: one of {', '.join(METHODS)}", "quantization")
    reason = already_quantized(model)
    if reason:
        raise InvalidArgumentError(f"cannot quantize the model: {reason}; leave quantization unset to use it as it is", "quantization")
    left = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        if method == "gguf":
            weight = (weights or {}).get(name)
            if weight is None:
                left[name] = "the GGUF file holds it in a type without a kernel"
                continue
        else:
            why = fits(module.in_features, method, group)
            if why:
                left[name] = why
                continue
            weight = quantize(module.weight, method, group)
        _replace(model, name, QuantizedLinear(weight, module.bias))
    # The disk tier files KV entries under the weights' fingerprint: these are other weights now.
    changed_weights(model, f"quantize_model {method} group {group or (INT8_GROUPS if method == 'int8' else 'Q4_K super-blocks')}")
    if next(model.parameters()).device.type == "cpu":
        # Its own generate then answers as the engine does, outside any mode: a model we change, we change whole.
        carry_kernels(model)
    if left:
        logger.info("%d linear layers kept in %s: %s", len(left), next(model.parameters()).dtype, "; ".join(f"{n} ({w})" for n, w in left.items()))
    return left


def _replace(model: torch.nn.Module, name: str, layer: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)
