"""What both index kinds share: the metadata cache on disk (atomic ``.npz`` writes: one per
shard for image-text indexes, one table per dataset for text ones, :mod:`.table`), the
in-memory caches of shard contents (decompressed shards, row groups, memory maps; small LRUs),
and the index as a pickled handle (process workers get an index with every task: it travels
without the metadata that is on disk, which reloads lazily).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from typing import Any, ClassVar

import numpy as np

from ._scan import LRU
from .resolve import ShardMeta

__all__ = ["ShardCache", "ShardStore", "fingerprint", "write_npz"]


def fingerprint(shards: list[ShardMeta], *fields: str) -> str:
    """SHA-256 of every shard's path, size and version and the dataset's reading settings: it
    changes whenever the data a run would read does."""
    rows = [[m.path, m.size_bytes, m.version, *fields] for m in shards]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode("utf-8")).hexdigest()


def write_npz(cache_dir: str, path: str, arrays: dict[str, np.ndarray], *, prefix: str | None = None) -> None:
    """Write ``arrays`` to ``path`` atomically (readers see the old file or the whole new one);
    raises OSError (no temporary file is left behind)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=prefix, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


class ShardCache:
    """The in-memory caches of one index's shard contents: named LRUs, sized per index kind.

    Why one place: every reader caches what is costly to reopen (a decompressed ``.zst`` shard, a
    Parquet row group, a memory-mapped Arrow column) and all of it is dropped together, by
    ``close()`` and when the index is pickled.

    >>> c = ShardCache({"blobs": 2}); c["blobs"].get(0, lambda: b"data")
    b'data'
    >>> c.clear(); c["blobs"].get(0, lambda: b"reloaded")
    b'reloaded'
    """

    def __init__(self, sizes: dict[str, int]) -> None:
        self._lrus = {k: LRU(n) for k, n in sizes.items()}

    def __getitem__(self, name: str) -> LRU:
        return self._lrus[name]

    def clear(self) -> None:
        """Drop every cached entry (later reads reload them)."""
        for c in self._lrus.values():
            c.clear()


class ShardStore:
    """The base of both index kinds: per-shard metadata arrays (built, or loaded from the cache
    folder), shard offsets, the shard caches, and pickling as a small handle.

    A subclass sets ``CACHES`` (its :class:`ShardCache` sizes) and implements ``_load_cached(s)``
    (the shard's arrays from the cache folder, or None), ``_build_arrays(s)`` (index the file),
    ``_store(s, arrays)`` (write them; whether they are now on disk) and ``_reload(s)`` (arrays
    of a shard of an unpickled copy, checked against the indexed shard).
    """

    CACHES: ClassVar[dict[str, int]] = {}
    name: str
    shards: list[ShardMeta]
    num_records: int
    _arrays: dict[int, dict[str, np.ndarray]]
    _cached: Any  # shard -> whether its arrays are in the cache folder

    def _set_shards(self, shards: list[ShardMeta]) -> None:
        self.shards = shards
        self._offsets = np.zeros(len(shards) + 1, np.int64)
        np.cumsum([m.num_records for m in shards], out=self._offsets[1:])
        self.num_records = int(self._offsets[-1])

    def _init_runtime(self) -> None:
        self._lock = threading.RLock()
        self._caches = ShardCache(self.CACHES)

    # -- pickling: drop locks and caches; arrays that are in the cache folder reload lazily ------
    def __getstate__(self) -> dict:
        # Why: process workers get the work function (and this index) with every task; the
        # member table of a tar corpus is hundreds of KB (648 KB measured for 3,200 pairs)
        st = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_caches")}
        st["_arrays"] = {s: a for s, a in self._arrays.items() if not self._cached[s]}
        return st

    def __setstate__(self, st: dict) -> None:
        self.__dict__.update(st)
        self._init_runtime()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release cached decompressed shards, row groups and memory maps. Reads still work
        afterwards (they reopen what they need)."""
        self._caches.clear()

    def shard_offsets(self) -> np.ndarray:
        """int64 ``[len(shards) + 1]``: the global index of each shard's first record, then the total."""
        return self._offsets.copy()

    # -- per-shard arrays ----------------------------------------------------------------------
    def _prepare(self, s: int) -> tuple[dict[str, np.ndarray], bool]:
        """Index time: shard ``s``'s arrays from the cache if fresh, else built (and stored);
        and whether they are in the cache folder."""
        arrays = self._load_cached(s)
        if arrays is not None:
            return arrays, True
        arrays = self._build_arrays(s)
        return arrays, self._store(s, arrays)

    def _shard(self, s: int) -> dict[str, np.ndarray]:
        """Shard ``s``'s arrays (reloaded, once, in an unpickled copy)."""
        a = self._arrays.get(s)
        if a is not None:
            return a
        with self._lock:
            a = self._arrays.get(s)
            if a is None:
                a = self._arrays[s] = self._reload(s)
            return a

    def _load_cached(self, s: int) -> dict[str, np.ndarray] | None:
        raise NotImplementedError

    def _build_arrays(self, s: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _store(self, s: int, arrays: dict[str, np.ndarray]) -> bool:
        raise NotImplementedError

    def _reload(self, s: int) -> dict[str, np.ndarray]:
        raise NotImplementedError
