"""Calls with a time bound, for user code run outside a worker pool: the pre-run checks and
token estimation (main process), and the inline mapper (``workers.count = 0``, see
:class:`zephon.engine.mapper.OrderedMapper`), where no pool's timeout applies.

Python cannot stop a thread, so a call that runs past its bound is left running on a daemon
thread (it cannot keep the process from exiting) and the caller gets :class:`CallTimeoutError` at
once, saying where the call is stuck: the run is refused within the bound instead of waiting for
the call. The calls run on a one-thread :class:`~zephon.engine.threadexec.ThreadExecutor`, the
mechanism the thread workers use: one way of leaving a stuck call behind, not two.

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

import concurrent.futures as cf
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .threadexec import ThreadExecutor

__all__ = ["BoundedCaller", "CallTimeoutError", "release_thread_caller", "thread_caller"]


class CallTimeoutError(TimeoutError):
    """A bounded call did not return within ``seconds``; ``where`` is the line it is stuck at
    (``file:line in function``, see :mod:`zephon.engine.stuck`), '' when that cannot be told."""

    def __init__(self, seconds: float, where: str = "") -> None:
        at = f" (stuck at {where})" if where else ""
        super().__init__(f"did not return within {seconds:g} s{at}")
        self.seconds, self.where = seconds, where


def _shutdown(box: list[ThreadExecutor]) -> None:
    """End the serving thread of a caller that is gone (its thread ended, or it was collected)."""
    for ex in box:
        ex.shutdown(wait=False)
    box.clear()


class BoundedCaller:
    """Runs calls one at a time on a daemon thread and waits at most a bound for each; one
    thread serves many calls (a thread per call would cost more than a cheap user function).

    :meth:`submit` and :meth:`abandon` are the two halves of :meth:`call` for a caller that waits
    on its own terms (the inline mapper waits in slices, to notice a close meanwhile). The
    serving thread ends with :meth:`close`, or when the caller is collected."""

    def __init__(self, name: str = "zephon-bounded-call") -> None:
        self._name = name
        self._box: list[ThreadExecutor] = []  # the current executor, if started
        self._last: cf.Future | None = None  # the last call submitted
        weakref.finalize(self, _shutdown, self._box)

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """Start ``fn(*args)`` on the serving thread (after the calls submitted before)."""
        if not self._box:
            self._box.append(ThreadExecutor(1, self._name))
        self._last = self._box[0].submit(fn, *args)
        return self._last

    @property
    def idle(self) -> bool:
        """Whether no call submitted here is pending or running."""
        return self._last is None or self._last.done()

    def abandon(self) -> str:
        """The serving thread is stuck in a call: leave it to end with the process (a daemon),
        and return where it is stuck; the next call starts a fresh thread."""
        if not self._box:
            return ""
        ex = self._box.pop()
        stuck = ex.abandon(grace_s=0.0)
        return stuck[0] if stuck else ""

    def call(self, seconds: float | None, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``, or :class:`CallTimeoutError` after ``seconds`` (None: no bound, called here)."""
        if seconds is None:
            return fn(*args, **kw)
        fut = self.submit(functools.partial(fn, **kw) if kw else fn, *args)
        try:
            return fut.result(timeout=seconds)
        except cf.TimeoutError:
            if fut.done():  # it ended meanwhile: its own outcome
                return fut.result()
            raise CallTimeoutError(seconds, self.abandon()) from None
        except BaseException:
            if not fut.done():  # interrupted while waiting (Ctrl-C): do not queue behind the call
                self.abandon()
            raise

    def close(self) -> None:
        """End the serving thread (one stuck in a timed-out call is a daemon, left to finish)."""
        _shutdown(self._box)


_LOCAL = threading.local()


def thread_caller() -> BoundedCaller:
    """This thread's :class:`BoundedCaller` (made on first use; its serving thread ends when
    this thread does). One per consumer thread, not one per lane: 1,024 inline lanes pulled by
    one thread share one serving thread."""
    caller = getattr(_LOCAL, "caller", None)
    if caller is None:
        caller = _LOCAL.caller = BoundedCaller("zephon-inline")
    return caller


def release_thread_caller() -> None:
    """End this thread's :func:`thread_caller` if it has one and it is idle (a closing inline
    mapper calls it: no thread outlives the pipelines that used it; the next use starts one)."""
    caller = getattr(_LOCAL, "caller", None)
    if caller is not None and caller.idle:
        _LOCAL.caller = None
        caller.close()
