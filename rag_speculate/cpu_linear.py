"""Linear layers of multi-token forwards through oneDNN, on CPUs.

Verifying a draft feeds a few tokens at once, and on this project's 2-core AVX2 CPU torch's
default fp32 matrix product is slow exactly there: for the 1.5B target at 500 tokens of context a
forward over 9 tokens took 3.7 single-token steps, over 17 tokens 3.6 (docs/benchmarks.md,
section 1.1). oneDNN's inner product, which torch ships, took 1.9 and 2.4 on the same forwards,
with the same weights in place (no copy, no repacking, the model untouched).

Only products over 2 to 64 rows are rerouted. Single-token steps and prefills keep torch's own
kernel, so plain decoding stays bit for bit what `model.generate` computes. A multi-token forward
already differs from token-by-token decoding in the last bits whichever kernel runs it (measured
on the 1.5B target over 16 tokens: at most 3.1e-5 of the logits with torch's, 3.6e-5 with
oneDNN's; `benchmarks/forward_cost.py --onednn` prints it), the same rounding every speculative
decoder's verification has.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MIN_ROWS, _MAX_ROWS = 2, 64


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(TorchFunctionMode):
    """Within this context, `F.linear` over 2-64 rows of CPU fp32 runs oneDNN's inner product."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.numel() // max(x.shape[-1], 1)
            if (
                _MIN_ROWS <= rows <= _MAX_ROWS
                and x.device.type == "cpu"
                and x.dtype == weight.dtype == torch.float32
                and x.layout == weight.layout == torch.strided
            ):
                return _onednn_linear(x, weight, bias)
        return func(*args, **kwargs)


def onednn_linear_works(model: torch.nn.Module) -> tuple[bool, str]:
    """Whether `model`'s linear layers can run through oneDNN here, and why not.

    Tried on the model's own first linear layer: the operator may be missing from a torch build,
    and oneDNN refuses dtypes the CPU cannot compute in.
    """
    linear = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
    if linear is None:
        return False, "the model has no torch.nn.Linear layers"
    weight = linear.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False, f"oneDNN linear is used for fp32 on CPU only; the model is {weight.dtype} on {weight.device}"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not torch.backends.mkldnn.is_available():
        return False, f"torch {torch.__version__} was built without oneDNN's linear operator"
    x = torch.linspace(-1, 1, 2 * weight.shape[1]).reshape(2, -1)
    try:
        with torch.inference_mode():
            got, want = _onednn_linear(x, weight, linear.bias), F.linear(x, weight, linear.bias)
    except RuntimeError as exc:
        return False, f"oneDNN refused the model's linear layer: {exc}"
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * (want.abs().max().item() + 1)):
        return False, "oneDNN's linear disagrees with torch's on the model's first linear layer"
    return True, ""
