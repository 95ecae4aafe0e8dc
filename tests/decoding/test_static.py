"""The fixed-shape verification step on a preallocated cache: the logits and the kept entries of the
growing cache's forward, in a few shapes only, with no read back to the host and no allocation of
the cache after it is built; rows joining and leaving between steps."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB, tiny_model
from torch.overrides import TorchFunctionMode

from rag_speculate.decoding.batch import BatchCache, BatchForward, Fed
from rag_speculate.decoding.static import StaticStep, bucket, buckets
from rag_speculate.decoding.tree import ROOT
from rag_speculate.decoding.verify import greedy_choices
from rag_speculate.engine.traits import ModelTraits
from rag_speculate.errors import RagSpeculateError

# What reads a tensor back to the host (on a GPU each waits for the device).
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__}  # fmt: skip


class HostReads(TorchFunctionMode):
    """Counts every read of a tensor back to the host made while it is on."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_buckets_are_powers_of_two_up_to_the_largest():
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(17) == [1, 2, 4, 8, 16, 17]
    assert [bucket(n, 17) for n in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 16, 16, 17]
    with pytest.raises(RagSpeculateError, match="1 to 17, not 18"):
        bucket(18, 17)


def _tree(rng: random.Random, nodes: int) -> list[int]:
    """Parents of [root, *nodes] as a forward feeds them: the root's the cached entries."""
    return [ROOT] + [rng.randrange(i) for i in range(1, nodes + 1)]


def _path(rng: random.Random, parents: list[int]) -> list[int]:
    """The offsets of a random node's path from the root, ascending: what a verification keeps."""
    node, path = rng.randrange(len(parents)), []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _twins(model, rows: int, capacity: int, tokens: int):
    """A preallocated cache with its step, and a growing cache with `BatchForward` (the engine's forward
    for the model: through the CPU kernels where they serve it), to be fed alike."""
    traits = ModelTraits.learn(model)
    forward = BatchForward(model, forward=traits.forward, context=traits.context)
    static = BatchCache(model, rows, capacity)
    return forward, static, StaticStep(forward, static, tokens), BatchCache(model)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # the lean forward, and a model's own
def test_the_step_gives_the_growing_caches_logits_in_bucketed_shapes_without_host_reads(arch, forward_path):
    """Through the CPU kernels, the same bits (each row computed as if alone, a masked entry adding
    nothing); through torch's, whose kernels block by shape, the same up to rounding (GPT-2's Conv1D
    layers are torch's addmm in the kernels' mode too)."""
    model, rng = tiny_model(arch), random.Random(0)
    forward, static, step, growing = _twins(model, rows=4, capacity=128, tokens=6)
    exact = forward_path == "kernels" and arch == "llama"

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    shapes: list[tuple[int, ...]] = []  # of every forward's input ids
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    stepped: set[tuple[int, ...]] = set()  # of the step's
    stores = [store.data_ptr() for store in static.stores]
    live: dict[int, tuple[int, int]] = {}  # sequence -> its row in each cache
    with torch.inference_mode():
        for sequence in range(9):
            if len(live) == 4 or (live and rng.random() < 0.3):  # one leaves: its rows are used again
                leaving = rng.choice(sorted(live))
                for cache, row in zip((static, growing), live.pop(leaving)):
                    cache.remove_row(row)
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 20))]
            live[sequence] = static.add_row(), growing.add_row()
            for cache, row in zip((static, growing), live[sequence]):  # prompts run through BatchForward on both
                forward(cache, [Fed(row, prompt)], last_only=True)
                cache.advance(row, len(prompt))
            for _ in range(3):
                chosen = rng.sample(sorted(live), rng.randint(1, len(live)))
                fed = {s: (rng.randrange(VOCAB), _tree(rng, rng.randrange(6))) for s in chosen}
                tokens = {s: [root, *(rng.randrange(VOCAB) for _ in parents[1:])] for s, (root, parents) in fed.items()}
                counter = HostReads()
                with counter:
                    shapes.clear()
                    got = step([Fed(live[s][0], tokens[s], fed[s][1]) for s in fed])
                    stepped.update(shapes)
                    read = greedy_choices(got)
                    kept = {s: [0, *_path(rng, fed[s][1])] for s in fed}
                    step.keep({live[s][0]: kept[s] for s in fed})
                assert counter.reads == ["tolist"]  # the step's one read: its rows' greedy choices
                want = forward(growing, [Fed(live[s][1], tokens[s], fed[s][1]) for s in fed])
                growing.keep({live[s][1]: kept[s] for s in fed})
                for a, b in zip(got, want):
                    same(a, b)
                assert read == greedy_choices(want)
            for s, (row, twin) in live.items():  # the same entries kept
                held = static.lengths[row]
                assert growing.lengths[twin] == held
                for i in range(static.layers):
                    same(static.keys[i][row, :, :held], growing.keys[i][twin, :, :held])
                    same(static.values[i][row, :, :held], growing.values[i][twin, :, :held])
    assert stepped <= set(step.shapes()) and len(stepped) > 3  # none but the buckets' shapes
    assert [store.data_ptr() for store in static.stores] == stores  # allocated once


def test_a_bucket_run_alone_writes_only_the_spare_row():
    """What a benchmark times: a bucket's forward on its buffers as they stand, all padding."""
    model = tiny_model("qwen2")
    forward, static, step, _ = _twins(model, rows=2, capacity=64, tokens=4)
    with torch.inference_mode():
        row = static.add_row()
        forward(static, [Fed(row, [3, 4, 5])], last_only=True)
        static.advance(row, 3)
        before = [store.clone() for store in static.stores]
        logits = step.bucket((2, 4))()
        assert logits.shape == (2, 4, VOCAB) and torch.isfinite(logits).all()
        for old, new in zip(before, static.stores):
            assert torch.equal(old[:, :2], new[:, :2]) and not torch.equal(old[:, 2], new[:, 2])


def test_the_preallocated_cache_refuses_what_it_cannot_hold():
    model = tiny_model("llama")
    forward, static, step, _ = _twins(model, rows=1, capacity=64, tokens=4)
    with torch.inference_mode():
        row = static.add_row()
        with pytest.raises(RagSpeculateError, match="1 rows, all taken"):
            static.add_row()
        with pytest.raises(RagSpeculateError, match="holds 64 entries, not 70"):
            forward(static, [Fed(row, [1] * 70)])
        forward(static, [Fed(row, [1] * 62)], last_only=True)
        static.advance(row, 62)
        with pytest.raises(RagSpeculateError, match="overflow its 64"):
            step([Fed(row, [1, 2, 3], [ROOT, 0, 1])])
    with pytest.raises(RagSpeculateError, match="room for 4 tokens"):
        StaticStep(forward, BatchCache(model), 4)
