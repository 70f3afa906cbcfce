"""Parquet shards of text (format ``"parquet"``): the records are the rows of ``text_field``.

Indexing reads the text column once for its exact UTF-8 lengths; a read fetches each row
group's text column once (an LRU of them per index), with page checksums verified where the
writer stored them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np

from .arrow import ColumnReader, column_crc
from .errors import BadRecord
from .retry import transient

__all__ = ["ParquetReader"]


class ParquetReader(ColumnReader):
    """Parquet text shards, local (opened by path) or remote (through fsspec)."""

    @contextlib.contextmanager
    def _parquet_file(self, s: int, metadata: Any = None) -> Iterator[Any]:
        """Open shard s as a ParquetFile (errors mapped to DataError); closes everything after."""

        sp = self.ix._specs[s]
        with self.ix._local_copy(s) as copy:  # a remote shard's node-cache copy, opened by path (fast)
            path = sp.fspath if sp.local else copy
            fh = None if path is not None else self.ix._open(s, cached=False)
            with self._opened(s, path, fh, metadata) as pf:
                yield pf

    @contextlib.contextmanager
    def _opened(self, s: int, path: str | None, fh: Any, metadata: Any) -> Iterator[Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            try:
                # pages written with a CRC are verified (a corrupted page raises instead of being
                # trained on); pages without one cannot be
                pf = pq.ParquetFile(
                    path if path is not None else fh, metadata=metadata, page_checksum_verification=True
                )
            except (FileNotFoundError, PermissionError) as e:
                raise self.ix._io_error(s, e, "reading") from None
            except (pa.ArrowException, OSError) as e:
                if transient(e):
                    raise  # retried by the caller
                raise self.ix._err(
                    s,
                    f"not a valid Parquet file (corrupt or truncated footer?): {e}",
                    "Re-download or rewrite the file, or remove it from the dataset's path list.",
                ) from None
            try:
                yield pf
            finally:
                pf.close()
        finally:
            if fh is not None:
                fh.close()

    def build(self, s: int) -> dict[str, np.ndarray]:
        """Row-group boundaries (``groups``) and every row's text length (0 for nulls)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        with self._parquet_file(s) as pf:
            self._check_text_column(s, pf.schema_arrow)
            md = pf.metadata
            counts = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
            lengths = []
            crcs = []
            for rg in range(md.num_row_groups):
                try:
                    col = self.as_values(pf.read_row_group(rg, columns=[self.ix.text_field]).column(0))
                except (pa.ArrowException, OSError) as e:
                    raise self.ix._err(
                        s,
                        f"cannot read row group {rg}: {e}",
                        "Re-download or rewrite the file, or remove it from the dataset's path list.",
                    ) from None
                lengths.append(pc.binary_length(col).fill_null(0).to_numpy().astype(np.int64))
                crcs.append(column_crc(col))  # a row group's text column: the read unit
        groups = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=groups[1:])
        lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        return {"groups": groups, "lengths": lens, "crcs": np.array(crcs, np.uint32)}

    def read(self, s: int, idx: np.ndarray) -> list[str | BadRecord]:
        """Rows ``idx``, each row group's text column read once (and cached)."""
        import pyarrow as pa

        a = self.ix._shard(s)
        groups = a["groups"]
        out: list = [None] * idx.size
        keep = self.drop_oversized(s, idx, a["lengths"][idx], out)
        rg_of = np.searchsorted(groups, idx, side="right") - 1
        for rg in np.unique(rg_of[keep]).tolist():
            col: Any = self.ix._caches["row_groups"].get((s, rg), functools.partial(self._load_row_group, s, rg))
            ks = keep[rg_of[keep] == rg]
            vals = col.take(pa.array(idx[ks] - groups[rg])).to_pylist()
            for k, v in zip(ks.tolist(), vals):
                out[k] = self._value(s, int(idx[k]), v)
        return out

    def _load_row_group(self, s: int, rg: int) -> Any:
        """Row group rg's text column, checked against its CRC-32 in the index."""
        self.ix._check_unchanged_before_read(s)
        col = self.ix._retrying(s, "reading", lambda: self._read_row_group(s, rg))
        if column_crc(col) != int(self.ix._shard(s)["crcs"][rg]):
            raise self.ix._changed_error(
                s,
                f"row group {rg}",
                "the text column read is not the one indexed: the file changed since it was indexed",
            )
        return col

    def _read_row_group(self, s: int, rg: int) -> Any:
        import pyarrow as pa

        def meta() -> Any:
            with self._parquet_file(s) as pf:
                return pf.metadata

        md = self.ix._caches["pq_meta"].get(s, meta)
        with self._parquet_file(s, metadata=md) as pf:
            try:
                col = pf.read_row_group(rg, columns=[self.ix.text_field]).column(0)
            except (pa.ArrowException, OSError) as e:
                if transient(e):
                    raise  # retried by the caller
                raise self.ix._err(
                    s,
                    f"cannot read row group {rg}: {e}",
                    "Re-download or rewrite the file, or remove it from the dataset's path list.",
                ) from None
        return self.as_values(col.combine_chunks())
