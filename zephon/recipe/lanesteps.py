"""The lane-steps cache: how many micro-batches each lane of a finite recipe holds, counted once
per data definition by a dry run and kept on disk next to the dataset indexes, under a file lock
so the ranks of a node count once (see :class:`zephon.engine.end.LaneEnd` for why a finite
recipe needs the count before its first step).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from zephon.data.datasets import default_cache_dir

from .prepare import Prepared

__all__ = ["LANE_STEPS_FORMAT", "cached_lane_steps", "lane_steps_key"]

_LOG = logging.getLogger("zephon")


#: what a cached lane-count file holds: bump when counting changes (old files are then recounted)
LANE_STEPS_FORMAT = 2


def _zephon_version() -> str:
    try:  # the distribution's name (``zephon`` on the package index is another project)
        return importlib.metadata.version("zephon-loader")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "unknown"


def lane_steps_key(p: Prepared, also: str = "") -> str:
    """What a finite recipe's per-lane step counts depend on: its fingerprint (data definition,
    files, tokenizer, end mode), the token estimates its plan was made with, its data version
    and the zephon version that counts (another version may pack, hence count, differently);
    ``also``: anything else the counts depend on (a fork's parent's token estimates)."""
    est = json.dumps(
        {k: [v.tokens_per_byte, v.tokens_per_record, v.sampled] for k, v in sorted(p.estimates.items())},
        sort_keys=True,
    )
    ver = f"{LANE_STEPS_FORMAT}\0{_zephon_version()}\0{p.spec.data_version}"
    tail = f"\0{also}" if also else ""  # none: the keys of files written before `also` existed
    return hashlib.sha256(f"{p.fingerprint}\0{est}\0{ver}{tail}".encode()).hexdigest()[:32]


def _read_counts(path: str, p: Prepared, key: str) -> list[int] | None:
    """The counts in ``path`` if the file is whole and was written for exactly this recipe,
    data version and zephon version (its own record says so); None otherwise (count again)."""
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
        got = rec.get("lane_steps")
        mine = (rec.get("key"), rec.get("fingerprint"), rec.get("lanes"), rec.get("end"), rec.get("zephon"))
    except (OSError, ValueError, AttributeError):
        return None
    if mine != (key, p.fingerprint, p.spec.lanes, p.spec.end, _zephon_version()):
        return None
    if isinstance(got, list) and len(got) == p.spec.lanes and all(type(n) is int and n >= 0 for n in got):
        return got
    return None


def _write_counts(path: str, record: dict[str, Any]) -> bool:
    """Write ``record`` to ``path`` atomically; False (with a warning, nothing left behind) where
    the folder is full or read-only: the counts are still used, just not kept."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, path)
        return True
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        warnings.warn(
            f"zephon: cannot write the lane step cache {path!r} ({e}); the counts are used but not kept. "
            "Free space there or set ZEPHON_CACHE_DIR to a writable directory.",
            stacklevel=3,
        )
        return False


def cached_lane_steps(p: Prepared, count: Callable[[], Sequence[int]], also: str = "") -> list[int]:
    """The micro-batches each lane of the finite recipe ``p`` holds: from the cache folder
    (the recipe's ``cache_dir``, else ``$ZEPHON_CACHE_DIR`` / ``~/.cache/zephon/index``) when
    there, else ``count()`` (a dry run of every lane) stored there under a file lock, so that
    the ranks of one node sharing the folder count once and the others wait and read it.

    The count is a pass over the data (read, tokenize, pack: what one epoch of loading costs,
    with the rank's workers); the file is keyed by :func:`lane_steps_key`, so any change of
    the data definition (or of the data or zephon version) counts again; a full or read-only
    folder counts without keeping the result. ``also``: see :func:`lane_steps_key`."""
    folder = p.spec.cache_dir or default_cache_dir()
    key = lane_steps_key(p, also)
    path = os.path.join(folder, f"lane_steps-{key}.json")
    lanes = p.spec.lanes
    got = _read_counts(path, p, key)
    if got is not None:
        return got
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(path + ".lock", "a+")
    except OSError as e:
        warnings.warn(
            f"zephon: cannot write the lane step cache in {folder!r} ({e}); counting without caching. "
            "Set ZEPHON_CACHE_DIR to a writable directory.",
            stacklevel=2,
        )
        return [int(n) for n in count()]
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of a node: one counts, the others wait and read
        try:
            got = _read_counts(path, p, key)
            if got is not None:
                return got
            t0 = time.perf_counter()
            got = [int(n) for n in count()]
            seconds = time.perf_counter() - t0
            record = {
                "key": key,
                "fingerprint": p.fingerprint,
                "lanes": lanes,
                "end": p.spec.end,
                "zephon": _zephon_version(),
                "data_version": p.spec.data_version,
                "lane_steps": got,
                "count_seconds": round(seconds, 3),
            }
            if not _write_counts(path, record):
                return got
            _LOG.info(
                "zephon: counted the micro-batches of the %d lanes of a finite recipe in %.1f s (%d..%d per lane); "
                "cached in %s",
                lanes,
                seconds,
                min(got),
                max(got),
                path,
            )
            return got
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
