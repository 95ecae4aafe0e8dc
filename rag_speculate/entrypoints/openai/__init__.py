"""An OpenAI-compatible server over the speculative engine (`rag-speculate serve`), standalone or as
replicas on Ray Serve (`ray_serve.py`). `app.create_app(server)` is the FastAPI app.

    config.py     what a server is built from        server.py   requests to generations and back
    protocol.py   the requests it reads               app.py      the HTTP API (FastAPI, OpenAI's types)
    admission.py  the bounded queue                   metrics.py  Prometheus metrics
"""

from .config import ServerConfig, load
from .server import Server

__all__ = ["Server", "ServerConfig", "load"]
