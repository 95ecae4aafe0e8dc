"""The verification step's forwards captured in CUDA graphs, one per shape, and replayed: `CudaGraphs`.

On a GPU a forward of a model costs its kernel launches and the Python around them far more than
its arithmetic, whatever the tokens fed (docs/gpu.md has the figures). A CUDA graph records a forward's kernels once and replays them in one launch. The
fixed-shape step (`decoding/static.py`) runs each bucket's forward on the same tensors every time,
so each bucket is captured on its first use (after warm-up runs on a side stream, as torch's
documentation prescribes, so that lazily made handles and workspaces exist before the capture),
every graph's memory drawn from one shared pool, and replayed afterwards. At most `max_graphs`
are captured; other shapes, and any whose capture fails (said once), run eagerly.

Replaying graphs one after another, on one stream, never two at once, is what makes one pool safe
to share: each graph's output stays its own until it is replayed again, and the step's reader
reads it before then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch

logger = logging.getLogger(__name__)

# Enough for every bucket of max_batch 64 by a draft budget of 63 (7 x 7).
DEFAULT_MAX_GRAPHS = 64
# Forwards run before a capture; torch's documentation warms up with three.
_WARMUP_RUNS = 3


class CudaGraphs:
    """Each shape's forward captured on its first use and replayed after: call with the shape and the
    forward (which must run the same kernels on the same tensors every time) for its output."""

    def __init__(self, device: torch.device, max_graphs: int = DEFAULT_MAX_GRAPHS):
        self.device, self.max_graphs = device, max_graphs
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._eager: set[Hashable] = set()  # shapes whose capture failed
        self.bytes = 0  # GPU memory torch reserved while capturing: the graphs' pool

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def __call__(self, shape: Hashable, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        if shape in self._graphs:
            graph, output = self._graphs[shape]
            graph.replay()
            return output
        if shape in self._eager or len(self._graphs) >= self.max_graphs:
            return run()
        try:
            graph, output = self._capture(run)
        except RuntimeError as error:  # a forward torch cannot capture still runs, eagerly
            logger.warning("the step's forward for shape %s runs without a CUDA graph: %s", shape, error)
            self._eager.add(shape)
            return run()
        self._graphs[shape] = graph, output
        graph.replay()
        return output

    def _capture(self, run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(_WARMUP_RUNS):
                    run()
            torch.cuda.current_stream().wait_stream(side)
            # Emptied as entering the capture empties it, so that what is reserved after it is the pool's growth.
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                output = run()
            self.bytes += torch.cuda.memory_reserved() - reserved
        return graph, output
