"""An OpenAI-compatible server over the speculative engine (`rag-speculate serve`), standalone or as
replicas on Ray Serve (`ray_serve.py`). `app.create_app(server)` is the FastAPI app.

    config.py     what a server is built from        server.py      requests to generations and back
    protocol.py   the requests it reads               app.py         the HTTP API (FastAPI, OpenAI's types)
    admission.py  the bounded queue                   metrics.py     Prometheus metrics
    standalone.py uvicorn, shut down gracefully       background.py  the server on a thread of this process
"""

from typing import Any

from .config import ServerConfig, load

__all__ = ["Server", "ServerConfig", "load"]


def __getattr__(name: str) -> Any:
    # The server needs the serve extra (pydantic, FastAPI); its configuration, which the command
    # line reads its defaults from, does not.
    if name == "Server":
        from .server import Server

        return Server
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
