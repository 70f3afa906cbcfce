"""A node-local cache of remote shard files, shared by every rank, worker and job of a node.

Why: without it every rank of a node reads its records from object storage by byte range, and
every job on the node does it again; a node that reads the same shards eight times pays eight
times the egress and the latency of a remote read per record. With ``$ZEPHON_SHARD_CACHE`` set to
a folder on local disk, a remote shard (``s3://``, ``gs://``, ``http(s)://``, any non-local
fsspec URL) is downloaded whole once into that folder and every read of the node comes from the
local copy (the per-read-unit CRC check of the index still applies).

How it stays correct when many processes share the folder:

* An entry is keyed by the object's URL, version (ETag, generation, ...) and size, so a changed
  object is a new entry; a stale copy is never read for a new version. Objects without a version
  are not cached.
* Each entry has a lock file (``locks/KEY.lock``, ``fcntl.flock``). A reader holds it shared while
  it reads; the downloader holds it exclusively (a second job waits, then reuses the copy).
* A download goes to a temporary file (its size reserved with ``posix_fallocate``), is fsynced and
  renamed into place: a crash never leaves a partial entry under a real name.
* The folder is kept under ``$ZEPHON_SHARD_CACHE_GB`` (default 32) by evicting the least
  recently used entries, under one folder-wide lock, and only entries whose lock nobody holds: a
  file another process is reading is never evicted.
* A folder that cannot be written (read-only, no space, over the cap with every entry in use)
  means direct remote reads, with one warning per process.

Download-ahead (:meth:`NodeCache.prefetch`): a lane's work source knows the shards of its next
records; those are downloaded by background threads, at most ``$ZEPHON_SHARD_AHEAD`` (default 4)
per process at a time. It never changes what is read, only when the bytes arrive.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

from .retry import env_number

__all__ = [
    "ENV_AHEAD",
    "ENV_DIR",
    "ENV_GB",
    "CacheWriteError",
    "NodeCache",
    "Sink",
    "entry_key",
    "node_cache",
]

ENV_DIR = "ZEPHON_SHARD_CACHE"
ENV_GB = "ZEPHON_SHARD_CACHE_GB"
ENV_AHEAD = "ZEPHON_SHARD_AHEAD"
_DEFAULT_GB = 32.0
_DEFAULT_AHEAD = 4
_HANDLES = 32  # entries a process keeps open for reading
_TOUCH_S = 1.0  # an entry's last-use time is refreshed at most this often per process


class CacheWriteError(Exception):
    """Writing the local copy failed (no space, read-only folder): read directly instead."""


@functools.lru_cache(maxsize=1 << 16)  # computed on every read of a remote shard
def entry_key(url: str, version: str, size: int) -> str:
    """The cache key of one version of an object.

    >>> entry_key("s3://b/a.jsonl", "ETag:1", 10) != entry_key("s3://b/a.jsonl", "ETag:2", 10)
    True
    """
    return hashlib.sha256(f"{url}\0{version}\0{size}".encode()).hexdigest()[:40]


class Sink:
    """Where a download writes: the temporary file of an entry (local write errors are
    :class:`CacheWriteError`, not storage faults to retry); ``reset()`` starts over (a retry)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.written = 0

    def write(self, b: bytes) -> None:
        """Append ``b`` to the copy (a local write error is a :class:`CacheWriteError`)."""
        try:
            self._f.write(b)
        except OSError as e:
            raise CacheWriteError(f"writing the local copy failed ({e})") from None
        self.written += len(b)

    def reset(self) -> None:
        """Start the copy over (a download retried from its first byte)."""
        self._f.seek(0)
        self.written = 0


class _HeldFile(io.FileIO):
    """A cached copy opened for reading; it holds the entry's shared lock until closed."""

    _lockfd: int = -1

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._lockfd >= 0:
                os.close(self._lockfd)
                self._lockfd = -1


class NodeCache:
    """The shard cache in folder ``root``, at most ``limit_bytes`` of entries, ``ahead`` downloads
    in the background at most. ``stats`` counts this process's work (downloads and their bytes,
    hits, waits for another process's download, evictions, fallbacks to direct reads)."""

    def __init__(self, root: str, limit_bytes: int, ahead: int = _DEFAULT_AHEAD) -> None:
        self.root = os.path.abspath(root)
        self.limit = int(limit_bytes)
        self.ahead = max(0, int(ahead))
        self._objects = os.path.join(self.root, "objects")
        self._locks = os.path.join(self.root, "locks")
        self._mu = threading.Lock()
        self._warned: set[str] = set()
        self._touched: dict[str, float] = {}
        self._inflight: dict[str, Future] = {}
        self._handles: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self.disabled: str | None = None
        self.stats = dict.fromkeys(
            (
                "downloads",
                "bytes_downloaded",
                "hits",
                "bytes_read",
                "waits",
                "evictions",
                "fallbacks",
                "ahead",
                "corrupt",
            ),
            0,
        )
        try:
            os.makedirs(self._objects, exist_ok=True)
            os.makedirs(self._locks, exist_ok=True)
            if not os.access(self._objects, os.W_OK) or not os.access(self._locks, os.W_OK):
                raise PermissionError(errno.EACCES, "the folder is not writable")
        except OSError as e:
            self._disable(f"cannot use the folder ({e})")

    def __repr__(self) -> str:
        return f"NodeCache({self.root!r}, limit={self.limit / 1e9:g} GB, ahead={self.ahead})"

    # -- bookkeeping -------------------------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` of :attr:`stats` (thread-safe)."""
        with self._mu:
            self.stats[name] += n

    def _warn(self, kind: str, reason: str) -> None:
        self.count("fallbacks")
        with self._mu:
            if kind in self._warned:
                return
            self._warned.add(kind)
        warnings.warn(
            f"zephon's shard cache {self.root!r}: {reason}; remote shards are read directly (slower). "
            f"Point ${ENV_DIR} at a writable local folder with room, or raise ${ENV_GB}.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        self._warn("disabled", reason)

    def takes(self, version: str, size: int) -> bool:
        """Whether an object of this version and size can be cached (a version is known, it fits)."""
        return self.disabled is None and bool(version) and 0 <= size <= self.limit

    def path(self, key: str) -> str:
        """Where entry ``key``'s copy lives."""
        return os.path.join(self._objects, key)

    # -- reading -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self, key: str, size: int, fetch: Callable[[Sink], None]) -> Iterator[str | None]:
        """The path of entry ``key``'s local copy, downloaded with ``fetch(sink)`` if it is not
        there, with the entry's shared lock held inside the block (no process evicts it
        meanwhile); None where the cache cannot take it (read directly)."""
        lockfd = self._acquire(key, size, fetch)
        if lockfd is None:
            yield None
            return
        try:
            yield self.path(key)
        finally:
            os.close(lockfd)

    def open(self, key: str, size: int, fetch: Callable[[Sink], None]) -> io.FileIO | None:
        """Entry ``key``'s copy opened for reading (its shared lock held until the file is
        closed), downloaded first if needed; None where the cache cannot take it."""
        lockfd = self._acquire(key, size, fetch)
        if lockfd is None:
            return None
        try:
            f = _HeldFile(self.path(key), "r")
        except BaseException:
            os.close(lockfd)
            raise
        f._lockfd = lockfd
        return f

    def read_ranges(
        self, key: str, size: int, fetch: Callable[[Sink], None], spans: list[tuple[int, int]]
    ) -> list[bytes] | None:
        """The byte ranges ``spans`` ([start, end) pairs) of entry ``key``'s copy, downloaded first
        if needed; None where the cache cannot take it. The hot path: the copy stays open in this
        process (at most ``_HANDLES`` entries), so a read is a shared lock, the preads, an unlock.
        (An entry evicted while this process has it open stays readable, and its disk space is
        freed when the handle is dropped: entries are immutable, so the bytes are the same.)"""
        h = self._handle(key, size, fetch)
        if h is None:
            return None
        lockfd, datafd = h
        fcntl.flock(lockfd, fcntl.LOCK_SH)  # not evicted while it is read
        try:
            out = [os.pread(datafd, e - o, o) for o, e in spans]
        finally:
            fcntl.flock(lockfd, fcntl.LOCK_UN)
        self.count("hits")
        self.count("bytes_read", sum(map(len, out)))
        return out

    def _handle(self, key: str, size: int, fetch: Callable[[Sink], None]) -> tuple[int, int] | None:
        with self._mu:
            h = self._handles.get(key)
            if h is not None:
                self._handles.move_to_end(key)
        if h is not None:
            self._touch(key, self.path(key))
            return h
        lockfd = self._acquire(key, size, fetch)
        if lockfd is None:
            return None
        try:
            datafd = os.open(self.path(key), os.O_RDONLY)
        except BaseException:
            os.close(lockfd)
            raise
        fcntl.flock(lockfd, fcntl.LOCK_UN)
        drop = []
        with self._mu:
            if key in self._handles:
                drop.append((lockfd, datafd))
                h = self._handles[key]
            else:
                h = self._handles[key] = (lockfd, datafd)
                while len(self._handles) > _HANDLES:
                    drop.append(self._handles.popitem(last=False)[1])
        for fds in drop:
            for fd in fds:
                os.close(fd)
        return h

    def close(self) -> None:
        """Drop this process's open copies (their disk space is freed if they were evicted)."""
        with self._mu:
            handles, self._handles = list(self._handles.values()), collections.OrderedDict()
        for fds in handles:
            for fd in fds:
                os.close(fd)

    def _lock_fd(self, key: str) -> int | None:
        try:
            return os.open(os.path.join(self._locks, key + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            self._disable(f"cannot create a lock file ({e})")
            return None

    def _acquire(self, key: str, size: int, fetch: Callable[[Sink], None]) -> int | None:
        """A lock fd holding entry ``key`` shared, the entry present; None: not cached."""
        if self.disabled is not None:
            return None
        fd = self._lock_fd(key)
        if fd is None:
            return None
        path = self.path(key)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # another process is downloading it: wait, then reuse
                    self.count("waits")
                    fcntl.flock(fd, fcntl.LOCK_SH)
                if os.path.exists(path):
                    self._touch(key, path)
                    self.count("hits")
                    return fd
                fcntl.flock(fd, fcntl.LOCK_UN)
                fcntl.flock(fd, fcntl.LOCK_EX)
                if not os.path.exists(path) and not self._download(key, size, fetch):
                    os.close(fd)
                    return None
                fcntl.flock(fd, fcntl.LOCK_UN)  # then shared, and check again (not atomic)
        except BaseException:
            os.close(fd)
            raise

    def _touch(self, key: str, path: str) -> None:
        now = time.time()
        if now - self._touched.get(key, 0.0) < _TOUCH_S:
            return
        self._touched[key] = now
        with contextlib.suppress(OSError):
            os.utime(path, (now, now))

    # -- writing -----------------------------------------------------------------------------
    def _download(self, key: str, size: int, fetch: Callable[[Sink], None]) -> bool:
        """Download entry ``key`` (its exclusive lock held); False: it cannot be cached."""
        tmp = os.path.join(self._objects, f".tmp-{key}-{os.getpid()}-{threading.get_ident()}")
        try:
            if not self._make_room(key, size, tmp):
                self._warn("full", f"no room for {size} bytes under the cap of {self.limit} bytes (entries in use)")
                return False
            with open(tmp, "r+b") as f:
                sink = Sink(f)
                fetch(sink)
                try:
                    f.truncate(sink.written)
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as e:
                    raise CacheWriteError(f"writing the local copy failed ({e})") from None
            os.rename(tmp, self.path(key))
            self._fsync_dir()
        except (CacheWriteError, OSError) as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                self._disable(f"the folder is not writable ({e})")
            else:
                self._warn("write", str(e))
            return False
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.count("downloads")
        self.count("bytes_downloaded", sink.written)
        return True

    def _fsync_dir(self) -> None:
        with contextlib.suppress(OSError):
            dfd = os.open(self._objects, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _make_room(self, key: str, size: int, tmp: str) -> bool:
        """Evict least recently used entries nobody holds until ``size`` more bytes fit under the
        cap, then reserve them (the temporary file ``tmp``, allocated), all under the folder lock."""
        gfd = os.open(os.path.join(self.root, "evict.lock"), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(gfd, fcntl.LOCK_EX)
            entries, total = self._entries()
            for _mtime, nbytes, name in sorted(entries):
                if total + size <= self.limit:
                    break
                if self._evict(name):
                    total -= nbytes
            if total + size > self.limit:
                return False
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if size > 0:
                    os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            return True
        finally:
            os.close(gfd)

    def _entries(self) -> tuple[list[tuple[float, int, str]], int]:
        """(last use, bytes, name) of every complete entry, and the bytes of all files (the
        reservations of downloads in progress included)."""
        entries, total = [], 0
        with os.scandir(self._objects) as it:
            for de in it:
                try:
                    st = de.stat()
                except OSError:
                    continue  # evicted or renamed meanwhile
                total += st.st_size
                if not de.name.startswith("."):
                    entries.append((st.st_mtime, st.st_size, de.name))
        return entries, total

    def _evict(self, name: str) -> bool:
        """Remove entry ``name`` unless a process holds it (reading or downloading)."""
        fd = self._lock_fd(name)
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            os.unlink(self.path(name))
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)  # lock files stay: unlinking one a waiter has open would split the lock
        self._touched.pop(name, None)
        self.count("evictions")
        return True

    def drop(self, key: str, what: str) -> None:
        """Drop entry ``key``, whose bytes are not the object's (a corrupt copy: ``what``), so the
        next read fetches it again; one warning per process."""
        with self._mu:
            fds = self._handles.pop(key, None)
        for fd in fds or ():
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))  # entries are immutable: a corrupt one serves nobody
        self._touched.pop(key, None)
        self.count("corrupt")
        with self._mu:
            first = "corrupt" not in self._warned
            self._warned.add("corrupt")
        if first:
            warnings.warn(
                f"zephon's shard cache {self.root!r}: the copy of {what} was corrupt (its bytes are not the ones "
                "indexed); it was dropped and fetched again. Check the disk of the cache folder",
                RuntimeWarning,
                stacklevel=3,
            )

    # -- download-ahead ----------------------------------------------------------------------
    def prefetch(self, key: str, warm: Callable[[], Any]) -> bool:
        """Run ``warm()`` (which downloads entry ``key``) on a background thread unless the
        entry is present, already on its way, or ``ahead`` downloads are in flight; errors are
        left to the read that needs the shard. Returns whether it was started."""
        if self.ahead <= 0 or self.disabled is not None or os.path.exists(self.path(key)):
            return False
        with self._mu:
            if key in self._inflight or len(self._inflight) >= self.ahead:
                return False
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.ahead, thread_name_prefix="zephon-ahead")
            fut = self._pool.submit(self._warm, key, warm)
            self._inflight[key] = fut
        self.count("ahead")
        return True

    def _warm(self, key: str, warm: Callable[[], Any]) -> None:
        try:
            warm()
        except Exception:  # the read that needs the shard raises it, with its context
            pass
        finally:
            with self._mu:
                self._inflight.pop(key, None)

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait for the downloads ahead in flight (tests and benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._mu:
                futs = list(self._inflight.values())
            if not futs or time.monotonic() > deadline:
                return
            for f in futs:
                with contextlib.suppress(Exception):
                    f.result(timeout=max(0.0, deadline - time.monotonic()))


_CACHES: dict[tuple[int, str, str, str], NodeCache] = {}
_CACHES_MU = threading.Lock()


def node_cache() -> NodeCache | None:
    """This process's shard cache as the environment sets it (``$ZEPHON_SHARD_CACHE``: the folder,
    unset or empty: no cache; ``$ZEPHON_SHARD_CACHE_GB``: the cap, default 32;
    ``$ZEPHON_SHARD_AHEAD``: downloads ahead, default 4, 0: none). One instance per process and
    setting (worker processes inherit the environment and share the folder)."""
    root = os.environ.get(ENV_DIR, "").strip()
    if not root:
        return None
    gb, ahead = os.environ.get(ENV_GB, ""), os.environ.get(ENV_AHEAD, "")
    k = (os.getpid(), root, gb, ahead)
    with _CACHES_MU:
        c = _CACHES.get(k)
        if c is None:
            limit = int(env_number(ENV_GB, _DEFAULT_GB) * 1e9)
            c = _CACHES[k] = NodeCache(root, limit, int(env_number(ENV_AHEAD, _DEFAULT_AHEAD)))
        return c
