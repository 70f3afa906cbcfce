"""The text index's metadata cache: one file per dataset (its path and reading settings), not
one per shard.

Why: at 100,000 small shards, writing and reading one ``.npz`` per shard cost about 4-5 ms of
CPU per shard (zip headers, ``np.save`` of seven tiny arrays, ``ast`` parsing of each array
header): minutes before the first batch. One table holds every shard's arrays concatenated, a
``counts`` table (how many entries of each array each shard has) and a JSON header with each
shard's URL, size, version and record count; it is written atomically (readers see the old
table or the whole new one) and read with one ``np.load``.

Each row is still checked on its own: a shard's arrays are used only when its URL, size and
version (and the reading settings) are the ones stored, so a changed, added or removed shard is
indexed again alone and the table rewritten; a foreign, partial or corrupt table is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .cache import write_npz

__all__ = ["TABLE_FORMAT", "ShardTable", "table_path", "write_table"]

#: what a table holds; bump when that changes (old tables are then ignored and rebuilt)
TABLE_FORMAT = 1


def table_path(cache_dir: str, entries: Sequence[str], settings: Sequence[str], keys: Sequence[str]) -> str:
    """The table of the dataset found at ``entries`` (its path, globs, URLs) read with
    ``settings`` (format, text field, text mode): named like zephon's other cache files (a
    SHA-256), so a glob over the cache folder never takes it for data."""
    local = [e if "://" in e else os.path.abspath(os.path.expanduser(e)) for e in entries]
    blob = json.dumps(["text-table", TABLE_FORMAT, local, list(settings), list(keys)], separators=(",", ":"))
    return os.path.join(cache_dir, hashlib.sha256(blob.encode("utf-8")).hexdigest() + ".npz")


def write_table(
    cache_dir: str,
    path: str,
    settings: Sequence[str],
    rows: Sequence[tuple[str, int, str]],
    arrays: Sequence[dict[str, np.ndarray]],
    dtypes: dict[str, Any],
) -> None:
    """Write the table of shards ``rows`` (``(url, size, version)`` each) with their ``arrays``
    to ``path`` atomically; raises OSError (nothing left behind)."""
    keys = list(dtypes)
    header = {
        "table_format": TABLE_FORMAT,
        "settings": list(settings),
        "keys": keys,
        "shards": [[u, int(size), v, int(len(a["lengths"]))] for (u, size, v), a in zip(rows, arrays)],
    }
    counts = np.array([[len(a[k]) for k in keys] for a in arrays], np.int64).reshape(len(arrays), len(keys))
    out: dict[str, np.ndarray] = {
        "header": np.frombuffer(json.dumps(header, separators=(",", ":")).encode("utf-8"), np.uint8),
        "counts": counts,
    }
    for k in keys:
        parts = [a[k] for a in arrays]
        out["a_" + k] = np.concatenate(parts).astype(dtypes[k], copy=False) if parts else np.zeros(0, dtypes[k])
    write_npz(cache_dir, path, out, prefix=os.path.basename(path) + ".")


class ShardTable:
    """A loaded table: each stored shard's arrays, found by URL and checked against the size and
    version the caller sees now (:meth:`get`)."""

    def __init__(self, rows: dict[str, tuple[int, str, int, int]], arrays: dict[str, np.ndarray], starts: np.ndarray):
        self._rows = rows  # url -> (size, version, num_records, row)
        self._arrays = arrays
        self._starts = starts  # [rows + 1, keys]: where each row's entries begin in each array
        self.urls = frozenset(rows)

    @classmethod
    def load(cls, path: str, settings: Sequence[str], dtypes: dict[str, Any]) -> ShardTable | None:
        """The table at ``path``, or None where there is none, or it is foreign, partial or
        corrupt (the caller indexes the shards again)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(bytes(z["header"]).decode("utf-8"))
                keys = list(dtypes)
                if (
                    header.get("table_format") != TABLE_FORMAT
                    or header.get("settings") != list(settings)
                    or header.get("keys") != keys
                ):
                    return None
                counts = np.asarray(z["counts"], np.int64)
                arrays = {k: np.asarray(z["a_" + k]).astype(dtypes[k], copy=False) for k in keys}
        except FileNotFoundError:
            return None
        except Exception:  # corrupt, partial or foreign: index again
            return None
        shards = header.get("shards")
        if not isinstance(shards, list) or counts.shape != (len(shards), len(keys)):
            return None
        starts = np.zeros((len(shards) + 1, len(keys)), np.int64)
        np.cumsum(counts, axis=0, out=starts[1:])
        if any(int(starts[-1, j]) != len(arrays[k]) for j, k in enumerate(keys)):
            return None
        li = keys.index("lengths")
        rows = {}
        for r, row in enumerate(shards):
            url, size, version, n = row
            if int(counts[r, li]) == n:
                rows[url] = (size, version, n, r)
        for a in arrays.values():
            a.flags.writeable = False
        return cls(rows, arrays, starts)

    def get(self, url: str, size: int, version: str, num_records: int | None = None) -> dict[str, np.ndarray] | None:
        """The stored arrays of shard ``url`` (read-only views) if it was stored with this size
        and version (and ``num_records`` records, when given); None otherwise."""
        row = self._rows.get(url)
        if row is None or row[0] != size or row[1] != version or (num_records is not None and row[2] != num_records):
            return None
        r = row[3]
        lo, hi = self._starts[r], self._starts[r + 1]
        return {k: a[int(lo[j]) : int(hi[j])] for j, (k, a) in enumerate(self._arrays.items())}
