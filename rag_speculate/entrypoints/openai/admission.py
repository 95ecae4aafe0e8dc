"""The bounded queue in front of the engine: one generation runs, a few wait, the rest are turned away.

An engine runs one generation at a time, so a request that cannot start waits here, in arrival
order; once `max_queued` are waiting, the next is refused at once (the server answers 503 with
Retry-After) rather than left to wait longer than any client would. A waiting request whose client
goes away leaves the queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class QueueFull(Exception):
    """Every slot is taken and the queue is full."""


class Admission:
    def __init__(self, max_running: int = 1, max_queued: int = 16, observe: Callable[[int, int], None] | None = None):
        """`observe(waiting, running)` is told every change of the counts (the server's metrics)."""
        if max_running < 1 or max_queued < 0:
            raise ValueError(f"need max_running >= 1 and max_queued >= 0, got {max_running} and {max_queued}")
        self.max_running, self.max_queued = max_running, max_queued
        self.running = 0
        self.waiting = 0
        self._observe = observe or (lambda waiting, running: None)
        # Created on first use: the lock must belong to the event loop that serves the requests.
        self._slots: asyncio.Semaphore | None = None

    def check(self) -> None:
        """Raise QueueFull if a request arriving now would be refused."""
        if self.running >= self.max_running and self.waiting >= self.max_queued:
            raise QueueFull(f"{self.running} generation(s) running and {self.waiting} waiting")

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Wait for the engine (or raise QueueFull at once); hold it for the body of the `with`."""
        self.check()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_running)
        self._change(waiting=1)
        try:
            await self._slots.acquire()
        finally:
            self._change(waiting=-1)
        self._change(running=1)
        try:
            yield
        finally:
            self._change(running=-1)
            self._slots.release()

    def _change(self, waiting: int = 0, running: int = 0) -> None:
        self.waiting += waiting
        self.running += running
        self._observe(self.waiting, self.running)
