"""What a model can do on this engine, learnt once when the engine is built: `ModelTraits`.

Its device and dtype, the forward it runs (its lean forward or its own), whether it verifies a draft
tree in one forward, takes several generations' rows in one forward, has its KV entries cut into
prefixes, runs through the CPU kernels, and whether its rows round independently of each other:
each capability a `Trait` that says why where it is off. Every part of the engine asks these; none
probes the model again.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..cpu import forward_context, kernel_functions
from ..decoding import probe
from ..decoding.batch import BatchForward
from ..decoding.forward import TreeForward
from ..decoding.lean_forward import Kernels, lean_forward
from ..drafters.base import ForwardContext
from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class Trait:
    """A capability, on unless `why_not` says why it is off."""

    why_not: str = ""

    def __bool__(self) -> bool:
        return not self.why_not


def kernel_context(model: PreTrainedModel, wanted: bool | None = None) -> tuple[ForwardContext | None, str]:
    """The CPU kernels' mode for `model`'s forwards, or None for torch's own kernels and why (`wanted`:
    True requires them, False refuses them, None takes them where they work). The kernel modules
    load only here, for a model on the CPU."""
    if wanted is False:
        return None, "fast_kernels=False"
    context, reason = forward_context(model)
    if wanted and context is None:
        raise InvalidArgumentError(f"fast_kernels=True, but {reason}", "fast_kernels")
    return context, reason


@dataclass(frozen=True)
class ModelTraits:
    """What the engine's model can do, learnt once (`learn`); a capability that is off says why."""

    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_positions: int | None
    # The CPU kernels' mode (linear layers and attention, each row as if alone), or torch's kernels.
    kernels: Trait
    # The lean forward (`decoding/lean_forward.py`), bit for bit the model's own, or the model's own.
    lean_forward: Trait
    # A draft tree verified in one forward under a 4D mask, or only its longest branch.
    tree_attention: Trait
    # Several generations' rows in one forward (a `BatchCache`), or one generation at a time.
    rows: Trait
    # KV entries cut at any position, so the prompt cache can hold prefixes.
    prefixes: Trait
    # Each row of a forward rounded as if alone; where not, a batch or a tree can leave generate's output.
    rows_alone: Trait
    # What the model's forwards run: the forward in place of the model's own (None: its own) and the
    # context around every call (the kernels' mode where the lean forward does not call them itself).
    forward: Callable[..., torch.Tensor] | None = field(default=None, repr=False, compare=False)
    context: ForwardContext = field(default=contextlib.nullcontext, repr=False, compare=False)

    @classmethod
    def learn(cls, model: PreTrainedModel, fast_kernels: bool | None = None) -> ModelTraits:
        """Probe `model` on real forwards (`decoding/probe.py`); `fast_kernels` as the engine takes it.
        A capability the model lacks is warned about where it changes what a user gets."""
        kernels, no_kernels = kernel_context(model, fast_kernels)
        lean, lean_skipped = lean_forward(
            model, Kernels(*kernel_functions()) if kernels else Kernels(), exact=True, context=kernels or contextlib.nullcontext
        )  # fmt: skip
        # The lean forward calls the kernels itself: only the model's own forward needs their mode.
        context = contextlib.nullcontext if lean else (kernels or contextlib.nullcontext)
        single = TreeForward(model, forward=lean, context=context)
        tree = probe.tree_attention(single)
        if tree:
            warnings.warn(
                f"{type(model).__name__} cannot verify a draft tree with a custom 4D attention mask ({tree}); "
                "falling back to verifying only the longest draft branch per forward",
                RuntimeWarning,
                stacklevel=3,
            )
        layout = probe.cache_layout(model)
        rows = layout or ("it verifies chains only" if tree else "")
        rows = rows or probe.rows_together(BatchForward(model, forward=lean, context=context), single)
        interact = probe.rows_interact(model)
        if interact:
            warnings.warn(
                f"{interact}, so a verification or batched forward can round a row otherwise than generate's "
                "one-token step: outputs can leave generate's. Load it with llm_int8_threshold=0.0 for exact ones",
                RuntimeWarning,
                stacklevel=3,
            )
        parameter = next(model.parameters())
        return cls(
            device=parameter.device, dtype=parameter.dtype, vocab_size=model.get_input_embeddings().num_embeddings,
            max_positions=getattr(model.config, "max_position_embeddings", None),
            kernels=Trait(no_kernels),
            lean_forward=Trait(lean_skipped), tree_attention=Trait(tree), rows=Trait(rows), prefixes=Trait(layout),
            rows_alone=Trait(interact), forward=lean, context=context,
        )  # fmt: skip
