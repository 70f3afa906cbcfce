"""A record's metadata fields besides its text: what a ``kind = "field"`` filter compares.

Readers return only the text, so the fields a filter needs are read by a second, separate call,
made only for the datasets such a filter applies to (every other dataset reads exactly as
before). JSON Lines: the same line parsed again for the named keys; Parquet: the named columns
of the row group (cached like the text column), in text and image-text Parquet files alike;
Arrow: the named columns of the shard. A field
absent from a record (or a column absent from a file) is absent from its dict; a JSON ``null``
is ``None``.

    >>> import os, tempfile, json
    >>> from zephon.data.datasets import index_dataset
    >>> root = tempfile.mkdtemp(); p = os.path.join(root, "a.jsonl")
    >>> _ = open(p, "w").write(json.dumps({"text": "hi", "score": 0.5}) + "\\n" + json.dumps({"text": "yo"}) + "\\n")
    >>> read_fields(index_dataset("d", p, cache_dir=root), 0, [0, 1], ("score",))
    [{'score': 0.5}, {}]
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import DataError
from .index import DatasetIndex
from .multimodal import MultimodalIndex

__all__ = ["FIELD_FORMATS", "read_fields"]

#: the formats whose records have named fields besides the text
FIELD_FORMATS = ("jsonl", "parquet", "arrow")


def read_fields(ix: Any, shard: int, indices: Sequence[int], names: Sequence[str]) -> list[dict[str, Any]]:
    """Per record ``indices`` of ``shard`` (in the order given), the values of the fields
    ``names`` it has. A record whose line is not a JSON object has none (its text read says why)."""
    if isinstance(ix, MultimodalIndex) and ix.format == "parquet":
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        return _mm_parquet(ix, shard, idx, tuple(names)) if idx.size else []
    if not isinstance(ix, DatasetIndex) or ix.format not in FIELD_FORMATS:
        fmt = getattr(ix, "format", type(ix).__name__)
        raise DataError(
            f"dataset '{getattr(ix, 'name', '?')}' is {fmt!r}: its records have no named fields besides the text, so "
            f"a field filter cannot apply to it. Restrict the filter with datasets = [...] to {', '.join(FIELD_FORMATS)} "
            "datasets"
        )
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        return []
    names = tuple(names)
    if ix.format == "jsonl":
        return _jsonl(ix, shard, idx, names)
    if ix.format == "parquet":
        return _parquet(ix, shard, idx, names)
    return _arrow(ix, shard, idx, names)


def _jsonl(ix: DatasetIndex, s: int, idx: np.ndarray, names: tuple[str, ...]) -> list[dict[str, Any]]:
    a = ix._shard(s)
    out: list[dict[str, Any]] = []
    for raw in ix._read_ranges(s, a["offsets"][idx].tolist(), a["lengths"][idx].tolist()):
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            obj = None
        out.append({k: obj[k] for k in names if k in obj} if isinstance(obj, dict) else {})
    return out


def _rows(table: Any, rows: np.ndarray, names: tuple[str, ...]) -> list[dict[str, Any]]:
    import pyarrow as pa

    have = [n for n in names if n in table.column_names]
    cols = {n: table.column(n).take(pa.array(rows)).to_pylist() for n in have}
    return [{n: cols[n][k] for n in have} for k in range(len(rows))]


def _parquet(ix: DatasetIndex, s: int, idx: np.ndarray, names: tuple[str, ...]) -> list[dict[str, Any]]:
    groups = ix._shard(s)["groups"]
    rg_of = np.searchsorted(groups, idx, side="right") - 1
    out: list[dict[str, Any]] = [{} for _ in range(idx.size)]
    for rg in np.unique(rg_of).tolist():
        table = ix._caches["row_groups"].get(
            ("fields", s, rg, names), functools.partial(_parquet_group, ix, s, rg, names)
        )
        ks = np.flatnonzero(rg_of == rg)
        for k, row in zip(ks.tolist(), _rows(table, idx[ks] - groups[rg], names)):
            out[k] = row
    return out


def _parquet_group(ix: DatasetIndex, s: int, rg: int, names: tuple[str, ...]) -> Any:
    reader: Any = ix._reader

    def read() -> Any:
        with reader._parquet_file(s) as pf:
            have = [n for n in names if pf.schema_arrow.get_field_index(n) >= 0]
            return pf.read_row_group(rg, columns=have)

    return ix._retrying(s, "reading", read)


def _mm_parquet(ix: MultimodalIndex, s: int, idx: np.ndarray, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The named columns of an image-text Parquet shard's rows ``idx`` (row group by row group)."""
    import pyarrow.parquet as pq

    groups = ix._shard(s)["groups"]
    rg_of = np.searchsorted(groups, idx, side="right") - 1
    out: list[dict[str, Any]] = [{} for _ in range(idx.size)]
    sp = ix._specs[s]
    for rg in np.unique(rg_of).tolist():

        def read(rg: int = rg) -> Any:
            with sp.fs.open(sp.fspath, "rb") as f:
                pf = pq.ParquetFile(f)
                have = [n for n in names if pf.schema_arrow.get_field_index(n) >= 0]
                return pf.read_row_group(rg, columns=have)

        table = ix._caches["groups"].get(("fields", s, rg, names), lambda: ix._retrying(s, "reading", read))
        ks = np.flatnonzero(rg_of == rg)
        for k, row in zip(ks.tolist(), _rows(table, idx[ks] - groups[rg], names)):
            out[k] = row
    return out


def _arrow(ix: DatasetIndex, s: int, idx: np.ndarray, names: tuple[str, ...]) -> list[dict[str, Any]]:
    reader: Any = ix._reader

    def load() -> Any:
        t = reader._arrow_reader(s).read_all()
        return t.select([n for n in names if n in t.column_names])

    return _rows(ix._caches["arrow_cols"].get(("fields", s, names), load), idx, names)
