"""Shared-memory transport of process workers' results: the consumer gets views, no copy.

Why: a process worker's result normally travels pickled through a pipe. For an image chunk
(8 images, ~27 MB of float32 patches) that is a pickle in the worker, a pipe copy and an
unpickle into fresh memory in the consumer: measured 46% of all CPU samples of a 2-process
vision run, and 2 process workers delivered 0.5-0.66x the images of 2 threads.

Design. One *arena* per worker process: an anonymous ``memfd`` created by the consumer (the
pool's process) when the pool starts. It has no name anywhere, so nothing can ever be left in
/dev/shm: the kernel frees its memory when the last descriptor and mapping go, whoever closed,
crashed or was killed. Workers get every arena's descriptor when they start (an initializer
step, :func:`arena_worker_start`); each claims one with ``flock`` on a private re-open (held
until it exits) and maps it once, as does the consumer, so pages stay mapped and populated
(fresh memory costs ~20x reused memory on the VM this was measured on: one segment per result
would be slower than pickling).

A worker pickles a result with protocol 5; contiguous buffers of at least :data:`ARENA_MIN_OOB`
bytes (patches, token ids, per-row arrays) go out of band into one first-fit allocation of its
arena (one ``memcpy``); only the small pickle and the offsets travel through the executor's
pipe (:func:`run_packed`). The consumer rebuilds the result with ``pickle.loads(data,
buffers=...)`` whose arrays are views of its own mapping (:meth:`ArenaSet.unpack`); a
``weakref.finalize`` on the allocation's base array sends the offset back through the arena's
free pipe when the last view is gone, and the worker reuses the space (NumPy keeps that base
array as the ``.base`` of every array derived from the views, so it cannot die early).

It never blocks: an allocation that does not fit (a consumer holding many results) sends the
result pickled in band, as without an arena. The space an arena may use is sized from the
in-flight budget: ``ARENA_AUTO_FACTOR x`` (tasks in flight per worker) ``x`` (the largest
result seen), or a fixed ``WorkerConfig.shm_mb``; pages above the highest live allocation are
handed back to the kernel once they are more than half of what is touched. Any failure to set
an arena up (no ``memfd_create``, no ``/proc``, a mapping refused by ``RLIMIT_AS``) leaves that
worker, or the pool, on plain pickling, with one warning: never an error.

Parent death is not this module's business: workers end with the pool, or through the pool's
other worker-start steps.

>>> import numpy as np
>>> arenas = ArenaSet(1, reserve=1 << 20)
>>> arena_worker_start(*arenas.initargs(local=True))  # what a worker runs when it starts (here: us)
>>> msg = run_packed(np.arange, 1000)           # a worker's reply: small, the array in the arena
>>> out = arenas.unpack(msg)
>>> int(out.sum()), np.shares_memory(out, np.frombuffer(arenas.mapping(0), np.uint8))
(499500, True)
>>> arenas.metrics()["shm_results"], arenas.metrics()["live_bytes"]
(1, 8000)
>>> del out; arenas.metrics()["live_bytes"]     # the last view died: its space went back
0
>>> arenas.close(); _reset_worker_arena()
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import fcntl
import mmap
import os
import pickle
import struct
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "ARENA_AUTO_FACTOR",
    "ARENA_MIN_OOB",
    "ArenaSet",
    "Packed",
    "arena_available",
    "arena_worker_start",
    "run_packed",
]

#: buffers smaller than this stay in the pickle (their bookkeeping would cost more than the copy)
ARENA_MIN_OOB = 1024
#: automatic arena budget: this many times (tasks in flight per worker) x (largest result seen)
ARENA_AUTO_FACTOR = 2
_ALIGN = 64
_PAGE = mmap.PAGESIZE
_HEADER = _PAGE  # one page of counters before the data area
_MIN_AUTO = 32 << 20  # the automatic budget is never below this
_RELEASE_MIN = 32 << 20  # hand pages back only when at least this much is idle
_FREE = struct.Struct("<q")
# header words (int64): set by the consumer / written by the worker
_H_CAPACITY, _H_PER_WORKER, _H_LIVE, _H_TOUCHED, _H_PEAK, _H_RELEASED, _H_PID, _H_FALLBACK, _H_BUDGET = range(9)


def arena_available() -> bool:
    """Whether this platform has what arenas need (``memfd_create``, shared ``mmap``, ``flock``).

    >>> isinstance(arena_available(), bool)
    True
    """
    return hasattr(os, "memfd_create") and hasattr(mmap, "MAP_SHARED") and os.path.isdir("/proc/self/fd")


def _default_reserve(workers: int) -> int:
    """Address space reserved per arena (virtual: pages exist only once written)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return max(64 << 20, min(16 << 30, ram // 2 // max(1, workers)))


class _Fd:
    """A descriptor that travels to a worker process (forkserver, spawn or fork) as a duplicate."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return (_Fd._rebuild, (DupFd(self.fd),))

    @staticmethod
    def _rebuild(dup: Any) -> _Fd:
        return _Fd(dup.detach())


class Packed:
    """A worker's reply: a result pickled with its large buffers in the worker's arena
    (``arena >= 0``: where, and the spans of each buffer), or the whole pickle in band."""

    __slots__ = ("arena", "data", "offset", "spans", "total")

    def __init__(self, arena: int, offset: int, total: int, spans: tuple[tuple[int, int], ...], data: bytes) -> None:
        self.arena, self.offset, self.total, self.spans, self.data = arena, offset, total, spans, data

    def __reduce__(self):
        return (Packed, (self.arena, self.offset, self.total, self.spans, self.data))


# =========================================================================== consumer side
class ArenaSet:
    """The arenas of one process pool (one per worker), owned by the process that runs the pool.

    ``reserve``: bytes of address space per arena; ``capacity``: a fixed budget per arena in
    bytes, or None for the automatic one (see the module doc). :meth:`set_in_flight` tells the
    workers how many tasks the pool may hold in flight per worker (the automatic budget's unit).
    """

    def __init__(self, workers: int, reserve: int | None = None, capacity: int | None = None) -> None:
        if workers < 1:
            raise ValueError(f"an ArenaSet needs workers >= 1, got {workers}")
        self.workers = workers
        size = int(capacity if capacity else (reserve or _default_reserve(workers)))
        self.reserve = -(-size // _PAGE) * _PAGE
        self.capacity = capacity
        self._fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._free_r: list[int] = []
        self._free_w: list[int] = []
        self._frees: collections.deque[tuple[int, int, int]] = collections.deque()
        self._flush_lock = threading.Lock()
        self._stat_lock = threading.Lock()
        self._live = [0] * workers
        self._peak = 0
        self.shm_results = 0
        self.inband_results = 0
        self.shm_bytes = 0
        self.closed = False
        try:
            for i in range(workers):
                fd = os.memfd_create(f"zephon-arena-{os.getpid()}-{i}", os.MFD_CLOEXEC)
                self._fds.append(fd)
                os.ftruncate(fd, _HEADER + self.reserve)  # sparse: pages exist once written
                self._maps.append(mmap.mmap(fd, _HEADER + self.reserve, flags=mmap.MAP_SHARED))
                r, w = os.pipe()
                os.set_blocking(w, False)
                self._free_r.append(r)
                self._free_w.append(w)
                self._put(i, _H_CAPACITY, int(capacity or 0))
        except BaseException:
            self.close()
            raise

    def _put(self, i: int, word: int, value: int) -> None:
        struct.pack_into("<q", self._maps[i], 8 * word, value)

    def _get(self, i: int, word: int) -> int:
        return struct.unpack_from("<q", self._maps[i], 8 * word)[0]

    def mapping(self, i: int) -> mmap.mmap:
        """The consumer's mapping of arena ``i``'s data area (for tests and metrics)."""
        return self._maps[i]

    def initargs(self, local: bool = False) -> tuple[Any, ...]:
        """The arguments of :func:`arena_worker_start` (descriptors travel to a worker process
        as duplicates; ``local``: duplicated here, for a "worker" in this process, as in tests)."""
        fd = os.dup if local else int
        return ([_Fd(fd(f)) for f in self._fds], [_Fd(fd(f)) for f in self._free_r], self.reserve)

    def set_in_flight(self, per_worker: int) -> None:
        """Tasks the pool may hold in flight per worker: the automatic budget's unit."""
        if self.closed:
            return
        for i in range(self.workers):
            self._put(i, _H_PER_WORKER, max(1, int(per_worker)))

    def unpack(self, msg: Any) -> Any:
        """A worker's reply -> the result as the function returned it (arrays are views of the
        arena; their space goes back when the last one dies). Anything else passes through."""
        if not isinstance(msg, Packed):
            return msg
        if self.closed:  # a task that finished after the pool closed: nobody waits for it
            raise RuntimeError(f"{self!r}: a result arrived after the pool was closed")
        if msg.arena < 0:
            with self._stat_lock:
                self.inband_results += 1
            return pickle.loads(msg.data)
        i, off, total = msg.arena, msg.offset, msg.total
        base = np.frombuffer(self._maps[i], np.uint8, total, _HEADER + off)
        with self._stat_lock:
            self.shm_results += 1
            self.shm_bytes += total
            self._live[i] += total
            self._peak = max(self._peak, sum(self._live))
        fin = weakref.finalize(base, self._free, i, off, total)
        fin.atexit = False
        try:
            return pickle.loads(msg.data, buffers=[base[s : s + n] for s, n in msg.spans])
        finally:
            del base

    def _free(self, i: int, off: int, total: int) -> None:
        # called by the garbage collector, in any thread, possibly while this thread is inside
        # another call of this method: no blocking lock here
        self._frees.append((i, off, total))
        self._flush()

    def _flush(self) -> None:
        while self._frees and self._flush_lock.acquire(blocking=False):
            try:
                while self._frees:
                    i, off, total = self._frees.popleft()
                    if self.closed:
                        continue
                    try:
                        os.write(self._free_w[i], _FREE.pack(off))
                    except BlockingIOError:  # the worker is not draining: retry on a later free
                        self._frees.appendleft((i, off, total))
                        return
                    except OSError:
                        continue
                    with self._stat_lock:
                        self._live[i] -= total
            finally:
                self._flush_lock.release()

    def metrics(self) -> dict[str, Any]:
        """Results through the arenas and in band, bytes, live and peak bytes (the consumer's
        view), pages the workers touched and handed back, and each arena's budget."""
        touched = released = fallbacks = 0
        budgets = []
        if not self.closed:
            for i in range(self.workers):
                touched += self._get(i, _H_TOUCHED)
                released += self._get(i, _H_RELEASED)
                fallbacks += self._get(i, _H_FALLBACK)
                budgets.append(self._get(i, _H_BUDGET))
        return {
            "shm_results": self.shm_results,
            "inband_results": self.inband_results,
            "shm_bytes": self.shm_bytes,
            "live_bytes": sum(self._live),
            "peak_live_bytes": self._peak,
            "touched_bytes": touched,
            "released_bytes": released,
            "full_fallbacks": fallbacks,
            "budget_bytes": max(budgets) if budgets else 0,  # the largest arena budget in force
            "reserve_bytes": self.reserve,
        }

    def close(self) -> None:
        """Drop the descriptors. Mappings stay until the last view of each is gone (a batch the
        training loop still holds remains valid); the kernel frees the memory then."""
        with self._flush_lock:
            if self.closed:
                return
            self.closed = True
            for fd in [*self._free_w, *self._free_r, *self._fds]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._free_w, self._free_r, self._fds = [], [], []
            # the mmap objects die with the last numpy view of each (closing one that has views
            # would raise); until then they hold the memory of the results still in use
            self._maps = []

    def __repr__(self) -> str:
        return f"ArenaSet({self.workers} arenas of {self.reserve >> 20} MiB{', closed' if self.closed else ''})"


# =========================================================================== worker side
class _WorkerArena:
    """The arena a worker process claimed: a first-fit allocator over its data area."""

    def __init__(self, index: int, fd: int, reserve: int, free_r: int) -> None:
        self.index, self.fd, self.reserve, self.free_r = index, fd, reserve, free_r
        self.mm = mmap.mmap(fd, _HEADER + reserve, flags=mmap.MAP_SHARED)
        os.set_blocking(free_r, False)
        self.offs: list[int] = []  # live allocations, sorted by offset
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.touched = 0  # end of the highest byte written since pages were last released
        self.released = 0
        self.biggest = 0
        self.fallbacks = 0
        self._partial = b""
        self._put(_H_PID, os.getpid())

    def _put(self, word: int, value: int) -> None:
        struct.pack_into("<q", self.mm, 8 * word, value)

    def _get(self, word: int) -> int:
        return struct.unpack_from("<q", self.mm, 8 * word)[0]

    def drain(self) -> None:
        """Take back the space of results the consumer is done with."""
        while True:
            try:
                data = os.read(self.free_r, 65536)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            data = self._partial + data
            n = len(data) // 8 * 8
            self._partial = data[n:]
            for (off,) in _FREE.iter_unpack(data[:n]):
                size = self.sizes.pop(off, None)
                if size is not None:
                    del self.offs[bisect.bisect_left(self.offs, off)]
                    self.live -= size

    def budget(self) -> int:
        fixed = self._get(_H_CAPACITY)
        if fixed > 0:
            return min(fixed, self.reserve)
        per_worker = max(1, self._get(_H_PER_WORKER))
        return min(self.reserve, max(_MIN_AUTO, ARENA_AUTO_FACTOR * per_worker * self.biggest))

    def alloc(self, n: int) -> int | None:
        """First fit from the lowest address (keeps the touched part small), within the budget."""
        self.drain()
        self.biggest = max(self.biggest, n)
        budget = self.budget()
        pos = 0
        for off in self.offs:
            if off - pos >= n:
                break
            pos = off + self.sizes[off]
        if pos + n > budget or self.live + n > budget:
            self.fallbacks += 1
            self._publish()
            return None
        bisect.insort(self.offs, pos)
        self.sizes[pos] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        self.touched = max(self.touched, pos + n)
        self._release_idle()
        self._publish()
        return pos

    def _release_idle(self) -> None:
        """Hand the pages above the highest live allocation back to the kernel once they are
        more than half of the touched area (after a burst, a steady pipeline keeps far less)."""
        top = self.offs[-1] + self.sizes[self.offs[-1]] if self.offs else 0
        start = -(-(_HEADER + top) // _PAGE) * _PAGE
        idle = _HEADER + self.touched - start
        if idle >= _RELEASE_MIN and idle > top:
            try:
                self.mm.madvise(mmap.MADV_REMOVE, start, -(-idle // _PAGE) * _PAGE)
            except (AttributeError, OSError, ValueError):
                return
            self.released += idle
            self.touched = start - _HEADER

    def _publish(self) -> None:
        self._put(_H_BUDGET, self.budget())
        self._put(_H_LIVE, self.live)
        self._put(_H_TOUCHED, self.touched)
        self._put(_H_PEAK, self.peak)
        self._put(_H_RELEASED, self.released)
        self._put(_H_FALLBACK, self.fallbacks)


_ARENA: _WorkerArena | None = None


def _reset_worker_arena() -> None:
    global _ARENA
    _ARENA = None


def _claim(arena_fds: list[Any], free_fds: list[Any], reserve: int) -> _WorkerArena | None:
    mine: tuple[int, int] | None = None
    try:
        for i, f in enumerate(arena_fds):
            # a private open file description, so that the lock is this process's alone
            # (duplicated descriptors share one lock)
            own = os.open(f"/proc/self/fd/{f.fd}", os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.flock(own, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another worker's
                os.close(own)
                continue
            mine = (i, own)
            break
        if mine is None:
            return None
        try:
            return _WorkerArena(mine[0], mine[1], reserve, free_fds[mine[0]].fd)
        except BaseException:
            _close(mine[1])
            _close(free_fds[mine[0]].fd)
            raise
    finally:
        keep = mine[0] if mine is not None else -1
        for f in arena_fds:
            _close(f.fd)
        for j, f in enumerate(free_fds):
            if j != keep:
                _close(f.fd)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def arena_worker_start(arena_fds: list[Any], free_fds: list[Any], reserve: int) -> None:
    """Worker-start step (run by the pool's initializer in each worker process): claim a free
    arena and map it. Never raises: a worker that cannot set one up pickles its results."""
    global _ARENA
    try:
        _ARENA = _claim(arena_fds, free_fds, reserve)
        if _ARENA is None:
            print("zephon: a process worker found no free result arena; its results are pickled", file=sys.stderr)
    except Exception as e:  # never let the initializer fail: the pool would report a dead worker
        _ARENA = None
        print(
            f"zephon: a process worker could not map its result arena ({type(e).__name__}: {e}); "
            "its results are pickled",
            file=sys.stderr,
        )


def _pack(obj: Any) -> Any:
    a = _ARENA
    if a is None:
        return obj
    bufs: list[memoryview] = []

    def out_of_band(pb: pickle.PickleBuffer) -> bool:
        try:
            m = pb.raw()
        except BufferError:  # not contiguous: in band
            return True
        if m.nbytes < ARENA_MIN_OOB:
            return True
        bufs.append(m)
        return False

    data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    if not bufs:
        return Packed(-1, 0, 0, (), data)
    spans = []
    pos = 0
    for m in bufs:
        spans.append((pos, m.nbytes))
        pos += -(-m.nbytes // _ALIGN) * _ALIGN
    off = a.alloc(pos)
    if off is None:  # no room: in band, never wait for the consumer
        return Packed(-1, 0, 0, (), pickle.dumps(obj, protocol=5))
    mm, base = a.mm, _HEADER + off
    for (s, n), m in zip(spans, bufs):
        mm[base + s : base + s + n] = m
    return Packed(a.index, off, pos, tuple(spans), data)


def run_packed(fn: Callable[..., Any], *args: Any) -> Any:
    """What a process pool with arenas runs: ``fn(*args)``, its result packed into this
    worker's arena (or returned as is where the worker has none)."""
    return _pack(fn(*args))
