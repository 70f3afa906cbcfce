"""A thread executor that a hung call cannot keep alive (see :class:`ThreadExecutor`);
:class:`zephon.engine.workers.WorkerPool` runs thread workers on it."""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .stuck import where_stuck

__all__ = ["ThreadExecutor"]


class ThreadExecutor(cf.Executor):
    """``count`` daemon threads running tasks in submission order; a shutdown waits for a
    running call at most a bounded time.

    Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined by its
    ``shutdown(wait=True)`` and again when the interpreter exits, so one call that never returns
    (a user function in an endless loop, a read from a stalled server) keeps the run alive after
    its error was raised, until the call returns (the read's own timeout) or forever. Here
    :meth:`abandon` waits up to ``grace_s`` for the running calls, then leaves the threads still
    inside one to end with the process (they are daemons) and says where each is stuck.

    >>> ex = ThreadExecutor(2, "doc")
    >>> ex.submit(pow, 2, 10).result()
    1024
    >>> ex.abandon(grace_s=5.0)
    []
    """

    def __init__(self, count: int, name: str) -> None:
        if count < 1:
            raise ValueError(f"a ThreadExecutor needs count >= 1, got {count}")
        self._count, self._name = count, name
        self._tasks: queue.SimpleQueue[tuple[cf.Future, Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._running: dict[int, cf.Future] = {}  # thread ident -> the future it is computing
        self._lock = threading.Lock()
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future:
        if kwargs:
            raise TypeError("ThreadExecutor.submit takes positional arguments only")
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            fut: cf.Future = cf.Future()
            self._tasks.put((fut, fn, args))
            if len(self._threads) < self._count:  # started as tasks arrive, up to `count`
                t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
        return fut

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            task = self._tasks.get()
            if task is None:
                self._tasks.put(None)  # wake the next thread too
                return
            fut, fn, args = task
            if not fut.set_running_or_notify_cancel():
                continue
            self._running[me] = fut
            try:
                result = fn(*args)
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(result)
            finally:
                self._running.pop(me, None)
                del fut, fn, args, task  # hold nothing of a finished task while waiting

    def running_thread(self, fut: cf.Future) -> int | None:
        """The ident of the thread computing ``fut``, or None when no thread is."""
        for ident, f in list(self._running.items()):
            if f is fut:
                return ident
        return None

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As ``Executor.shutdown``; with ``wait`` it waits for every call to return (use
        :meth:`abandon` for a bounded wait)."""
        self._stop(cancel_futures)
        if wait:
            for t in list(self._threads):
                t.join()

    def abandon(self, grace_s: float) -> list[str]:
        """Shut down, dropping the tasks not started; wait up to ``grace_s`` seconds for the
        running calls, and return where each call still running is stuck (see
        :func:`where_stuck`). Those threads are left to end with the process."""
        self._stop(cancel_futures=True)
        deadline = time.monotonic() + grace_s
        for t in list(self._threads):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return [where_stuck(t.ident) or t.name for t in self._threads if t.is_alive() and t.ident is not None]

    def _stop(self, cancel_futures: bool) -> None:
        with self._lock:
            self._shutdown = True
        if cancel_futures:
            while True:
                try:
                    task = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task[0].cancel()
        self._tasks.put(None)
