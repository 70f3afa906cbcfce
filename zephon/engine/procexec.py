"""A process executor whose worker starts cannot be cut short by a signal (see
:class:`ProcessExecutor`); :class:`zephon.engine.workers.WorkerPool` runs process workers on it."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Any

__all__ = ["ProcessExecutor"]


class ProcessExecutor(cf.ProcessPoolExecutor):
    """A process executor whose workers start on a helper thread, never cut short half-way.

    Why: the executor starts a worker inside ``submit`` (Python >= 3.9 starts them as tasks
    arrive), and a start under the fork server waits for the server (seconds the first time: it
    imports zephon). SIGTERM or Ctrl-C then raises in that wait (Python runs signal handlers in
    the main thread), after the worker's start data was sent but before the executor listed the
    process: nothing joined it, and once this process had exited (removing the queues'
    semaphores) the half-started worker failed unpickling them and printed a traceback. On a
    helper thread the start always completes and lists the process, while the caller's wait
    stays interruptible; :meth:`zephon.engine.workers.WorkerPool.close` waits for starts in progress
    (:meth:`wait_for_starts`) before it stops the workers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._starts: list[threading.Thread] = []
        self._starts_lock = threading.Lock()

    def _spawn_process(self) -> None:
        done = threading.Event()
        error: list[BaseException] = []

        def start() -> None:
            try:
                super(ProcessExecutor, self)._spawn_process()  # type: ignore[misc]
            except BaseException as e:
                error.append(e)
            finally:
                done.set()

        t = threading.Thread(target=start, name="zephon-worker-start", daemon=True)
        with self._starts_lock:
            self._starts = [s for s in self._starts if s.is_alive()]
            self._starts.append(t)
        t.start()
        done.wait()  # interruptible (a signal's handler raises here); the start goes on
        if error:
            raise error[0]

    def wait_for_starts(self, timeout: float = 60.0) -> None:
        """Wait (up to ``timeout`` seconds) for worker starts in progress to list their processes."""
        with self._starts_lock:
            starts, self._starts = self._starts, []
        deadline = time.monotonic() + timeout
        for t in starts:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
