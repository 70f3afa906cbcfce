"""Shutdown in bounded time: SIGTERM and Ctrl-C end a process within a grace period, whatever
it is doing.

Why: a signal handler runs in the main thread and raises there, and the ``with`` blocks unwind:
pipelines are closed (their long loops cancelled, see :func:`zephon.engine.node.cancel_node`),
queued work is dropped and worker pools stop. But a thread may still be inside a call that
nothing can interrupt (a read from a stalled server, a user function), and the interpreter's
exit waits for it. So the first signal also arms a watchdog: if the process has not ended
``grace_s`` seconds later, it removes the temporary files of unfinished checkpoint writes
(:func:`zephon.engine.durable.abandon_pending`), says so on stderr and exits at once
(``os._exit``, status 128 + the signal). Process workers die with their parent (their
lifeline, :mod:`zephon.engine.workers`), so nothing outlives it. A second signal never raises
again (that would break the unwinding the first one started).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from .durable import abandon_pending

__all__ = ["Terminated", "stop_grace_s", "stop_on_signals"]

_armed = threading.Event()


class Terminated(SystemExit):
    """Raised in the main thread by SIGTERM (a scheduler's preemption): the ``with`` blocks
    unwind, so every worker pool is closed, and the process exits with 143 (128 + 15)."""

    def __init__(self) -> None:
        super().__init__(143)


def stop_grace_s() -> float:
    """Seconds a process may take to stop after SIGTERM or Ctrl-C before it exits at once:
    ``$ZEPHON_STOP_GRACE_S``, default 5."""
    raw = os.environ.get("ZEPHON_STOP_GRACE_S", "")
    try:
        v = float(raw) if raw else 5.0
    except ValueError:
        raise ValueError(f"$ZEPHON_STOP_GRACE_S must be a number of seconds, got {raw!r}") from None
    return v if v >= 0 else 5.0


def _arm(name: str, signum: int, grace_s: float) -> bool:
    """Start the watchdog (once per process); False if it was already armed."""
    if _armed.is_set():
        return False
    _armed.set()

    def watch() -> None:
        time.sleep(grace_s)
        left = abandon_pending()
        what = signal.Signals(signum).name
        note = f"; removed {len(left)} unfinished temporary file(s)" if left else ""
        with contextlib.suppress(OSError):  # os.write: sys.stderr's lock may be held by a stuck thread
            os.write(2, f"{name}: still running {grace_s:g} s after {what}; exiting now{note}\n".encode())
        os._exit(128 + signum)

    threading.Thread(target=watch, name="zephon-stop-watchdog", daemon=True).start()
    return True


@contextlib.contextmanager
def stop_on_signals(name: str, grace_s: float | None = None) -> Iterator[None]:
    """Within the block (main thread only; elsewhere it does nothing): SIGTERM raises
    :class:`Terminated` and SIGINT ``KeyboardInterrupt`` in the main thread, and either arms
    the watchdog (see the module doc) that ends the process ``grace_s`` seconds later
    (default :func:`stop_grace_s`) if it is still running. ``name`` starts the watchdog's line."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    grace = stop_grace_s() if grace_s is None else grace_s

    def on_signal(signum: int, frame: Any) -> None:
        if not _arm(name, signum, grace):
            return  # already stopping: let the unwinding finish (the watchdog bounds it)
        if signum == signal.SIGTERM:
            raise Terminated()
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
