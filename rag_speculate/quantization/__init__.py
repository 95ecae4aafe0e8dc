"""Quantized targets on the CPU: int8 linear layers (int8 activations too, each row quantized on its
own) and 4-bit ones, and a GGUF file's own quantized tensors, run by the CPU kernels so that every
row computes as if alone; a quantized model's speculative answers are exactly its own plain ones
(`docs/design.md`, "Quantized targets").

    engine = SpeculativeEngine.from_pretrained(name, quantization="int8")   # or "int4", "gguf"
    quantize_model(model, "int4")                                            # a model already loaded
"""

from .layer import METHODS, QuantizedLinear, quantize_model

__all__ = ["METHODS", "QuantizedLinear", "quantize_model"]
