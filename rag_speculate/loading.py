"""Loading a target model and its tokenizer from any of the names users have for it."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from . import cpu_linear, models
from .errors import InvalidArgumentError

# Forwards over up to this many tokens run the 4-bit kernel (docs/benchmarks.md, section 4.7).
INT4_ROWS = 3


def default_dtype(device: str = "cpu") -> torch.dtype:
    """bf16 where the hardware computes in it (GPUs, CPUs with AVX512-BF16 or AMX), else fp32.

    On an AVX2-only CPU bf16 matrix products are emulated and cost grows with every token fed:
    measured on this project's 2-core machine, a 1000-token prefill of the 1.5B target takes
    195 s in bf16 against 41 s in fp32, and a forward over 17 tokens 10x one over a single token
    against 2.8x in fp32. Only single-token decoding is faster in bf16 (243 ms against 393 ms).
    """
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    flags = _cpu_flags()
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (none elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A packaged model name, a `.gguf` file, a local folder or a Hugging Face model id."""
    dtype = dtype or default_dtype(device)
    if models.is_packaged_model(name_or_path):
        return models.load_packaged_model(name_or_path, dtype=dtype, device=device, progress=progress)
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        source, extra = str(path.parent), {"gguf_file": path.name}
    elif path.exists() or "/" in name_or_path:
        source, extra = name_or_path, {}
    else:
        raise InvalidArgumentError(
            f"unknown model {name_or_path!r}: not a packaged model ({', '.join(models.packaged_model_names())}), "
            "a .gguf file, a local folder, nor a Hugging Face id like 'org/name'"
        )
    if progress:
        progress(f"loading {name_or_path}")
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra).to(device).eval()
    return model, tokenizer


def int8_draft_model(model: PreTrainedModel, *, int4_rows: int = INT4_ROWS) -> PreTrainedModel:
    """Convert a CPU draft model's linear layers, in place, to compute in int8 (`Int8Linear`), and where
    this CPU runs the 4-bit kernel, forwards over at most `int4_rows` tokens in 4 bits (`Int4Linear`;
    0: int8 only).

    For draft models only: the target verifies every drafted token, so the output never changes;
    a draft model that agrees less with the target just gets fewer tokens accepted. Measured on this
    project's 2-core AVX2 machine at 500 tokens of context (docs/benchmarks.md section 1), a forward
    of qwen2.5-coder-0.5b-instruct over 1 token takes 44 ms in int8 against 120 ms in fp32, over
    8 tokens 62 ms against 288 ms: a draft token then costs an eighth of a 1.5B target step, not
    a third. On the AVX512-VNNI machine the 4-bit kernel reads that draft's layers in 10-13 ms for
    1-3 tokens against int8's 17, and agrees with the target at least as often (section 4.7).
    """
    if model.device.type != "cpu":
        raise InvalidArgumentError(f"int8 drafting is for CPU models; this one is on {model.device}")
    if int4_rows < 0:
        raise InvalidArgumentError(f"int4_rows must be >= 0, got {int4_rows}")
    quantize = getattr(getattr(torch, "ao", None), "quantization", None)
    if quantize is None or not hasattr(quantize, "quantize_dynamic"):
        raise InvalidArgumentError(f"torch {torch.__version__} has no torch.ao.quantization.quantize_dynamic for int8 drafting")
    int4 = int4_rows > 0 and cpu_linear.int4_linear_library()[0] is not None
    # From the fp32 weights, before int8 rounds them.
    weights = {name: m.weight for name, m in model.named_modules() if int4 and type(m) is torch.nn.Linear and m.in_features % cpu_linear.INT4_GROUP == 0}
    with warnings.catch_warnings():
        # Eager-mode quantization is deprecated in favour of torchao, and still works in the pinned torch.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        quantize.quantize_dynamic(model.float(), {torch.nn.Linear: quantize.per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    full_range = cpu_has_vnni()
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.ao.nn.quantized.dynamic.Linear):
                layer = Int8Linear(child._packed_params._packed_params, reduce_range=not full_range)
                weight = weights.get(f"{parent_name}.{name}" if parent_name else name)
                if weight is not None:
                    layer = Int4Linear(layer, *cpu_linear.int4_weights(weight), layer.weight_and_bias()[1], int4_rows)
                setattr(parent, name, layer)
    return model.eval()


class Int8Linear(torch.nn.Module):
    """A linear layer in int8: fbgemm's packed weight, one scale per output channel, and activations
    quantized to 8 bits per call, or 7 (`reduce_range`) where the CPU lacks VNNI.

    torch.ao's own dynamic Linear always takes 7 bits, which avoids an int16 overflow in AVX2's
    product instruction; VNNI's has none. There per-channel weights and 8-bit activations make the
    0.5B Qwen draft take the 1.5B target's greedy token nearly as often as in fp32, at the same
    speed: 0.67-0.91 of positions by category against 0.53-0.83 with torch.ao's defaults and
    0.70-0.91 in fp32 (docs/benchmarks.md, section 4.3).
    """

    def __init__(self, packed: torch.ScriptObject, reduce_range: bool):
        super().__init__()
        self.packed, self.reduce_range = packed, reduce_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, reduce_range=self.reduce_range)

    def weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The quantized weight (per channel) and the fp32 bias."""
        return torch.ops.quantized.linear_unpack(self.packed)


class Int4Linear(torch.nn.Module):
    """An `Int8Linear` whose forwards over at most `rows` rows read a 4-bit copy of its weights instead
    (`kernels/int4_linear.c`: groups of 128 weights with their own scale; activations in int8 by
    groups too). Those forwards are drafting's usual ones and are bound by reading the weights, half
    as many bytes in 4 bits; from 4 rows on, fbgemm's int8 product is as fast (docs/benchmarks.md, 4.7).
    """

    def __init__(self, int8: Int8Linear, nibbles: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, rows: int):
        super().__init__()
        self.int8, self.rows = int8, rows
        self.nibbles, self.scales = nibbles, scales
        self.bias = None if bias is None else bias.float().contiguous()
        self._library = cpu_linear.int4_linear_library()[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > self.rows * x.shape[-1]:
            return self.int8(x)
        return cpu_linear.run_int4_linear(self._library, x, self.nibbles, self.scales, self.bias)

    def rows_of(self, ids: torch.Tensor, int8: Int8Linear) -> Int4Linear:
        """The layer over output rows `ids` alone, with `int8` the int8 layer over those rows."""
        return Int4Linear(int8, self.nibbles[ids].contiguous(), self.scales[ids].contiguous(), None if self.bias is None else self.bias[ids], self.rows)

    @staticmethod
    def stacked(layers: Sequence[Int4Linear], int8: Int8Linear) -> Int4Linear:
        """One layer computing `layers`' outputs side by side (they share their input), with `int8` theirs in int8."""
        biases = [layer.bias if layer.bias is not None else torch.zeros(layer.nibbles.shape[0]) for layer in layers]
        bias = torch.cat(biases) if any(layer.bias is not None for layer in layers) else None
        return Int4Linear(int8, torch.cat([layer.nibbles for layer in layers]), torch.cat([layer.scales for layer in layers]), bias, layers[0].rows)


def cpu_has_vnni() -> bool:
    """Whether this CPU has an int8 dot product without AVX2's int16 overflow (AVX512-VNNI or AVX-VNNI)."""
    return bool({"avx512_vnni", "avx_vnni"} & _cpu_flags())
