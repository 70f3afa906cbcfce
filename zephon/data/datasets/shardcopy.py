"""Remote shards read from their copy in the node-local shard cache (:mod:`.nodecache`): the part
every index kind shares (text shards, :mod:`.shardio`; image-text shards, :mod:`.samples`;
pretokenized files, :mod:`.tokens`), so the three read the cache one way.

A remote shard (``s3://``, ``http(s)://``, any non-local fsspec URL) whose object has a version
is downloaded whole once into ``$ZEPHON_SHARD_CACHE``, keyed by URL, version and size (a changed
object is a new entry), checked after the download to be still the version indexed (a copy is
never kept under a version it is not), and read from the local copy. A read unit whose CRC-32 is
not the indexed one drops the copy, which is fetched again (:meth:`NodeCopies._intact`; one
warning per process). Objects without a version, or larger than the cache, are read directly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from .errors import DataError
from .nodecache import NodeCache, Sink, entry_key, node_cache
from .resolve import ShardSpec, stat_spec
from .retry import retried_io, transient

__all__ = ["CopiedFiles", "NodeCopies", "ShortBodyError", "copy_cache", "download", "io_error", "open_remote"]

T = TypeVar("T")
#: ``fail(what, fix)``: the DataError of a shard's file (as :func:`~.retry.retried_io` takes it)
Fail = Callable[[str, str], DataError]


class ShortBodyError(ConnectionError):
    """A remote object's body was shorter or longer than the object's size (a well-formed answer
    that is not the whole object): retried as a transient fault, then refused naming the URL."""


def io_error(fail: Fail, display: str, e: OSError, doing: str) -> DataError:
    """The DataError of an OS or storage error ``e`` met while ``doing`` a shard's file, saying
    how to fix it."""
    if isinstance(e, FileNotFoundError):
        return fail(
            f"file not found while {doing} it",
            "Check that the file was not moved or deleted; re-run indexing if the dataset changed.",
        )
    if isinstance(e, PermissionError):
        return fail(
            f"permission denied while {doing} it",
            "Make the file readable by the user running "
            f"the job (e.g. chmod a+r '{display}'), or remove it from the dataset's path list in the recipe.",
        )
    if isinstance(e, IsADirectoryError):
        return fail("is a directory, not a file", "Use a glob that matches only data files.")
    return fail(
        f"I/O error while {doing} it ({type(e).__name__}: {e})",
        "Check that the storage is reachable and the file is intact, then retry.",
    )


def copy_cache(sp: ShardSpec) -> NodeCache | None:
    """The node cache that takes remote file ``sp`` (None: a local file, no cache set, an
    object without a version, or one larger than the cache: read it directly)."""
    if sp.local:
        return None
    cache = node_cache()
    return cache if cache is not None and cache.takes(sp.version, sp.size) else None


def open_remote(sp: ShardSpec, fail: Fail, doing: str = "reading", stream: bool = False) -> Any:
    """Remote file ``sp`` opened through fsspec; ``stream``: read once from the start (over
    HTTP: one plain GET, no Range requests). Transient faults are raised as they are."""
    try:
        if stream and "http" in sp.fs.protocol:
            return sp.fs.open(sp.fspath, "rb", block_size=0, size=sp.size if sp.size > 0 else None)
        return sp.fs.open(sp.fspath, "rb")
    except OSError as e:
        if transient(e):
            raise
        raise io_error(fail, sp.display, e, doing) from None


def download(sp: ShardSpec, sink: Sink, fail: Fail, changed: Callable[[str], DataError]) -> None:
    """Remote file ``sp``'s whole object into ``sink`` (transient faults retried from the start),
    then refused with ``changed(what)`` unless the object is still the version indexed (checked
    after the download: a copy is never kept under a version it is not)."""

    def once() -> None:
        sink.reset()
        f = open_remote(sp, fail, "downloading", stream=True)
        try:
            while chunk := f.read(8 << 20):
                sink.write(chunk)
            if sp.size > 0 and sink.written != sp.size:  # a well-formed answer that is not the object
                raise ShortBodyError(f"the body was {sink.written} bytes, not the object's {sp.size}")
        except OSError as e:
            if transient(e):
                raise
            raise io_error(fail, sp.display, e, "downloading") from None
        finally:
            f.close()

    retried_io(once, "downloading", fail)
    sp.fs.invalidate_cache(sp.fspath)  # the listing cache would answer with the old version
    size, version = retried_io(lambda: stat_spec(sp), "checking the version of", fail)
    if (size, version) != (sp.size, sp.version) or sink.written != sp.size:
        raise changed(f"the object changed since it was indexed (now {version or 'unknown'})")


class NodeCopies:
    """An index's remote shards (``_specs``) read from their copies in the node cache: the base
    that text (:class:`~.shardio.ShardFiles`) and image-text
    (:class:`~.samples.ImageTextStore`) indexes share. A subclass gives ``_changed_error``."""

    name: str
    _specs: list[ShardSpec]

    def _err(self, s: int, reason: str, fix: str, locator: str | None = None) -> DataError:
        return DataError(reason, dataset=self.name, file=self._specs[s].display, locator=locator, fix=fix)

    def _changed_error(self, s: int, locator: str | None = None, what: str | None = None) -> DataError:
        raise NotImplementedError

    def _io_error(self, s: int, e: OSError, doing: str) -> DataError:
        return io_error(functools.partial(self._err, s), self._specs[s].display, e, doing)

    def _node_cache(self, s: int) -> NodeCache | None:
        """The shard cache that takes remote shard s (None: read it directly)."""
        return copy_cache(self._specs[s])

    def _key(self, s: int) -> str:
        sp = self._specs[s]
        return entry_key(sp.url, sp.version, sp.size)

    def _download(self, s: int, sink: Sink) -> None:
        """Shard s's whole object into ``sink`` (:func:`download`)."""
        download(self._specs[s], sink, functools.partial(self._err, s), lambda what: self._changed_error(s, what=what))

    @contextlib.contextmanager
    def _local_copy(self, s: int) -> Iterator[str | None]:
        """The path of remote shard s's copy in the node cache, held (not evicted) inside the
        block; None for a local shard or where the cache does not take it."""
        cache = self._node_cache(s)
        if cache is None:
            yield None
            return
        with cache.hold(self._key(s), self._specs[s].size, functools.partial(self._download, s)) as p:
            yield p

    def _open_copy(self, s: int) -> Any:
        """Remote shard s's copy opened for reading (held until closed), downloaded first if
        needed; None where the cache does not take it."""
        cache = self._node_cache(s)
        if cache is None:
            return None
        size = self._specs[s].size
        f = cache.open(self._key(s), size, functools.partial(self._download, s))
        if f is not None:
            cache.count("bytes_read", size)
        return f

    def _copy_ranges(self, s: int, spans: list[tuple[int, int]]) -> list[bytes] | None:
        """The byte ranges ``spans`` ([start, end) pairs) of remote shard s's copy (the hot path:
        the copy stays open); None where the cache does not take it."""
        cache = self._node_cache(s)
        if cache is None:
            return None
        return cache.read_ranges(self._key(s), self._specs[s].size, functools.partial(self._download, s), spans)

    def prefetch(self, shards: Iterable[int]) -> int:
        """Download ``shards`` into the node cache in the background (download-ahead; at most
        ``$ZEPHON_SHARD_AHEAD`` at a time): how many were started. Reads are unchanged."""
        started = 0
        for s in dict.fromkeys(int(x) for x in shards):
            cache = self._node_cache(s)
            if cache is not None:
                started += cache.prefetch(self._key(s), functools.partial(self._warm, s))
        return started

    def _warm(self, s: int) -> None:
        with self._local_copy(s):
            pass

    def _intact(self, s: int, read: Callable[[], T], ok: Callable[[T], bool]) -> T:
        """``read()`` of shard s; where ``ok`` refuses what it read (its CRC-32s are not the
        indexed ones) and the bytes came from the node cache, the copy is dropped (one warning)
        and read once more from a fresh download. The caller checks the result again."""
        got = read()
        if ok(got):
            return got
        cache = self._node_cache(s)
        if cache is None:
            return got
        cache.drop(self._key(s), self._specs[s].url)
        return read()


class CopiedFiles(NodeCopies):
    """Remote files that are read from their node-cache copies only (pretokenized files are
    memory-mapped, so they need a local copy): ``specs``, errors naming dataset ``name``."""

    def __init__(self, name: str, specs: list[ShardSpec]) -> None:
        self.name, self._specs = name, specs

    def _changed_error(self, s: int, locator: str | None = None, what: str | None = None) -> DataError:
        return self._err(
            s,
            what or "the file changed since it was indexed",
            "Do not modify or replace the dataset's files during a run; if they were replaced on purpose, restart "
            "so that the dataset is indexed again (a checkpoint taken on the old content cannot resume on the new).",
            locator,
        )

    def _refused(self, s: int) -> DataError:
        sp, cache = self._specs[s], node_cache()
        if cache is None:
            why = "no node shard cache is set"
        elif not sp.version:
            why = "the storage reports no version (ETag, modification time) for it, so no copy can be keyed"
        elif cache.disabled is not None:
            why = f"the node shard cache {cache.root!r} cannot be used ({cache.disabled})"
        else:
            why = f"the node shard cache {cache.root!r} has no room for its {sp.size} bytes"
        return self._err(
            s,
            f"pretokenized files are memory-mapped from a local copy, and {why}",
            "Set $ZEPHON_SHARD_CACHE to a local folder with room (each remote file is downloaded there once "
            "per node; raise $ZEPHON_SHARD_CACHE_GB if it is full), or copy the files to a local disk.",
        )

    @contextlib.contextmanager
    def held(self, s: int) -> Iterator[str]:
        """The path of file s's local copy, downloaded first if needed, not evicted inside the block."""
        with self._local_copy(s) as p:
            if p is None:
                raise self._refused(s)
            yield p

    def opened(self, s: int) -> Any:
        """File s's local copy opened for reading (not evicted until it is closed)."""
        f = self._open_copy(s)
        if f is None:
            raise self._refused(s)
        return f

    @classmethod
    def stat(cls, name: str, fs: Any, paths: list[str]) -> CopiedFiles:
        """The remote files ``paths`` of ``fs`` with their size and version now (transient
        faults retried); a missing one is a DataError naming it."""
        specs = []
        for p in paths:
            url = fs.unstrip_protocol(p)
            sp = ShardSpec(fs, p, url, url, False, None, -1, "")

            def fail(what: str, fix: str, url: str = url) -> DataError:
                return DataError(what, dataset=name, file=url, fix=fix)

            try:
                sp.size, sp.version = retried_io(functools.partial(stat_spec, sp), "checking", fail)
            except FileNotFoundError:
                raise fail(
                    "missing",
                    "Every NAME.npy / NAME.bin needs NAME.offsets.npy beside it (format tokens), every Megatron "
                    "NAME.bin its NAME.idx (format megatron).",
                ) from None
            specs.append(sp)
        return cls(name, specs)
