"""Replicas of the server on Ray Serve: the same FastAPI app, one engine per replica.

`serve.ingress` wraps the app each replica builds around its own engine, so a request reaches the
same routes, checks and responses as on a standalone server. Ray's router sends a request to a
replica with room (`max_ongoing_requests`: the generations its engine batches, and one more, already
tokenized, so the engine never idles between them) and holds the rest in its own queue up to
`max_queued_requests`, past which it answers 503: requests wait where any replica can take them. Each replica keeps its own phrase pool and its prompt cache's
memory tier; with `prompt_cache_dir` they share one disk tier, so a prefix one replica prefilled is a hit
for the others (on one node, or a folder every node mounts). The index files are opened read-only, the
token arrays memory-mapped, so replicas on one node share them in the page cache.
Cancellation reaches a replica's request only at an `await`: the engine's steps run on a worker
thread, so the awaiting request is cancelled at once and stops the generation at its next step.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from ...engine.engine import DEFAULT_MAX_BATCH
from .app import create_app
from .config import ServerConfig, load
from .metrics import Metrics
from .server import Server


@serve.deployment(name="rag-speculate")
@serve.ingress()
class ServerReplica:
    def __init__(self, config: ServerConfig):
        import ray
        import torch

        # As many torch threads as CPUs Ray reserved for the replica: more would oversubscribe the node.
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        if cpus:
            torch.set_num_threads(max(1, int(cpus)))
        engine, index = load(config)
        # Room for all Ray routes here: an engine that cannot batch runs one and holds the rest.
        waiting = replica_ongoing(config) - engine.max_batch
        self.server = Server(engine, config.name, index, max_queued=waiting, metrics=Metrics("ray"))
        self.config = config

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.server, **self.config.app_options())


def application(config: ServerConfig, replicas: int = 1, cpus_per_replica: float = 1.0, gpus_per_replica: float = 0.0) -> serve.Application:
    """The deployment for `serve.run`: `replicas` engines, and at most `config.max_queued` requests
    queued in Ray's router beyond what they hold. With `gpus_per_replica`, Ray places each replica
    on a GPU of its own and shows it only that one, which `device=None` then picks."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    options = {"num_replicas": replicas, "max_queued_requests": config.max_queued, "max_ongoing_requests": replica_ongoing(config),
               "ray_actor_options": {"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica}}
    return ServerReplica.options(**options).bind(config)


def replica_ongoing(config: ServerConfig) -> int:
    """Requests one replica holds: the generations its engine batches and one more, checked and tokenized."""
    return (DEFAULT_MAX_BATCH if config.max_batch is None else config.max_batch) + 1


def run(config: ServerConfig, replicas: int, host: str, port: int, cpus_per_replica: float = 1.0,
        gpus_per_replica: float = 0.0, blocking: bool = True) -> None:
    """Start (or join, where RAY_ADDRESS names a cluster) Ray, and serve `replicas` on host:port."""
    import ray

    if not ray.is_initialized():
        ray.init(runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(config, replicas, cpus_per_replica, gpus_per_replica), name="rag-speculate", route_prefix="/",
              blocking=blocking)
