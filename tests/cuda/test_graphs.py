"""CUDA graphs of the fixed-shape step (skipped without a CUDA GPU; for benchmarks/gpu_check.py's CUDA
test selection): a replay gives the bits the same eager forward gives for the same shapes; the
engine's greedy answers with graphs are `model.generate`'s in fp32, alone and batched, and the same
without them; captures are bounded, counted and sized in `stats()`."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB, hf_greedy, tiny_model

from rag_speculate import SpeculativeEngine
from rag_speculate.cuda.graphs import CudaGraphs
from rag_speculate.decoding.batch import BatchCache, BatchForward, Fed
from rag_speculate.decoding.budget import CostModel
from rag_speculate.decoding.static import StaticStep
from rag_speculate.decoding.tree import ROOT
from rag_speculate.engine.traits import ModelTraits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
PROMPTS = [
    "the quick brown fox jumps over the lazy dog. the quick",
    "In 1905, Einstein published",
    "a",
    "She sells sea shells by the sea shore; the shells she sells are",
]
PINNED = CostModel({1: 1.0, 300: 1.5}, learn=False)


def test_a_shape_is_captured_once_replayed_on_new_inputs_and_captures_are_bounded():
    graphs = CudaGraphs(CUDA, max_graphs=1)
    x = torch.arange(4.0, device=CUDA)
    assert torch.equal(graphs("a", lambda: x * 2), torch.arange(4.0, device=CUDA) * 2)
    x += 1  # the graph reads x where it lies
    assert torch.equal(graphs("a", lambda: x * 3), (torch.arange(4.0, device=CUDA) + 1) * 2)  # replayed, not run
    assert torch.equal(graphs("b", lambda: x * 3), (torch.arange(4.0, device=CUDA) + 1) * 3)  # over the bound: eager
    assert graphs.captured == 1 and graphs.bytes > 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # the lean forward, and a model's own
def test_a_replay_gives_the_eager_steps_bits(arch):
    model, rng = tiny_model(arch).to(CUDA), random.Random(0)
    traits = ModelTraits.learn(model)
    forward = BatchForward(model, forward=traits.forward, context=traits.context)
    graphs = CudaGraphs(CUDA)
    caches = [BatchCache(model, 4, 128) for _ in range(2)]
    steps = [StaticStep(forward, caches[0], 6, graphs), StaticStep(forward, caches[1], 6)]
    with torch.inference_mode():
        rows = []
        for n in (12, 5, 30):
            prompt = [rng.randrange(VOCAB) for _ in range(n)]
            rows.append([cache.add_row() for cache in caches])
            for cache, row in zip(caches, rows[-1]):
                forward(cache, [Fed(row, prompt)], last_only=True)
                cache.advance(row, n)
        for _ in range(16):  # enough that shapes come back: captured, then replayed
            fed = rng.sample(range(3), rng.randint(1, 3))
            trees = {i: [ROOT] + [rng.randrange(j) for j in range(1, rng.randrange(6) + 1)] for i in fed}
            tokens = {i: [rng.randrange(VOCAB) for _ in trees[i]] for i in fed}
            got, want = ([step([Fed(rows[i][c], tokens[i], trees[i]) for i in fed]) for c, step in enumerate(steps)])
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            for c, step in enumerate(steps):
                step.keep({rows[i][c]: [0, len(trees[i]) - 1] if trees[i][-1] == 0 else [0] for i in fed})
    assert 0 < graphs.captured <= len(steps[0].shapes()) and graphs.bytes > 0


def test_greedy_answers_with_graphs_are_generates_alone_and_batched(tokenizer):
    model = tiny_model("qwen2").to(CUDA)
    lengths = [40, 8, 25, 3]
    references = [hf_greedy(model, tokenizer.encode(p), n) for p, n in zip(PROMPTS, lengths)]
    for cuda_graphs in (None, False):  # on by default on CUDA
        engine = SpeculativeEngine(model, tokenizer, cuda_graphs=cuda_graphs, static_step=True)
        engine.cost_model = PINNED
        alone = engine.generate(PROMPTS[0], documents=[references[0][:20]], max_new_tokens=40)
        assert alone.token_ids == references[0]
        streams = [engine.stream(p, documents=[r[: n // 2]], max_new_tokens=n)
                   for p, r, n in zip(PROMPTS, references, lengths)]  # fmt: skip
        assert [s.collect().token_ids for s in streams] == references
        stats = engine.stats()
        assert stats.static_step and (stats.cuda_graphs > 0 and stats.cuda_graph_bytes > 0) == (cuda_graphs is None)
