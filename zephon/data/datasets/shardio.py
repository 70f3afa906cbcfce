"""Reading a text shard's bytes: opening it, its decompressed stream, coalesced byte-range
reads, the identity check before each read of a local file, remote faults retried within a
bounded time (:mod:`.retry`), and OS and storage errors mapped to
:class:`~zephon.data.datasets.errors.DataError` naming the file and how to fix it.

Size and modification time are not identity (a file rewritten in place can keep both, a server
may send neither): the readers keep a CRC-32 of every read unit in the index (a record's bytes,
a row group's text column) and :meth:`ShardFiles._verify` checks it on every read.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from ._scan import CompressionError, iter_decompressed
from .cache import ShardStore
from .errors import DataError
from .resolve import ShardSpec
from .retry import RangeIgnoredError, retried_io, transient
from .shardcopy import NodeCopies, ShortBodyError, open_remote

__all__ = ["ShardFiles", "ShortBodyError"]

T = TypeVar("T")

# read coalescing for plain (seekable) files: neighbouring records closer than _GAP bytes are
# fetched with one read, up to _MAX_SPAN bytes per read.
_GAP = 64 << 10
_MAX_SPAN = 8 << 20


class ShardFiles(NodeCopies, ShardStore):
    """A text index as its format readers see it: the shard store plus byte access to the shard
    files (the base of :class:`~zephon.data.datasets.index.DatasetIndex`)."""

    text_field: str
    max_record_bytes: int
    #: an empty or whitespace-only text is data (a dataset's ``empty = "document"``), not a bad record
    empty_ok: bool = False
    _specs: list[ShardSpec]

    def _cache_path(self, s: int) -> str | None:
        """Where shard s's metadata is cached (None: it is not; the index kinds say where)."""
        return None

    def _changed_error(self, s: int, locator: str | None = None, what: str | None = None) -> DataError:
        cache = self._cache_path(s)
        again = (
            f"if it was replaced on purpose, delete its index cache '{cache}' and restart (a checkpoint taken on "
            "the old content cannot resume on the new)"
            if cache
            else "restart so that the dataset is indexed again"
        )
        return self._err(
            s,
            what or "the file changed since it was indexed",
            f"Do not modify or replace shard files during a run; {again}.",
            locator,
        )

    def _range_error(self, s: int, detail: str) -> DataError:
        return self._err(
            s,
            f"the server ignores HTTP Range requests ({detail}); zephon reads records by byte range",
            "Serve the files from a server that supports Range requests (most object stores and web servers "
            "do; Python's http.server does not), or copy the dataset to local disk.",
        )

    def _retrying(self, s: int, doing: str, fn: Callable[[], T]) -> T:
        """``fn()`` (an operation on shard s's file); for a remote file, transient faults (5xx,
        dropped connections, stalls) are retried with backoff inside ``$ZEPHON_IO_RETRY_S``, then
        raised as a DataError naming the URL; other HTTP errors are DataErrors at once."""
        if self._specs[s].local:
            return fn()

        def translate(e: Exception) -> None:
            if isinstance(e, RangeIgnoredError):
                raise self._range_error(s, str(e)) from None
            if isinstance(e, ValueError) and "range requests" in str(e):  # fsspec's HTTPFile without Range
                raise self._range_error(s, "it answered a request for a block with the whole file") from None

        return retried_io(fn, doing, lambda what, fix: self._err(s, what, fix), translate)

    def _cat(self, s: int) -> bytes:
        """Remote shard s's whole bytes (from the node cache where it takes it)."""
        sp = self._specs[s]
        with self._local_copy(s) as copy:
            if copy is not None:
                with open(copy, "rb") as f:
                    return f.read()
        return self._retrying(s, "reading", lambda: sp.fs.cat_file(sp.fspath))

    def _open(self, s: int, doing: str = "reading", stream: bool = False, cached: bool = True) -> Any:
        """Shard s's file; ``stream``: read once from the start (over HTTP: one plain GET, no
        Range requests). A remote shard comes from the node cache where it takes it."""
        sp = self._specs[s]
        f = self._open_copy(s) if cached else None
        if f is not None:
            return f
        if not sp.local:
            return open_remote(sp, functools.partial(self._err, s), doing, stream)
        try:
            return open(sp.fspath, "rb")
        except OSError as e:
            raise self._io_error(s, e, doing) from None

    def _verified_ranges(
        self, s: int, offs: list[int], lens: list[int], crcs: np.ndarray, locator: Callable[[int], str]
    ) -> list[bytes]:
        """:meth:`_read_ranges`, checked against the indexed CRC-32s: bytes from a corrupt copy in
        the node cache drop the copy and are fetched again (one warning); then :meth:`_verify`."""
        want = crcs.tolist()
        checked: list[Any] = [None, None]  # the bytes ``ok`` checked and their CRC-32s (checksummed once)

        def ok(got: list[bytes]) -> bool:
            checked[:] = [got, list(map(zlib.crc32, got))]
            return checked[1] == want

        raws = self._intact(s, lambda: self._read_ranges(s, offs, lens), ok)
        self._verify(s, raws, crcs, locator, checked[1] if checked[0] is raws else None)  # a re-read: again
        return raws

    def _verify(
        self,
        s: int,
        raws: Sequence[bytes],
        crcs: np.ndarray,
        locator: Callable[[int], str],
        got: list[int] | None = None,
    ) -> None:
        """Refuse read units whose bytes are not the ones indexed (``crcs``: their CRC-32s;
        ``got``: the CRC-32s of ``raws`` when computed already); ``locator(k)`` names the k-th."""
        if got is None:
            got = list(map(zlib.crc32, raws))
        want = crcs.tolist()
        if got != want:
            bad = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
            raise self._changed_error(
                s,
                locator(bad),
                "the bytes read are not the ones indexed: the file changed since it was indexed (its size and "
                "modification time may be unchanged, or the index cache is stale)",
            )

    def _check_unchanged_before_read(self, s: int) -> None:
        """Local shards: refuse to read a file that changed since it was indexed."""
        sp = self._specs[s]
        if sp.local:
            try:
                self._check_local_unchanged(s, os.stat(sp.fspath))
            except OSError as e:
                raise self._io_error(s, e, "reading") from None

    def _check_local_unchanged(self, s: int, st: os.stat_result) -> None:
        m = self.shards[s]
        if st.st_size != m.size_bytes or str(st.st_mtime_ns) != m.version:
            raise self._changed_error(s)

    def _stream(self, s: int, doing: str) -> Iterator[bytes]:
        """Decompressed chunks of shard s, with errors mapped to DataError."""
        sp = self._specs[s]
        f = self._open(s, doing, stream=True)
        if not sp.local and sp.size > 0:
            f = _SizedBody(f, sp.size)
        try:
            yield from iter_decompressed(f, sp.compression)
            if isinstance(f, _SizedBody):
                f.check()
        except CompressionError as e:
            tool = "gzip -t" if sp.compression == "gzip" else "zstd -t"
            raise self._err(
                s,
                str(e),
                f"Re-download or regenerate the file (check it with `{tool}`), "
                "or remove it from the dataset's path list in the recipe.",
            ) from None
        except OSError as e:
            if transient(e):
                raise
            raise self._io_error(s, e, doing) from None
        finally:
            f.close()

    # -- indexing one shard ------------------------------------------------------------------

    def _blob(self, s: int) -> bytes:
        def load() -> bytes:
            self._check_unchanged_before_read(s)
            return self._retrying(s, "reading", lambda: b"".join(self._stream(s, "reading")))

        return self._caches["blobs"].get(s, load)

    def _read_ranges(self, s: int, offs: list[int], lens: list[int]) -> list[bytes]:
        sp = self._specs[s]
        if sp.compression:
            blob = self._blob(s)
            return [blob[o : o + n] for o, n in zip(offs, lens)]
        # coalesce neighbouring records into few reads
        order = sorted(range(len(offs)), key=offs.__getitem__)
        groups: list[list] = []
        for k in order:
            o, e = offs[k], offs[k] + lens[k]
            if groups and o - groups[-1][1] <= _GAP and e - groups[-1][0] <= _MAX_SPAN:
                g = groups[-1]
                g[1] = max(g[1], e)
                g[2].append(k)
            else:
                groups.append([o, e, [k]])
        out: list[bytes] = [b""] * len(offs)
        if sp.local:
            datas = self._pread(s, sp.fspath, groups, check=True)
        else:
            # the CRCs the readers check still guard bytes from the node cache
            copied = self._copy_ranges(s, [(g[0], g[1]) for g in groups])
            if copied is not None:
                datas = copied
            else:
                datas = self._retrying(s, "reading", lambda: self._fetch_ranges(s, groups))
        for (o, end, ks), d in zip(groups, datas):
            if len(d) != end - o:
                raise self._changed_error(s)
            for k in ks:
                a = offs[k] - o
                out[k] = d[a : a + lens[k]]
        return out

    def _pread(self, s: int, path: str, groups: list[list], check: bool) -> list[bytes]:
        """The byte ranges ``groups`` of the local file ``path`` (shard s or its cached copy;
        ``check``: refuse it if it changed since indexing)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise self._io_error(s, e, "reading") from None
        try:
            if check:
                self._check_local_unchanged(s, os.fstat(fd))
            return [os.pread(fd, e - o, o) for o, e, _ in groups]
        except OSError as e:
            raise self._io_error(s, e, "reading") from None
        finally:
            os.close(fd)

    def _fetch_ranges(self, s: int, groups: list[list]) -> list[bytes]:
        """One try at the byte ranges ``groups`` of remote shard s (errors raised as they are,
        for :meth:`_retrying`; a whole-file answer to a range request as RangeIgnoredError)."""
        sp = self._specs[s]
        try:
            datas = sp.fs.cat_ranges([sp.fspath] * len(groups), [g[0] for g in groups], [g[1] for g in groups])
        except OSError as e:
            if transient(e):
                raise
            raise self._io_error(s, e, "reading") from None
        for (o, end, _), d in zip(groups, datas):
            if isinstance(d, BaseException):
                if isinstance(d, OSError) and not transient(d):
                    raise self._io_error(s, d, "reading")
                raise d
            if len(d) > end - o:
                raise RangeIgnoredError(f"it answered a request for bytes {o}..{end - 1} with {len(d)} bytes")
        return datas


class _SizedBody:
    """A stream of a remote object that counts its bytes, to refuse a body of the wrong size."""

    def __init__(self, f: Any, size: int) -> None:
        self.f, self.size, self.n = f, size, 0

    def read(self, k: int = -1) -> bytes:
        """Up to ``k`` bytes of the body, counted."""
        b = self.f.read(k)
        self.n += len(b)
        return b

    def check(self) -> None:
        """Raise :class:`ShortBodyError` unless the whole body was the object's size."""
        if self.n != self.size:
            what = "short" if self.n < self.size else "long"
            raise ShortBodyError(f"the body was {self.n} bytes, not the object's {self.size} (a {what} answer)")

    def close(self) -> None:
        """Close the underlying stream."""
        self.f.close()
