"""The server's Prometheus metrics: requests, the queue, and what speculation did for each answer.

One set of metrics, written through either of two libraries: prometheus-client (a standalone server
exposes them at /metrics) or `ray.serve.metrics` (under Ray Serve, which adds each replica's tags and
exports them from every node). Tokens per forward is `generated_tokens_total / target_forwards_total`
over any window; acceptance per drafter is `accepted_tokens_total / drafted_tokens_total`.
"""

from __future__ import annotations

from typing import Any

from ...decoding.prompt_cache import PromptCacheStats
from ...decoding.result import GenerationStats
from ...engine.engine import EngineStats

PREFIX = "rag_speculate_"
# Seconds per request, and decode tokens per second: CPU answers take seconds, GPU ones far less.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
SPEED_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
TOKENS_PER_FORWARD_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)

# name -> (kind, description, labels, buckets)
_METRICS: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...] | None]] = {
    "requests_total": ("counter", "Requests answered, by endpoint and HTTP status", ("endpoint", "status"), None),
    "queue_length": ("gauge", "Requests waiting for the engine", (), None),
    "running_requests": ("gauge", "Generations running on the engine", (), None),
    "prompt_tokens_total": ("counter", "Prompt tokens of finished generations", (), None),
    "cached_prompt_tokens_total": ("counter", "Prompt tokens read from the prompt cache", (), None),
    "generated_tokens_total": ("counter", "Tokens generated", (), None),
    "target_forwards_total": ("counter", "Forwards of the target model, prefill included", (), None),
    "drafted_tokens_total": ("counter", "Draft tokens verified, by drafter", ("drafter",), None),
    "accepted_tokens_total": ("counter", "Draft tokens accepted, by drafter", ("drafter",), None),
    "request_latency_seconds": ("histogram", "Time from arrival to the last token", (), LATENCY_BUCKETS),
    "time_to_first_token_seconds": ("histogram", "Time from arrival to the first token", (), LATENCY_BUCKETS),
    "decode_tokens_per_second": ("histogram", "Decode speed of each generation", (), SPEED_BUCKETS),
    "tokens_per_forward": ("histogram", "Tokens per target forward of each generation", (), TOKENS_PER_FORWARD_BUCKETS),
    "engine_queue_seconds": ("histogram", "Time a generation waited in the engine for a row (KV room, a free slot)", (), LATENCY_BUCKETS),
    "batch_size": ("histogram", "Generations sharing each decoding step of each generation", (), BATCH_BUCKETS),
    "step_tokens": ("histogram", "Tokens each row fed to a decoding step (1: no draft verified)", (), BATCH_BUCKETS),
    "prompt_cache_hits_total": ("counter", "Generations that reused cached prompt tokens, by tier", ("tier",), None),
    "prompt_cache_tokens_total": ("counter", "Prompt tokens reused from the prompt cache, by tier", ("tier",), None),
    "prompt_cache_bytes": ("gauge", "Bytes the prompt cache holds, by tier (the disk's folder as last scanned)", ("tier",), None),
    "prompt_cache_disk_load_seconds_total": ("counter", "Seconds spent loading prompt cache blocks from disk", (), None),
    "prompt_cache_disk_saved_seconds": ("gauge", "Prefill seconds the tokens read from disk would have taken", (), None),
    "prompt_cache_disk_blocks_total": ("counter", "Prompt cache blocks on disk by outcome: written, failed, dropped, "
                                       "rejected, evicted, refused (an entry at a block's name not ours to remove)",
                                       ("outcome",), None),
    "prompt_cache_disk_loads_skipped_total": ("counter", "Disk loads not made because prefilling was predicted faster", (), None),
    "cuda_graphs": ("gauge", "CUDA graphs the engine captured of its verification step, one per shape", (), None),
    "cuda_graph_bytes": ("gauge", "GPU memory the engine's CUDA graphs hold", (), None),
}


class Metrics:
    """`backend`: "prometheus" (its own registry, rendered by `exposition`) or "ray"."""

    def __init__(self, backend: str = "prometheus"):
        self.backend = backend
        self._metrics: dict[str, Any] = {}
        self._totals: dict[tuple, float] = {}  # the prompt cache's counters as last exported
        if backend == "prometheus":
            import prometheus_client

            self.registry = prometheus_client.CollectorRegistry()
            kinds = {"counter": prometheus_client.Counter, "gauge": prometheus_client.Gauge, "histogram": prometheus_client.Histogram}
            for name, (kind, doc, labels, buckets) in _METRICS.items():
                extra = {"buckets": buckets} if buckets else {}
                # prometheus-client appends "_total" to counters itself.
                metric_name = PREFIX + (name.removesuffix("_total") if kind == "counter" else name)
                self._metrics[name] = kinds[kind](metric_name, doc, labels, registry=self.registry, **extra)
        elif backend == "ray":
            from ray.serve import metrics as ray_metrics

            kinds = {"counter": ray_metrics.Counter, "gauge": ray_metrics.Gauge, "histogram": ray_metrics.Histogram}
            for name, (kind, doc, labels, buckets) in _METRICS.items():
                extra = {"boundaries": list(buckets)} if buckets else {}
                self._metrics[name] = kinds[kind](PREFIX + name, description=doc, tag_keys=labels, **extra)
        else:
            raise ValueError(f"metrics backend must be 'prometheus' or 'ray', got {backend!r}")

    def request(self, endpoint: str, status: int) -> None:
        self._record("requests_total", "inc", 1, endpoint=endpoint, status=str(status))

    def queue(self, waiting: int, running: int) -> None:
        self._record("queue_length", "set", waiting)
        self._record("running_requests", "set", running)

    def finished(self, stats: GenerationStats, latency_s: float, first_token_s: float) -> None:
        self._record("prompt_tokens_total", "inc", stats.prompt_tokens)
        self._record("cached_prompt_tokens_total", "inc", stats.cached_prompt_tokens)
        self._record("generated_tokens_total", "inc", stats.new_tokens)
        self._record("target_forwards_total", "inc", stats.target_forwards)
        for drafter, n in stats.drafted_tokens.items():
            self._record("drafted_tokens_total", "inc", n, drafter=drafter)
        for drafter, n in stats.accepted_tokens.items():
            self._record("accepted_tokens_total", "inc", n, drafter=drafter)
        self._record("request_latency_seconds", "observe", latency_s)
        self._record("time_to_first_token_seconds", "observe", first_token_s)
        if stats.decode_tokens_per_s:
            self._record("decode_tokens_per_second", "observe", stats.decode_tokens_per_s)
        if stats.target_forwards:
            self._record("tokens_per_forward", "observe", stats.tokens_per_forward)
        self._record("engine_queue_seconds", "observe", stats.queue_s)
        for histogram, counts in (("batch_size", stats.batch_sizes), ("step_tokens", stats.step_tokens)):
            for value, steps in counts.items():
                for _ in range(steps):
                    self._record(histogram, "observe", value)

    def prompt_cache(self, stats: PromptCacheStats) -> None:
        """The engine's prompt cache as it stands: its counters advanced to its totals, its gauges set."""
        totals = [
            ("prompt_cache_hits_total", {"tier": "memory"}, stats.memory_hits),
            ("prompt_cache_hits_total", {"tier": "disk"}, stats.disk_hits),
            ("prompt_cache_tokens_total", {"tier": "memory"}, stats.memory_tokens),
            ("prompt_cache_tokens_total", {"tier": "disk"}, stats.disk_tokens),
            ("prompt_cache_disk_load_seconds_total", {}, stats.disk_load_s),
            ("prompt_cache_disk_loads_skipped_total", {}, stats.disk_loads_skipped),
            ("prompt_cache_disk_blocks_total", {"outcome": "written"}, stats.disk_blocks_written),
            ("prompt_cache_disk_blocks_total", {"outcome": "failed"}, stats.disk_write_failures),
            ("prompt_cache_disk_blocks_total", {"outcome": "dropped"}, stats.disk_writes_dropped),
            ("prompt_cache_disk_blocks_total", {"outcome": "rejected"}, stats.disk_blocks_rejected),
            ("prompt_cache_disk_blocks_total", {"outcome": "evicted"}, stats.disk_blocks_evicted),
            ("prompt_cache_disk_blocks_total", {"outcome": "refused"}, stats.disk_entries_refused),
        ]
        for name, tags, total in totals:
            seen = (name, *tags.values())
            self._record(name, "inc", total - self._totals.get(seen, 0), **tags)
            self._totals[seen] = total
        self._record("prompt_cache_bytes", "set", stats.bytes, tier="memory")
        self._record("prompt_cache_bytes", "set", stats.disk_bytes, tier="disk")
        self._record("prompt_cache_disk_saved_seconds", "set", stats.disk_saved_s)

    def engine(self, stats: EngineStats) -> None:
        """The engine's CUDA graphs as they stand."""
        self._record("cuda_graphs", "set", stats.cuda_graphs)
        self._record("cuda_graph_bytes", "set", stats.cuda_graph_bytes)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format (the prometheus backend only)."""
        import prometheus_client

        return prometheus_client.generate_latest(self.registry)

    def _record(self, name: str, method: str, value: float, **tags: str) -> None:
        if value == 0 and method == "inc":
            return
        metric = self._metrics[name]
        if self.backend == "prometheus":
            getattr(metric.labels(**tags) if tags else metric, method)(value)
        else:
            getattr(metric, method)(value, tags=tags or None)
