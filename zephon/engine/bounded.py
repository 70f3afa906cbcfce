"""Calls with a time bound, for user code run in the main process before a run (pre-run checks,
token estimation), where no worker timeout applies.

Python cannot stop a thread, so a call that runs past its bound is left running on a daemon
thread (it cannot keep the process from exiting) and the caller gets :class:`CallTimeoutError` at
once: the run is refused within the bound instead of waiting for the call.

    >>> caller = BoundedCaller()
    >>> caller.call(2.0, sum, [1, 2, 3])
    6
    >>> import time
    >>> try:
    ...     caller.call(0.05, time.sleep, 0.5)
    ... except CallTimeoutError as e:
    ...     print(e.seconds)
    0.05
    >>> caller.close()
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["BoundedCaller", "CallTimeoutError"]


class CallTimeoutError(TimeoutError):
    """A bounded call did not return within ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"did not return within {seconds:g} s")
        self.seconds = seconds


class BoundedCaller:
    """Runs calls one at a time on a daemon thread and waits at most a bound for each; one
    thread serves many calls (a thread per call would cost more than a cheap user function)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] | None = None
        self._thread: threading.Thread | None = None

    def _serve(self, jobs: queue.SimpleQueue[Any]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, args, kw, box, done = job
            try:
                box.append((True, fn(*args, **kw)))
            except BaseException as e:  # handed to the caller, who re-raises it
                box.append((False, e))
            done.set()

    def call(self, seconds: float | None, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``, or :class:`CallTimeoutError` after ``seconds`` (None: no bound, called here)."""
        if seconds is None:
            return fn(*args, **kw)
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._serve, args=(self._jobs,), name="zephon-bounded-call", daemon=True
            )
            self._thread.start()
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._jobs.put((fn, args, kw, box, done))
        if not done.wait(seconds):
            self._jobs = self._thread = None  # that thread is stuck in the call: the next call gets a fresh one
            raise CallTimeoutError(seconds)
        ok, value = box[0]
        if ok:
            return value
        raise value

    def close(self) -> None:
        """End the serving thread (one stuck in a timed-out call is a daemon, left to finish)."""
        jobs, thread = self._jobs, self._thread
        self._jobs = self._thread = None
        if jobs is not None and thread is not None:
            jobs.put(None)
            thread.join(5.0)
