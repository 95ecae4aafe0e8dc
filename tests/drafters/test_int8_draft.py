"""The int8 draft model: every linear layer in int8, per-channel weights, 8-bit activations where VNNI allows."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_model

from rag_speculate.drafters.ouroboros import int8
from rag_speculate.drafters.ouroboros.int8 import Int8Linear, cpu_has_vnni, int8_draft_model


@pytest.mark.parametrize("vnni", [True, False])
def test_every_linear_layer_computes_in_int8_with_the_range_the_cpu_allows(monkeypatch, vnni):
    monkeypatch.setattr(int8, "cpu_has_vnni", lambda: vnni)
    model = tiny_model("qwen2", seed=0)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    int8_draft_model(model)
    converted = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(converted) == linears and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert {m.reduce_range for m in converted} == {not vnni}


def test_per_channel_weights_and_full_range_activations_come_closer_to_fp32():
    # Rows of very different scales: one scale per tensor rounds the small rows to a few levels.
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-3, 0, 64)[:, None])
    x = torch.randn(8, 256)
    want = linear(x)
    with warnings.catch_warnings():  # torch.ao's deprecation
        warnings.simplefilter("ignore")
        per_tensor = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8)[0]
    model = torch.nn.Sequential(linear)
    model.device = torch.device("cpu")  # what int8_draft_model checks of a transformers model
    int8_draft_model(model)
    ours = model[0]
    assert isinstance(ours, Int8Linear)

    def error(y: torch.Tensor) -> float:
        return ((y - want) / want.abs().amax(dim=0)).abs().max().item()  # per output channel

    reduced = Int8Linear(ours.packed, reduce_range=True)(x)
    assert error(reduced) < error(per_tensor(x))
    if cpu_has_vnni():
        # Full-range activations only where VNNI computes them without AVX2's int16 overflow, which
        # is why int8_draft_model takes them only there.
        full = Int8Linear(ours.packed, reduce_range=False)(x)
        assert error(full) < error(reduced)
        assert error(full) < 0.02
