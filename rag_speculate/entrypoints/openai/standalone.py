"""The standalone server (`rag-speculate serve`): uvicorn on this process's main thread, shut down gracefully.

On SIGTERM or SIGINT the server refuses new requests and those waiting in the queue at once (503),
gives the running generation `shutdown_timeout_s` to finish, then stops it: a streamed answer ends
with a last chunk whose finish_reason is "shutdown" and `[DONE]`, a whole one gets a 503. uvicorn
stops accepting connections, closes each as its response ends, and the process exits 0. A second
signal stops waiting for the connections.
"""

from __future__ import annotations

import asyncio
import socket
from types import FrameType

import uvicorn

from .app import create_app
from .config import ServerConfig
from .server import Server

# After the generations are stopped, how long their last chunks get to reach slow clients before
# uvicorn cancels what is still running.
FLUSH_S = 5.0


def serve(server: Server, config: ServerConfig, host: str, port: int) -> None:
    """Serve `server`'s API on host:port until SIGTERM or SIGINT."""
    app = create_app(server, **config.app_options())
    graceful = config.shutdown_timeout_s + FLUSH_S
    _Uvicorn(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=graceful), server, config.shutdown_timeout_s).run()


class _Uvicorn(uvicorn.Server):
    """uvicorn, telling the server as soon as a signal arrives (uvicorn's own shutdown tells the app
    only once every connection has closed), and exiting 0 rather than raising the signal again."""

    def __init__(self, config: uvicorn.Config, server: Server, shutdown_timeout_s: float):
        super().__init__(config)
        self.app_server, self.shutdown_timeout_s = server, shutdown_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
            return
        self.should_exit = True
        if self.loop is not None:  # signal handlers run on the main thread, the loop's: hand it over safely
            self.loop.call_soon_threadsafe(self.app_server.shut_down, self.shutdown_timeout_s)
