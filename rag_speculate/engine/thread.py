"""The engine's thread: every forward of an engine runs on it, whichever thread asked for the generation.

torch runs a CPU forward's operators on an OpenMP thread team that belongs to the calling thread, and
a team's threads spin for a while after each parallel region before they sleep. Generations run
from several threads (the caller's, a stream's worker) keep several teams, and on a machine with
few cores the spinning threads of the idle teams take the cores the busy team needs. Running every
forward on one thread keeps one team busy, and a step costs the same whoever called
(`benchmarks/thread_cost.py` measures it). It is also what lets the generations in flight share
each forward (`scheduler.py`).

The thread ends after `idle_s` without work and the next `wake` starts another, so an engine that
is dropped leaves no thread behind for long; at the interpreter's exit every engine's thread is
ended and joined first, as torch's native threads torn down under a live one abort the process.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable

# Every engine thread that may still run, for `_end_all` at exit.
_threads: weakref.WeakSet[EngineThread] = weakref.WeakSet()


class EngineThread:
    def __init__(self, name: str, step: Callable[[], bool], failed: Callable[[BaseException], None], idle_s: float = 10.0):
        """`step()` runs one step of the work in flight and says whether there may be more; an
        exception out of it goes to `failed` (whose work it was is lost), and the thread goes on."""
        self.name, self.idle_s = name, idle_s
        self._step, self._failed = step, failed
        self._lock = threading.Lock()
        self._woken = threading.Event()
        self._thread: threading.Thread | None = None
        self._ending = False
        _threads.add(self)

    def wake(self) -> None:
        """There is work: run steps until there is none."""
        with self._lock:
            self._woken.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def end(self, timeout_s: float = 5.0) -> None:
        """No more steps: the thread ends after the one under way (waited for up to `timeout_s`)."""
        with self._lock:
            self._ending = True
            self._woken.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def is_current(self) -> bool:
        """Whether the caller runs on the engine's thread (where waiting for a generation would never end)."""
        return threading.current_thread() is self._thread

    def _loop(self) -> None:
        while not self._ending:
            self._woken.clear()
            try:
                busy = self._step()
            except Exception as error:  # noqa: BLE001 - handed on; the thread must outlive one bad step
                self._failed(error)
                busy = False
            if busy:
                continue
            if not self._woken.wait(timeout=self.idle_s):
                # Under the lock, so a `wake` now either is seen here or starts a new thread.
                with self._lock:
                    if not self._woken.is_set():
                        self._thread = None
                        return
        with self._lock:
            self._thread = None


@atexit.register
def _end_all() -> None:
    for engine_thread in list(_threads):
        engine_thread.end()
