"""The kernels' shared worker threads (`cpu/pool.c`): callers from several threads at once each get
their own answer, and a forked child, which has none of its parent's workers, starts its own."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from rag_speculate.cpu.linear import linear_library, run_linear


@pytest.fixture
def library():
    library, reason = linear_library(torch.float32)
    if library is None:
        pytest.skip(reason)
    return library


def test_threads_calling_at_once_each_get_their_own_answer(library):
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(300, 256, generator=generator) for _ in range(4)]
    inputs = [torch.randn(7, 256, generator=generator) for _ in range(4)]
    want = [run_linear(library, x, w, None) for x, w in zip(inputs, weights)]
    got: dict[int, list[torch.Tensor]] = {}

    def call(i: int) -> None:
        got[i] = [run_linear(library, inputs[i], weights[i], None) for _ in range(50)]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert all(torch.equal(out, want[i]) for i in range(4) for out in got[i])


def _child(queue) -> None:
    library, _ = linear_library(torch.float32)
    torch.set_num_threads(2)
    x, w = torch.ones(3, 64), torch.ones(40, 64)
    queue.put(run_linear(library, x, w, None).sum().item())


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_a_forked_child_runs_the_kernels_with_workers_of_its_own(library):
    torch.set_num_threads(2)
    run_linear(library, torch.ones(3, 64), torch.ones(40, 64), None)  # the parent's workers exist
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, "the child hung or failed"
    assert queue.get(timeout=5) == 3 * 40 * 64
