"""Guards that catch GPU bugs without a GPU: every tensor made on the model's device, few device-to-host reads."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import VOCAB, hf_greedy, tiny_model
from drafters_for_tests import RandomTreeDrafter
from torch.overrides import TorchFunctionMode

from rag_speculate import NGramTrieDrafter, OuroborosDrafter, SpeculativeEngine
from rag_speculate.decoding.budget import CostModel

pytestmark = pytest.mark.usefixtures("forward_path")
PROMPT = "the quick brown fox jumps over the lazy dog. the quick"
# What reads a tensor's values back to the host (a GPU synchronisation each).
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


def _drafters(tokenizer, reference):
    draft = tiny_model("llama", seed=3)
    return {
        "trie": NGramTrieDrafter(),
        "random": RandomTreeDrafter(VOCAB, reference, seed=0),
        "ouroboros": OuroborosDrafter(draft, tokenizer),
        "combined": [NGramTrieDrafter(), OuroborosDrafter(draft, tokenizer)],
    }


@pytest.mark.parametrize("name", ["trie", "random", "ouroboros", "combined"])
def test_no_tensor_is_made_off_the_models_device(name, tokenizer, monkeypatch):
    model = tiny_model("qwen2")
    ids = tokenizer.encode(PROMPT)
    reference = hf_greedy(model, ids, 24)
    engine = SpeculativeEngine(model, tokenizer, _drafters(tokenizer, reference)[name])
    engine.cost_model = CostModel({1: 1.0, 65: 1.0}, learn=False)  # every draft is verified
    engine.generate(ids, max_new_tokens=2)  # times the draft model's costs outside the guard
    # Any tensor created without naming a device now lands on `meta` and fails beside the model's:
    # on the engine's thread, where the generation runs (a default device holds for one thread).
    result = _on_meta(engine, lambda: engine.generate(ids, documents=[reference], max_new_tokens=24), monkeypatch)
    assert result.token_ids == reference
    assert sum(result.stats.drafted_tokens.values()) > 0  # drafts were made and verified under the guard


def _on_meta(engine: SpeculativeEngine, call, monkeypatch):
    """`call()` with every step of the engine's thread under `meta` as torch's default device."""
    step = engine._thread._step

    def guarded() -> bool:
        with torch.device("meta"):
            return step()

    monkeypatch.setattr(engine._thread, "_step", guarded)
    return call()


class _HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.count[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["trie", "random"])
def test_a_greedy_step_reads_back_from_the_device_once(name, tokenizer, monkeypatch):
    model = tiny_model("llama")
    ids = tokenizer.encode(PROMPT)
    reference = hf_greedy(model, ids, 32)
    engine = SpeculativeEngine(model, tokenizer, _drafters(tokenizer, reference)[name])
    engine.cost_model = CostModel({1: 1.0, 65: 1.0}, learn=False)
    # A torch function mode holds for the thread that enters it: every step of the engine's thread runs in it.
    reads = _HostReads()
    step = engine._thread._step

    def counted() -> bool:
        with reads:
            return step()

    monkeypatch.setattr(engine._thread, "_step", counted)
    result = engine.generate(ids, documents=[reference], max_new_tokens=32)
    assert result.token_ids == reference
    # The prefill's first token, then each verification's walk: one read of the target's choices.
    assert sum(reads.count.values()) == result.stats.target_forwards, reads.count
