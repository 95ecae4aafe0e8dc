"""The server on a background thread of this process: for notebooks, tests and benchmarks that
want a real HTTP endpoint beside their own code."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def running(
    app: Any, host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 30.0, sock: socket.socket | None = None
) -> Iterator[str]:
    """Serve the ASGI `app` under uvicorn until the block ends; yields the API's base URL (".../v1").
    `sock`: a listening socket to serve on instead of host:port, whose options (a send buffer's
    size, say) its connections inherit."""
    import uvicorn

    if sock is not None:
        host, port = sock.getsockname()[:2]
    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    sockets = None if sock is None else [sock]
    thread = threading.Thread(target=server.run, args=(sockets,), name="rag-speculate-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
