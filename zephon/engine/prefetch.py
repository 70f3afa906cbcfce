"""Prefetching as a wrapper node: a source run on a background thread, a few items ahead.

Why: a training step should not wait on a burst of work (a shuffle window refill), yet a
checkpoint must describe exactly what was delivered, not what the thread computed ahead. The
thread queues each item with the source's state right after it, so :meth:`Prefetcher.get_state`
is the state matching the last item :meth:`Prefetcher.next` returned.
"""

from __future__ import annotations

import copy
import queue
import threading
from typing import Any, TypeVar

from torchdata.nodes import BaseNode

from .node import PipelineError, close_node

__all__ = ["Prefetcher"]

T = TypeVar("T")


class Prefetcher(BaseNode[T]):
    """``source`` computed up to ``depth`` items ahead on a thread; transparent to checkpoints.

    The state is the source's own state after the last delivered item (not wrapped), so a
    prefetched node and its bare source write and read the same checkpoints. The thread starts
    on the first ``next()`` after a reset, not in ``reset()``: a reset followed only by a restore
    (DCP asks for a template state first) computes nothing ahead. The source's end and errors
    are raised in the consumer's ``next()``, and keep being raised. ``close()`` stops the thread
    and closes the source.

    >>> from zephon.engine.testing import RangeSource
    >>> p = Prefetcher(RangeSource(5), depth=2)
    >>> next(p), next(p)
    (0, 1)
    >>> q = Prefetcher(RangeSource(5), depth=2)
    >>> q.reset(p.state_dict())  # the state after the two delivered items, not the computed ones
    >>> list(q)
    [2, 3, 4]
    >>> p.close(); q.close()
    """

    def __init__(self, source: BaseNode[T], depth: int, *, name: str = "zephon-prefetch") -> None:
        super().__init__()
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"prefetch depth must be an integer >= 1 (items computed ahead), got {depth!r}")
        self.source, self.depth, self.name = source, depth, name
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._delivered: dict[str, Any] | None = None
        self._start_pending = False
        self._closed = False

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._stop_thread()
        self.source.reset(initial_state)
        self._delivered = self.source.state_dict()
        self._start_pending = True

    def next(self) -> T:
        if self._start_pending:
            self._start_pending = False
            self._start_thread()
        q = self._queue
        if q is None:
            raise PipelineError(f"{self!r}: the prefetch thread is not running; reset() it first")
        while True:
            try:
                kind, value, state = q.get(timeout=1.0)
                break
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    why = "was closed while next() waited" if self._closed else "the prefetch thread is gone"
                    raise PipelineError(f"{self!r}: {why}") from None
        if kind == "ok":
            self._delivered = state
            return value
        q.put((kind, value, state))  # keep raising the same end / error
        if kind == "end":
            raise StopIteration
        raise value

    def get_state(self) -> dict[str, Any]:
        """The source's state after the last delivered item (a copy: the caller may keep it)."""
        if self._delivered is None:
            raise PipelineError(f"{self!r}: no state before reset()")
        return copy.deepcopy(self._delivered)

    def close(self) -> None:
        """Stop the thread, then close the source (idempotent)."""
        self._closed = True
        self._stop_thread()
        close_node(self.source)

    def __repr__(self) -> str:
        return f"Prefetcher(depth={self.depth}, source={self.source!r})"

    def _start_thread(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(
            target=self._produce, args=(self._stop, self._queue), name=self.name, daemon=True
        )
        self._thread.start()

    def _produce(self, stop: threading.Event, q: queue.Queue) -> None:
        while not stop.is_set():
            item: tuple[str, Any, dict[str, Any] | None]
            try:
                value = next(self.source)
                item = ("ok", value, self.source.state_dict())
            except StopIteration:
                item = ("end", None, None)
            except BaseException as e:  # surfaced in the consumer's next()
                item = ("err", e, None)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] != "ok":
                return

    def _stop_thread(self) -> None:
        self._start_pending = False
        t, self._thread = self._thread, None
        if t is None:
            return
        self._stop.set()
        q = self._queue
        while t.is_alive():
            try:
                while q is not None:
                    q.get_nowait()
            except queue.Empty:
                pass
            t.join(timeout=0.1)
        self._queue = None
