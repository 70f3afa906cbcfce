"""The object-storage tier of the token cache: the blocks of every node of a cluster, shared.

Why: a node's token cache (:mod:`.tokencache`) is a local folder, so each node of a cluster would
tokenize the corpus again. With ``$ZEPHON_TOKEN_CACHE_REMOTE`` set to an fsspec URL
(``s3://bucket/prefix``, ``gs://...``, a shared folder) a node that lacks entries of a block
fetches the versions of that block other nodes published and merges them into its folder, and
publishes the blocks it tokenized, so a cluster tokenizes a corpus once.

How it stays correct and off the critical path:

* An object never changes: a block's version is named ``<url>/blocks/<block>/<digest>``, the
  digest being the SHA-256 of its bytes (its entries in key order, so equal entries make one
  name). Two nodes publishing one block write two objects (or the same bytes under one name) and
  never tear one; a publisher deletes its own previous version once a superset is up. A reader
  merges the complete, checked entries of every version.
* What is fetched is checked before use: the bytes against the name's digest, then (by the local
  cache) every entry's block tag and CRC-32. What fails is counted and ignored: those documents
  are tokenized again, and the node's own version, published later, replaces it for the others.
* Publishing runs on a background thread: a block this process wrote is published once it has not
  grown for :data:`QUIET_S` seconds; the others when the cache is closed or the process ends, and
  ``zephon warm`` publishes what it warmed before it returns.
* Storage that fails (unreachable, refusing, timing out past :data:`TRY_S` seconds of retries)
  means the local cache alone for the rest of the process, with one warning: the batches never
  depend on the tier, only how many documents are tokenized.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import fsspec

from .retry import bound_retries, storage_options, with_retries

__all__ = ["ENV_REMOTE", "QUIET_S", "TRY_S", "RemoteTier", "version_of"]

ENV_REMOTE = "ZEPHON_TOKEN_CACHE_REMOTE"
#: a block this process wrote is published once it has not grown for this many seconds
QUIET_S = 10.0
#: seconds transient storage errors are retried before the tier is given up (local cache only)
TRY_S = 5.0
_RELIST_S = 60.0  # a block's versions are listed at most this often per process
_NAMES_KEPT = 1 << 14  # blocks whose listing this process remembers


def version_of(data: bytes) -> str:
    """The name of a block version: the SHA-256 of its bytes (40 hex digits)."""
    return hashlib.sha256(data).hexdigest()[:40]


class _FailedError(Exception):
    """The tier's storage kept failing (the reason is the message)."""


class RemoteTier:
    """The blocks under ``url``, as one process of a node uses them. ``pack(path, tag)``: the bytes
    to publish of a local block (None: nothing valid); ``count(name, n)``: adds to the cache's
    stats; ``warn(reason)``: the cache's one warning for a tier given up."""

    def __init__(
        self,
        url: str,
        pack: Callable[[str, bytes], bytes | None],
        count: Callable[[str, int], None],
        warn: Callable[[str], None],
    ) -> None:
        self.url = url.rstrip("/")
        self.failed: str | None = None
        self._pack, self._count, self._warn = pack, count, warn
        self._fs: Any = None
        self._mu = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._listed: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._seen: dict[str, set[str]] = {}  # block -> versions fetched, refused or published here
        self._mine: dict[str, str] = {}  # block -> the version this process published last
        self._dirty: dict[str, tuple[str, bytes, float]] = {}  # block -> (path, tag, last write)
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"

    # -- storage ---------------------------------------------------------------------------------
    def _io(self, fn: Callable[[], Any], doing: str) -> Any:
        """``fn()`` with transient faults retried for :data:`TRY_S`; a failure gives the tier up."""
        if self.failed is not None:
            raise _FailedError(self.failed)
        try:
            if self._fs is None:
                fs, _ = fsspec.core.url_to_fs(self.url, **storage_options(self.url))
                bound_retries(fs)
                self._fs = fs
            return with_retries(fn, lambda why: _FailedError(f"{doing} failed: {why}"), TRY_S)
        except FileNotFoundError:
            raise
        except Exception as e:  # any failure of an optional tier: the local cache alone
            why = str(e) if isinstance(e, _FailedError) else f"{doing} failed ({type(e).__name__}: {e})"
            with self._mu:
                first, self.failed = self.failed is None, self.failed or why
            if first:
                self._warn(why)
            raise _FailedError(why) from None

    def _dir(self, name: str) -> str:
        return f"{self.url}/blocks/{name}"

    def _versions(self, name: str) -> list[str]:
        def ls() -> list[str]:
            self._fs.invalidate_cache(self._dir(name))
            try:
                return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in self._fs.ls(self._dir(name), detail=False)]
            except FileNotFoundError:
                return []

        return sorted(self._io(ls, f"listing {self._dir(name)}"))

    def _lock(self, name: str) -> threading.Lock:
        with self._mu:
            if len(self._locks) > _NAMES_KEPT:
                self._locks = {k: v for k, v in self._locks.items() if v.locked()}
            return self._locks.setdefault(name, threading.Lock())

    # -- reading ---------------------------------------------------------------------------------
    def fetch_new(self, name: str, merge: Callable[[bytes], None]) -> None:
        """``merge(data)`` for each version of block ``name`` not fetched before whose bytes match
        its name, under the block's lock (a thread that waits for it then finds the entries merged);
        at most one listing per :data:`_RELIST_S` per block, none once the tier failed. A version
        that does not match its name is counted (``remote_corrupt``) and ignored (looked at again at
        the next listing)."""
        if self.failed is not None:
            return
        with self._lock(name):
            now = time.monotonic()
            with self._mu:
                if now - self._listed.get(name, -_RELIST_S) < _RELIST_S:
                    return
                self._listed[name] = now
                self._listed.move_to_end(name)
                while len(self._listed) > _NAMES_KEPT:
                    self._seen.pop(self._listed.popitem(last=False)[0], None)
            try:
                seen = self._seen.setdefault(name, set())
                for v in self._versions(name):
                    if v in seen:
                        continue
                    try:
                        target = f"{self._dir(name)}/{v}"
                        data = self._io(functools.partial(self._fs.cat_file, target), f"reading {target}")
                    except FileNotFoundError:  # replaced by its publisher since the listing
                        continue
                    self._count("remote_bytes", len(data))
                    if version_of(data) != v:  # corrupt, or still being written to a non-atomic store
                        self._count("remote_corrupt", 1)
                        continue
                    seen.add(v)
                    merge(data)
            except _FailedError:
                pass

    # -- publishing ------------------------------------------------------------------------------
    def wrote(self, name: str, path: str, tag: bytes) -> None:
        """Note that this process appended entries to block ``name`` (file ``path``): it is
        published once quiet for :data:`QUIET_S` seconds, or at :meth:`publish`."""
        if self.failed is not None:
            return
        with self._mu:
            self._dirty[name] = (path, tag, time.monotonic())
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="zephon-token-publish", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while self.failed is None:
            time.sleep(min(1.0, QUIET_S / 4))
            now = time.monotonic()
            with self._mu:
                quiet = [n for n, (_, _, t) in self._dirty.items() if now - t >= QUIET_S]
            self.publish(quiet)

    def publish(self, names: Iterable[str] | None = None, paths: Iterable[str] | None = None) -> int:
        """Publish now the blocks this process wrote since their last publication (``names`` or
        ``paths`` of them; default all); returns how many objects were written."""
        with self._mu:
            want = set(self._dirty) if names is None else set(names)
            if paths is not None:
                keep = set(paths)
                want = {n for n in want if self._dirty.get(n, ("",))[0] in keep}
            todo = [(n, self._dirty[n]) for n in sorted(want) if n in self._dirty]
        done = 0
        for name, (path, tag, t) in todo:
            if self.failed is not None:
                break
            with self._lock(name):
                with self._mu:
                    if self._dirty.get(name, ("", b"", -1.0))[2] == t:
                        del self._dirty[name]  # written again since: stays dirty
                with contextlib.suppress(_FailedError):
                    done += self._publish_one(name, path, tag)
        return done

    def _publish_one(self, name: str, path: str, tag: bytes) -> int:
        data = self._pack(path, tag)
        if not data:
            return 0
        v = version_of(data)
        seen = self._seen.setdefault(name, set())
        if v in seen:  # these very bytes are up already (ours, or another node's)
            return 0
        target = f"{self._dir(name)}/{v}"

        def put() -> None:
            try:
                self._fs.pipe_file(target, data)
            except FileNotFoundError:  # a file system with folders (a shared folder): make it first
                self._fs.makedirs(self._dir(name), exist_ok=True)
                self._fs.pipe_file(target, data)

        self._io(put, f"writing {target}")
        seen.add(v)
        self._count("published", 1)
        self._count("bytes_published", len(data))
        old = self._mine.get(name)
        self._mine[name] = v
        if old is not None and old != v:  # our previous version: its entries are in this one (unless evicted here)
            with contextlib.suppress(_FailedError, FileNotFoundError):
                self._io(lambda: self._fs.rm_file(f"{self._dir(name)}/{old}"), f"removing {name}/{old}")
        return 1
