"""The server's metrics: every counter of the prompt cache's disk tier is exported, by outcome; the
engine's CUDA graphs as gauges."""

from __future__ import annotations

import re

from rag_speculate.decoding.prompt_cache import PromptCacheStats
from rag_speculate.engine.engine import EngineStats
from rag_speculate.entrypoints.openai.metrics import Metrics


def test_every_disk_block_outcome_is_exported_and_advanced_to_its_total():
    outcomes = {"written": "disk_blocks_written", "failed": "disk_write_failures", "dropped": "disk_writes_dropped",
                "rejected": "disk_blocks_rejected", "evicted": "disk_blocks_evicted", "refused": "disk_entries_refused"}  # fmt: skip
    metrics = Metrics("prometheus")
    for scale in (1, 3):  # a later reading of the stats advances each counter to the new total
        stats = PromptCacheStats(**{field: scale * (i + 1) for i, field in enumerate(outcomes.values())})
        metrics.prompt_cache(stats)
    text = metrics.exposition().decode()
    exported = dict(re.findall(r'rag_speculate_prompt_cache_disk_blocks_total\{outcome="(\w+)"\} (\S+)', text))
    assert exported == {outcome: f"{3 * (i + 1)}.0" for i, outcome in enumerate(outcomes)}


def test_the_engines_cuda_graphs_are_exported_as_they_stand():
    metrics = Metrics("prometheus")
    for captured in (2, 5):
        metrics.engine(EngineStats(static_step=True, cuda_graphs=captured, cuda_graph_bytes=captured << 20))
    text = metrics.exposition().decode()
    exported = dict(re.findall(r"^rag_speculate_(cuda_graphs|cuda_graph_bytes) (\S+)$", text, re.MULTILINE))
    assert {name: float(value) for name, value in exported.items()} == {"cuda_graphs": 5, "cuda_graph_bytes": 5 << 20}
