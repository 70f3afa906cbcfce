"""Byte ranges of an image-text shard file, read checked: a local file is refused once it
changed since it was indexed (size, mtime), a remote one is read from its node-cache copy or by
byte range with retries. The base of the tar (:mod:`.wds`) and JSON Lines (:mod:`.mm_jsonl`)
readers of :class:`~.multimodal.MultimodalIndex`."""

from __future__ import annotations

import functools
import os
from typing import Any

from .errors import DataError
from .samples import ImageTextStore

__all__ = ["ShardBytes"]


class ShardBytes:
    """Reads of byte ranges of the shards of an image-text index ``ix``."""

    def __init__(self, ix: ImageTextStore) -> None:
        self.ix = ix

    def oversized(self, total: int, what: str = "record") -> str:
        """Why a record of ``total`` bytes above ``max_record_bytes`` is bad (it is never read)."""
        return (
            f"the {what} is {total} bytes, more than max_record_bytes = {self.ix.max_record_bytes} (the "
            f"per-record size limit); it was not read. Raise max_record_bytes for dataset '{self.ix.name}'"
        )

    def _open(self, s: int) -> Any:
        """Shard s's file (a remote shard's node-cache copy where the cache takes it)."""
        sp = self.ix._specs[s]
        f = self.ix._open_copy(s)
        if f is not None:
            return f
        try:
            return sp.fs.open(sp.fspath, "rb")
        except OSError as e:
            raise self.ix._err(
                s, f"cannot open the file ({type(e).__name__}: {e})", "Check the path and its permissions."
            ) from None

    def _io_error(self, s: int, e: OSError) -> DataError:
        return self.ix._err(
            s,
            f"I/O error while reading it ({type(e).__name__}: {e})",
            "Check that the storage is reachable and the file is intact, then retry.",
        )

    def _fetch(self, s: int, off: int, n: int) -> bytes:
        """One try at bytes ``off:off+n`` of remote shard s (transient faults raised as they are,
        for :meth:`ImageTextStore._retrying`)."""
        sp = self.ix._specs[s]
        try:
            return sp.fs.cat_file(sp.fspath, start=off, end=off + n)
        except OSError as e:
            if self.ix._transient(e):
                raise
            raise self._io_error(s, e) from None

    def _read_range(self, s: int, off: int, n: int) -> bytes:
        data = self._read_spans(s, [(off, n)])[0]
        if len(data) != n:
            raise self.ix._err(
                s,
                "the file is shorter than its index says (truncated or changed)",
                "Re-copy the shard, or restart so that it is re-indexed.",
            )
        return data

    def _read_spans(self, s: int, spans: list[tuple[int, int]]) -> list[bytes]:
        """The bytes ``(offset, length)`` of each of ``spans`` in shard s: a local file checked
        unchanged first, a remote one from its node-cache copy or by byte range."""
        sp = self.ix._specs[s]
        if not sp.local:
            copied = self.ix._copy_ranges(s, [(o, o + n) for o, n in spans])
            if copied is not None:
                return copied
            return [self.ix._retrying(s, "reading", functools.partial(self._fetch, s, o, n)) for o, n in spans]
        try:
            st = os.stat(sp.fspath)
            if st.st_size != sp.size or str(st.st_mtime_ns) != sp.version:
                raise self.ix._err(
                    s,
                    "the file changed since it was indexed",
                    "Do not modify shard files during a run; restart so that it is re-indexed.",
                )
            fd = os.open(sp.fspath, os.O_RDONLY)
            try:
                return [os.pread(fd, n, o) for o, n in spans]
            finally:
                os.close(fd)
        except OSError as e:
            raise self._io_error(s, e) from None
