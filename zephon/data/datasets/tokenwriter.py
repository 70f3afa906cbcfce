"""The token cache's background writer: appends queued entries off the tokenizing threads.

Why a module of its own: the block store (:mod:`.tokencache`) says how entries are appended and
kept correct; this says when. A tokenizing worker only queues its new entries; one thread per
process gathers what is queued for a moment and appends it once per block, so a run's many chunks
cost a few appends (each one a file's open, lock, checks and write, every syscall a wait for the
interpreter lock beside busy workers). Entries beyond :data:`QUEUE_BYTES` waiting are dropped: the
cache is optional, and a slow disk never slows a run.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["GATHER_S", "QUEUE_BYTES", "GatheringWriter"]

QUEUE_BYTES = 256 << 20  # ids waiting for the writer; more are dropped (the cache is optional)
_DRAIN = 1024  # queued writes the writer merges into one append per block
#: how long the writer gathers writes before it appends them (unless _GATHER_BYTES are queued
#: sooner). Longer gathering means fewer appends, but concurrent jobs see each other's entries
#: later and tokenize more twice: four concurrent cold jobs tokenized 1.04-1.11x one job's at
#: 20 ms, 1.19-1.48x at 0.25 s; a conversation's small entry costs more per token to append
GATHER_S = 0.02
_GATHER_BYTES = 4 << 20
_GATHER_TICK_S = 0.01  # how often it looks while gathering

Write = Callable[[str, bytes, int, list[Any]], None]  # (block path, tag, id width, (key, entry) pairs)


class GatheringWriter:
    """One background thread that calls ``write`` for what :meth:`put` queued, merged per block
    (``write`` handles its own errors: the thread never dies on one)."""

    def __init__(self, write: Write, name: str = "zephon-token-cache") -> None:
        self._write, self._name = write, name
        self._mu = threading.Lock()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queued = 0  # bytes of ids waiting
        self._thread: threading.Thread | None = None
        self._hurry = threading.Event()  # set while someone waits for the queue to be written

    def put(self, path: str, tag: bytes, width: int, items: list[Any], nbytes: int) -> bool:
        """Queue ``items`` for block ``path``; False when they were dropped (the writer is
        :data:`QUEUE_BYTES` behind)."""
        with self._mu:
            if self._queued + nbytes > QUEUE_BYTES:
                return False
            self._queued += nbytes
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((path, tag, width, items, nbytes))
        return True

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until what is queued is written (cutting the gathering short)."""
        deadline = time.monotonic() + timeout_s
        self._hurry.set()
        try:
            while time.monotonic() < deadline:
                with self._mu:
                    if self._queued == 0 and self._queue.unfinished_tasks == 0:
                        return True
                time.sleep(0.005)
            return False
        finally:
            self._hurry.clear()

    def _loop(self) -> None:
        while True:
            got = self._gather()
            merged: dict[tuple[str, bytes, int], list[Any]] = {}
            for path, tag, width, items, _ in got:
                merged.setdefault((path, tag, width), []).extend(items)
            try:
                for (path, tag, width), items in merged.items():
                    self._write(path, tag, width, items)
            finally:
                with self._mu:
                    self._queued -= sum(g[4] for g in got)
                for _ in got:
                    self._queue.task_done()

    def _gather(self) -> list[Any]:
        """The queued writes to append together: gathered for :data:`GATHER_S` (or until
        :data:`_GATHER_BYTES` of ids); :meth:`flush` cuts it short."""
        got = [self._queue.get()]
        nbytes = got[0][4]
        until = time.monotonic() + GATHER_S
        while True:
            with contextlib.suppress(queue.Empty):
                while len(got) < _DRAIN and nbytes < _GATHER_BYTES:
                    got.append(self._queue.get_nowait())
                    nbytes += got[-1][4]
            left = until - time.monotonic()
            if nbytes >= _GATHER_BYTES or len(got) >= _DRAIN or left <= 0 or self._hurry.is_set():
                return got
            self._hurry.wait(min(left, _GATHER_TICK_S))
