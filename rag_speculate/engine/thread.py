"""The engine's thread: every generation of an engine runs on one thread, in the order submitted.

torch runs a CPU forward's operators on an OpenMP thread team that belongs to the calling thread, and
a team's threads spin for a while after each parallel region before they sleep. Generations run from
several threads (the caller's, a stream's worker) keep several teams, and on a machine with few cores
the spinning threads of the idle teams take the cores the busy team needs, so a step costs more on
whichever thread did not run the last one. Running every forward on one thread keeps one team, and a
step costs the same whoever called (`benchmarks/thread_cost.py` measures it).

The thread ends after `idle_s` without work and the next submission starts another, so an engine
that is dropped leaves no thread behind for long.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class EngineThread:
    def __init__(self, name: str, idle_s: float = 10.0):
        self.name = name
        self.idle_s = idle_s
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # Jobs submitted and not yet finished.
        self.pending = 0

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on the engine's thread after the jobs before it; `job` handles its own errors."""
        with self._lock:
            self.pending += 1
            self._jobs.put(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def is_current(self) -> bool:
        """Whether the caller runs on the engine's thread (where waiting for a job would never end)."""
        return threading.current_thread() is self._thread

    def _loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                # Under the lock, so a job submitted now either is seen here or starts a new thread.
                with self._lock:
                    if self._jobs.empty():
                        self._thread = None
                        return
                continue
            try:
                job()
            finally:
                with self._lock:
                    self.pending -= 1
