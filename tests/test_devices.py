"""Devices as users name them: None is CUDA when available, a device this machine lacks is refused by name."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, tiny_model

from rag_speculate import InvalidArgumentError, OuroborosDrafter, SpeculativeEngine
from rag_speculate.devices import default_dtype, device_from_map, resolve_device, same_device
from rag_speculate.drafters.ouroboros import OuroborosConfig

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")


def test_none_is_cuda_when_available_else_the_cpu():
    assert resolve_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(-1) == torch.device("cpu")
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_bf16_is_the_default_on_a_gpu():
    assert default_dtype("cuda") == default_dtype(torch.device("cuda:1")) == torch.bfloat16


@needs_no_gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda")])
def test_cuda_without_a_gpu_is_refused_by_name(device):
    with pytest.raises(InvalidArgumentError, match="torch sees no CUDA GPU"):
        resolve_device(device)


@pytest.mark.parametrize("device", ["gpu", "banana", "cuda:x", True, 1.5, ["cpu"]])
def test_an_unknown_device_is_refused_by_name(device):
    with pytest.raises(InvalidArgumentError, match="device"):
        resolve_device(device)


def test_a_device_map_names_one_device():
    assert device_from_map(None) is None and device_from_map("auto") is None
    assert device_from_map("cpu") == "cpu"
    assert device_from_map({"": "cpu"}) == "cpu"
    with pytest.raises(InvalidArgumentError, match="spreads the model over several devices"):
        device_from_map({"model.layers.0": 0, "model.layers.1": 1})
    with pytest.raises(InvalidArgumentError, match="not both"):
        device_from_map("cpu", "cuda")


@needs_no_gpu
def test_loading_on_a_missing_gpu_fails_before_any_file_is_read():
    with pytest.raises(InvalidArgumentError, match="torch sees no CUDA GPU"):
        SpeculativeEngine.from_pretrained("no/such-model", device="cuda")


def test_a_draft_model_on_another_device_than_the_target_is_refused(tokenizer):
    target = tiny_model("llama")
    draft = tiny_model("llama", seed=2).to("meta")
    drafter = OuroborosDrafter(draft, tokenizer, OuroborosConfig(lean=False))
    with pytest.raises(InvalidArgumentError, match=f"the draft model is on meta but the target on {DEVICE}"):
        SpeculativeEngine(target, tokenizer, drafter)


def test_one_device_named_two_ways_is_the_same():
    assert same_device(torch.device("cpu"), torch.device("cpu"))
    assert not same_device(torch.device("cpu"), torch.device("meta"))
    if torch.cuda.is_available():
        # What a user names and what a model on it reports.
        assert same_device(torch.device("cuda"), torch.device("cuda", torch.cuda.current_device()))
        assert not same_device(torch.device("cuda"), torch.device("cpu"))
