"""Arrow IPC shards (format ``"arrow"``: ``.arrow`` files and Hugging Face ``save_to_disk``
folders), and what every columnar reader shares (:class:`ColumnReader`: the text column's
checks and the checks of each value read).

A local shard is memory-mapped (one text column cached per shard); a stream must end with its
end-of-stream marker, so a file cut at a message boundary is refused instead of read short.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np

from .errors import BadRecord, DataError
from .text import Reader, check_text, utf8_reason

__all__ = ["ArrowReader", "ColumnDigest", "ColumnReader", "column_crc", "is_text_type"]

#: an Arrow IPC stream ends with this end-of-stream marker (continuation token, length 0); a file
#: cut at a message boundary reads as a shorter valid stream without it
_ARROW_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def is_text_type(t: Any) -> bool:
    """Whether an Arrow type can hold a text column (string or binary, any width or view)."""
    import pyarrow as pa

    checks = [pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary]
    for name in ("is_string_view", "is_binary_view"):
        if hasattr(pa.types, name):
            checks.append(getattr(pa.types, name))
    return any(c(t) for c in checks)


class ColumnDigest:
    """CRC-32 of a text column's values (their bytes, their lengths, which are null), fed in
    chunks or record batches: the same however the column is split.

    >>> import pyarrow as pa
    >>> split = ColumnDigest().update(pa.array(["ab"])).update(pa.array([None, "c"])).value
    >>> split == column_crc(pa.chunked_array([["ab", None], ["c"]])), split == column_crc(pa.array(["ab", "", "c"]))
    (True, False)
    """

    def __init__(self) -> None:
        self._data = self._lens = self._nulls = 0

    def update(self, col: Any) -> ColumnDigest:
        """Add the next values (an Arrow array or chunked array); returns self."""
        import pyarrow as pa

        for ch in col.chunks if isinstance(col, pa.ChunkedArray) else [col]:
            if len(ch) == 0:
                continue
            t = ch.type
            flat = pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t)
            if not (flat or pa.types.is_large_binary(t)):
                ch = ch.cast(pa.large_binary())  # views: the same bytes in a flat layout
                t = ch.type
            wide = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
            bufs = ch.buffers()
            offs = np.frombuffer(bufs[1], np.int64 if wide else np.int32)[ch.offset : ch.offset + len(ch) + 1]
            if bufs[2] is not None and offs[-1] > offs[0]:
                self._data = zlib.crc32(memoryview(bufs[2])[int(offs[0]) : int(offs[-1])], self._data)
            self._lens = zlib.crc32(np.diff(offs).astype(np.int64).tobytes(), self._lens)
            nulls = ch.is_null().to_numpy(zero_copy_only=False) if ch.null_count else np.zeros(len(ch), bool)
            self._nulls = zlib.crc32(nulls.tobytes(), self._nulls)
        return self

    @property
    def value(self) -> int:
        """The digest (uint32) of everything added."""
        return zlib.crc32(np.array([self._data, self._lens, self._nulls], np.uint32).tobytes())


def column_crc(col: Any) -> int:
    """:class:`ColumnDigest` of one column (an Arrow array or chunked array)."""
    return ColumnDigest().update(col).value


class ColumnReader(Reader):
    """A columnar format (Parquet, Arrow): records are the rows of the ``text_field`` column."""

    def _check_text_column(self, s: int, schema) -> None:
        """Refuse a Parquet/Arrow shard whose text field is missing or not a string column (any
        type with ``text_mode = "json"``: the values are read as their JSON text)."""
        if schema.get_field_index(self.ix.text_field) < 0:
            raise self._text_column_error(s, schema.names)
        typ = schema.field(self.ix.text_field).type
        if not is_text_type(typ) and getattr(self.ix, "text_mode", "") != "json":
            raise self._text_column_error(s, schema.names, typ)

    def _text_column_error(self, s: int, names: list[str], typ: Any = None) -> DataError:
        if typ is None:
            shown = ", ".join(repr(n) for n in names[:20])
            return self.ix._err(
                s,
                f"column '{self.ix.text_field}' not found (columns: {shown})",
                f"Set text_field = \"<column>\" for dataset '{self.ix.name}' in the recipe.",
            )
        return self.ix._err(
            s,
            f"column '{self.ix.text_field}' has type {typ}, expected a string column",
            f"Set text_field to a string column for dataset '{self.ix.name}' in the recipe.",
        )

    def as_values(self, col: Any) -> Any:
        """The column as read: itself, or with ``text_mode = "json"`` each value's JSON text
        (nulls stay null), so sizes, checksums and reads work on the same strings."""
        if getattr(self.ix, "text_mode", "") != "json":
            return col
        import pyarrow as pa

        vals = [None if v is None else json.dumps(v, ensure_ascii=False) for v in col.to_pylist()]
        return pa.array(vals, pa.large_string())

    def _value(self, s: int, row: int, v: Any) -> str | BadRecord:
        if isinstance(v, str):
            bad = check_text(v, f"field '{self.ix.text_field}'", self.ix.empty_ok)
            if bad is None:
                return v
        elif v is None:
            bad = f"field '{self.ix.text_field}' is null"
        else:  # binary column
            try:
                v = bytes(v).decode("utf-8")
                bad = check_text(v, f"field '{self.ix.text_field}'", self.ix.empty_ok)
                if bad is None:
                    return v
            except UnicodeDecodeError as e:
                bad = utf8_reason(bytes(v), e, "value")
        return BadRecord(self.ix.name, self.ix._specs[s].display, f"row {row}", bad)


class ArrowReader(ColumnReader):
    """Arrow IPC streams or files, local (memory-mapped) or remote (read whole, cached)."""

    def _arrow_reader(self, s: int) -> Any:
        import pyarrow as pa

        sp = self.ix._specs[s]
        try:
            if sp.local:
                src = pa.memory_map(sp.fspath, "r")
            else:
                src = pa.BufferReader(self.ix._caches["blobs"].get(("raw", s), lambda: self.ix._cat(s)))
        except OSError as e:
            if isinstance(e, (FileNotFoundError, PermissionError)) or not isinstance(e, pa.ArrowException):
                raise self.ix._io_error(s, e, "reading") from None
            raise
        try:
            reader = pa.ipc.open_stream(src)
        except pa.ArrowInvalid:
            try:  # a standalone .arrow file may use the IPC *file* format (its footer is checked)
                src.seek(0)
                return pa.ipc.open_file(src)
            except pa.ArrowInvalid as e:
                raise self.ix._err(
                    s,
                    f"not a valid Arrow IPC stream or file: {e}",
                    "Re-save the dataset (datasets.save_to_disk) or re-copy the file.",
                ) from None
        # a stream cut at a message boundary reads as a valid, shorter one: it must end with the
        # end-of-stream marker (or the 4 zero bytes of the pre-1.0 format)
        size = src.size()
        tail = bytes(src.read_at(min(8, size), max(0, size - 8))) if size else b""
        if tail != _ARROW_EOS and tail[-4:] != b"\x00\x00\x00\x00":
            raise self.ix._err(
                s,
                f"truncated Arrow stream: the file ({size} bytes) does not end with the end-of-stream marker, so "
                "record batches after its last complete one may be missing",
                "Re-save the dataset (datasets.save_to_disk) or re-copy the file.",
            )
        return reader

    def build(self, s: int) -> dict[str, np.ndarray]:
        """The UTF-8 length of every row's text (0 for nulls), checking the stream's end marker."""
        import pyarrow as pa
        import pyarrow.compute as pc

        r = self._arrow_reader(s)
        self._check_text_column(s, r.schema)
        lengths = []
        digest = ColumnDigest()
        try:
            batches = (
                r
                if isinstance(r, pa.ipc.RecordBatchStreamReader)
                else (r.get_batch(i) for i in range(r.num_record_batches))
            )
            for b in batches:
                col = self.as_values(b.column(self.ix.text_field))
                lengths.append(pc.binary_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64))
                digest.update(col)
        except pa.ArrowInvalid as e:
            raise self.ix._err(
                s,
                f"corrupt or truncated Arrow data: {e}",
                "Re-save the dataset (datasets.save_to_disk) or re-copy the file.",
            ) from None
        return {
            "lengths": np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
            "crcs": np.full(1, digest.value, np.uint32),  # the read unit: the whole text column
        }

    def read(self, s: int, idx: np.ndarray) -> list[str | BadRecord]:
        """Rows ``idx`` from the shard's text column (memory-mapped when local, cached)."""
        import pyarrow as pa

        def load():
            self.ix._check_unchanged_before_read(s)
            r = self._arrow_reader(s)
            try:
                t = r.read_all()
            except pa.ArrowInvalid as e:
                raise self.ix._err(
                    s,
                    f"corrupt or truncated Arrow data: {e}",
                    "Re-save the dataset (datasets.save_to_disk) or re-copy the file.",
                ) from None
            col = self.as_values(t.column(self.ix.text_field))
            if column_crc(col) != int(self.ix._shard(s)["crcs"][0]):
                raise self.ix._changed_error(
                    s, None, "the text column read is not the one indexed: the file changed since it was indexed"
                )
            return col

        out: list = [None] * idx.size
        keep = self.drop_oversized(s, idx, self.ix._shard(s)["lengths"][idx], out)
        if keep.size:
            col = self.ix._caches["arrow_cols"].get(s, load)
            vals = col.take(pa.array(idx[keep])).to_pylist()
            for k, v in zip(keep.tolist(), vals):
                out[k] = self._value(s, int(idx[k]), v)
        return out
