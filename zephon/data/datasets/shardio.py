"""Reading a text shard's bytes: opening it, its decompressed stream, coalesced byte-range
reads, the identity check before each read of a local file, and OS errors mapped to
:class:`~zephon.data.datasets.errors.DataError` naming the file and how to fix it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from ._scan import CompressionError, iter_decompressed
from .cache import ShardStore
from .errors import DataError
from .resolve import ShardSpec

__all__ = ["ShardFiles"]

# read coalescing for plain (seekable) files: neighbouring records closer than _GAP bytes are
# fetched with one read, up to _MAX_SPAN bytes per read.
_GAP = 64 << 10
_MAX_SPAN = 8 << 20


class ShardFiles(ShardStore):
    """A text index as its format readers see it: the shard store plus byte access to the shard
    files (the base of :class:`~zephon.data.datasets.index.DatasetIndex`)."""

    text_field: str
    max_record_bytes: int
    #: an empty or whitespace-only text is data (a dataset's ``empty = "document"``), not a bad record
    empty_ok: bool = False
    _specs: list[ShardSpec]

    def _err(self, s: int, reason: str, fix: str, locator: str | None = None) -> DataError:
        return DataError(reason, dataset=self.name, file=self._specs[s].display, locator=locator, fix=fix)

    def _io_error(self, s: int, e: OSError, doing: str) -> DataError:
        disp = self._specs[s].display
        if isinstance(e, FileNotFoundError):
            return self._err(
                s,
                f"file not found while {doing} it",
                "Check that the file was not moved or deleted; re-run indexing if the dataset changed.",
            )
        if isinstance(e, PermissionError):
            return self._err(
                s,
                f"permission denied while {doing} it",
                "Make the file readable by the user running "
                f"the job (e.g. chmod a+r '{disp}'), or remove it from the dataset's path list in the recipe.",
            )
        if isinstance(e, IsADirectoryError):
            return self._err(s, "is a directory, not a file", "Use a glob that matches only data files.")
        return self._err(
            s,
            f"I/O error while {doing} it ({type(e).__name__}: {e})",
            "Check that the storage is reachable and the file is intact, then retry.",
        )

    def _changed_error(self, s: int) -> DataError:
        return self._err(
            s,
            "the file changed since it was indexed",
            "Do not modify shard files during a run; restart so that index_dataset re-indexes it.",
        )

    def _open(self, s: int, doing: str = "reading") -> Any:
        sp = self._specs[s]
        try:
            return open(sp.fspath, "rb") if sp.local else sp.fs.open(sp.fspath, "rb")
        except OSError as e:
            raise self._io_error(s, e, doing) from None

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
        f = self._open(s, doing)
        try:
            yield from iter_decompressed(f, sp.compression)
        except CompressionError as e:
            tool = "gzip -t" if sp.compression == "gzip" else "zstd -t"
            raise self._err(
                s,
                str(e),
                f"Re-download or regenerate the file (check it with `{tool}`), "
                "or remove it from the dataset's path list in the recipe.",
            ) from None
        except OSError as e:
            raise self._io_error(s, e, doing) from None
        finally:
            f.close()

    # -- indexing one shard ------------------------------------------------------------------

    def _blob(self, s: int) -> bytes:
        def load() -> bytes:
            self._check_unchanged_before_read(s)
            data = b"".join(self._stream(s, "reading"))
            return data

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
            try:
                fd = os.open(sp.fspath, os.O_RDONLY)
            except OSError as e:
                raise self._io_error(s, e, "reading") from None
            try:
                self._check_local_unchanged(s, os.fstat(fd))
                datas = [os.pread(fd, e - o, o) for o, e, _ in groups]
            except OSError as e:
                raise self._io_error(s, e, "reading") from None
            finally:
                os.close(fd)
        else:
            try:
                datas = sp.fs.cat_ranges([sp.fspath] * len(groups), [g[0] for g in groups], [g[1] for g in groups])
            except OSError as e:
                raise self._io_error(s, e, "reading") from None
            for d in datas:
                if isinstance(d, BaseException):
                    raise self._io_error(s, d if isinstance(d, OSError) else OSError(str(d)), "reading")
        for (o, end, ks), d in zip(groups, datas):
            if len(d) != end - o:
                raise self._changed_error(s)
            for k in ks:
                a = offs[k] - o
                out[k] = d[a : a + lens[k]]
        return out
