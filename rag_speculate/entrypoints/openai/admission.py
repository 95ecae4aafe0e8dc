"""The bounded queue in front of the engine: one generation runs, a few wait, the rest are turned away.

An engine runs one generation at a time, so a request that cannot start waits here, in arrival
order. A request takes its place (`enter`) before any work is done for it and before any byte of
its answer is sent, so the bound holds for streamed requests too: once `max_queued` are waiting
(being checked and tokenized counts), the next is refused at once (the server answers 503 with
Retry-After) rather than left to wait longer than any client would. A waiting request whose client
goes away leaves the queue; once the server is shutting down (`close`), waiting requests are
refused too.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class Unavailable(Exception):
    """The queue is full, or the server is shutting down: the message says which."""


class Admission:
    def __init__(self, max_running: int = 1, max_queued: int = 16, observe: Callable[[int, int], None] | None = None):
        """`observe(waiting, running)` is told every change of the counts (the server's metrics)."""
        if max_running < 1 or max_queued < 0:
            raise ValueError(f"need max_running >= 1 and max_queued >= 0, got {max_running} and {max_queued}")
        self.max_running, self.max_queued = max_running, max_queued
        self.running = 0
        self.waiting = 0
        self.closed = False
        self._queue: deque[Ticket] = deque()  # tickets waiting for a slot, first come first served
        self._observe = observe or (lambda waiting, running: None)

    def enter(self) -> Ticket:
        """A place for a request arriving now, counted as waiting; Unavailable if there is none."""
        if self.closed:
            raise Unavailable("the server is shutting down")
        if self.running + self.waiting >= self.max_running + self.max_queued:
            raise Unavailable(f"the server is busy ({self.running} generation(s) running and {self.waiting} waiting)")
        self._change(waiting=1)
        return Ticket(self)

    def close(self) -> None:
        """Refuse every request from now on, those waiting for a slot included."""
        self.closed = True
        while self._queue:
            ticket = self._queue.popleft()
            if not ticket.turn.done():
                ticket.turn.set_exception(Unavailable("the server is shutting down"))

    def _dispatch(self) -> None:
        """Hand the free slots to the tickets waiting for them, in arrival order."""
        while self._queue and self.running < self.max_running:
            ticket = self._queue.popleft()
            if ticket.turn.done():  # its request was cancelled and has not released it yet
                continue
            ticket.state = "running"
            self._change(waiting=-1, running=1)
            ticket.turn.set_result(None)

    def _change(self, waiting: int = 0, running: int = 0) -> None:
        self.waiting += waiting
        self.running += running
        self._observe(self.waiting, self.running)


class Ticket:
    """One request's place: waiting, then running once `start` returns, until `release` (which may be
    called any number of times, from any state)."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self.state = "waiting"
        self.turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        """Wait for a slot on the engine; Unavailable if the server shuts down first."""
        if self._admission.closed:
            raise Unavailable("the server is shutting down")
        self._admission._queue.append(self)
        self._admission._dispatch()
        await self.turn

    def release(self) -> None:
        """Give the place up: leave the queue, or free the slot for the next request."""
        admission, state, self.state = self._admission, self.state, "released"
        if state == "running":
            admission._change(running=-1)
        elif state == "waiting":
            self.turn.cancel()
            if self in admission._queue:
                admission._queue.remove(self)
            admission._change(waiting=-1)
        admission._dispatch()
