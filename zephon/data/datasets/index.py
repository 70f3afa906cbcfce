"""The text index: per-shard metadata (record counts, sizes, offsets) and random-access reads
of text records, for every text format (JSON Lines, plain text, Parquet, Arrow).

This layer does no shuffling or planning. It answers: how many records, how big is each, and
"give me records i, j, k of shard s". Each format's indexing and reading is its own module
(:mod:`.jsonl`, :mod:`.text`, :mod:`.parquet`, :mod:`.arrow`); finding the files is
:mod:`.resolve`; the metadata cache and pickling are :mod:`.cache`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import numpy as np

from ._scan import LRU
from .arrow import ArrowReader
from .cache import fingerprint, write_npz
from .errors import BadRecord, DataError
from .jsonl import JsonlReader
from .parquet import ParquetReader
from .resolve import (
    FORMATS,
    ShardMeta,
    ShardSpec,
    default_cache_dir,
    open_cache_dir,
    pick_format,
    resolve_files,
    shard_specs,
    stat_spec,
)
from .shardio import ShardFiles
from .text import LineReader, Reader, TextFileReader

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES",
    "EMPTY",
    "FORMATS",
    "TEXT_MODES",
    "DatasetIndex",
    "ShardMeta",
    "default_cache_dir",
    "index_dataset",
    "resolve_files",
]

#: what an empty or whitespace-only text is: a "bad" record (data version 1) or a "document"
EMPTY = ("bad", "document")

#: the per-record size limit unless a recipe sets max_record_bytes: larger records are bad records
#: (an error naming file and line, or a counted skip), read neither at indexing nor at run time
DEFAULT_MAX_RECORD_BYTES = 32 << 20
TEXT_MODES = ("line", "file")
#: 2: every read unit's CRC-32 (``crcs``), checked on every read
CACHE_FORMAT_VERSION = 2
_ARRAY_KEYS = ("offsets", "lengths", "gap_rec", "gap_cum", "groups", "crcs")
_FORMAT_FIX = 'Set format = "jsonl" (or "parquet", "text", "arrow") for this dataset in the recipe'
#: the reader of each (format, text_mode)
_READERS: dict[tuple[str, str], type[Reader]] = {
    ("jsonl", "line"): JsonlReader,
    ("jsonl", "file"): JsonlReader,
    ("text", "line"): LineReader,
    ("text", "file"): TextFileReader,
    ("parquet", "line"): ParquetReader,
    ("parquet", "file"): ParquetReader,
    ("arrow", "line"): ArrowReader,
    ("arrow", "file"): ArrowReader,
}


def _dtype(key: str) -> type:
    return np.uint32 if key == "crcs" else np.int64


def _empty_arrays() -> dict[str, np.ndarray]:
    return {k: np.zeros(0, _dtype(k)) for k in _ARRAY_KEYS}


def content_version(arrays: dict[str, np.ndarray]) -> str:
    """The identity of a shard that its storage reports no version of (an HTTP server without
    ETag or Last-Modified): a digest of its indexed records (their places, sizes and CRC-32s).

    >>> content_version(_empty_arrays())[:8]
    'content:'
    """
    h = hashlib.sha256()
    for k in _ARRAY_KEYS:
        h.update(k.encode())
        h.update(np.ascontiguousarray(arrays[k], _dtype(k)).tobytes())
    return "content:" + h.hexdigest()[:32]


def _cache_key(url: str, fmt: str, text_field: str, text_mode: str) -> str:
    blob = json.dumps([url, fmt, text_field, text_mode], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


class DatasetIndex(ShardFiles):
    """Metadata of one dataset's shards plus thread-safe random-access reads.

    ``record_bytes(s)`` is the byte size used for token-weighted mixing:
      * jsonl: the byte length of the whole JSON line (an estimate of the text size: it includes
        the other fields, quoting and escapes; computing the exact text length would need a JSON
        parse of every line at indexing time);
      * text (line mode): the line's byte length; text (file mode): the (decompressed) file size;
      * parquet / arrow: the exact UTF-8 byte length of the text column (0 for nulls).
    """

    # decompressed .gz/.zst shards (and whole remote arrow files); parquet (shard, row group) ->
    # text column; parquet shard -> FileMetaData; arrow shard -> text column (memory-mapped when local)
    CACHES = {"blobs": 2, "row_groups": 8, "pq_meta": 64, "arrow_cols": 32}

    def __init__(
        self,
        name: str,
        format: str,
        text_field: str,
        text_mode: str,
        specs: list[ShardSpec],
        shards: list[ShardMeta],
        cache_dir: str | None,
        arrays: dict[int, dict[str, np.ndarray]],
        cached: list[bool],
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        self.name = name
        # records larger than this read back as BadRecord, without being read (not part of the
        # cached metadata: the index records every record's true size)
        self.max_record_bytes = int(max_record_bytes)
        self.format = format
        self.text_field = text_field
        self.text_mode = text_mode
        self.cache_dir = cache_dir
        self._specs = specs
        self._arrays = arrays
        self._cached = cached
        self._set_shards(shards)
        self.fingerprint = fingerprint(shards, format, text_field, text_mode)
        self._init_runtime()

    def _init_runtime(self) -> None:
        super()._init_runtime()
        self._reader = _READERS[self.format, self.text_mode](self)

    def __getstate__(self) -> dict:
        st = super().__getstate__()
        del st["_reader"]
        return st

    @property
    def _blobs(self) -> LRU:
        return self._caches["blobs"]

    @property
    def _row_groups(self) -> LRU:
        return self._caches["row_groups"]

    def __repr__(self) -> str:
        return (
            f"DatasetIndex(name={self.name!r}, format={self.format!r}, shards={len(self.shards)}, "
            f"num_records={self.num_records}, fingerprint={self.fingerprint[:12]}...)"
        )

    def __enter__(self) -> DatasetIndex:
        return self

    # -- metadata ------------------------------------------------------------------------------
    def shard_offsets(self) -> np.ndarray:
        """int64 cumulative record counts, ``len(shards) + 1`` entries, starting at 0."""
        return self._offsets.copy()

    def record_bytes(self, shard: int) -> np.ndarray:
        """int64 byte size of every record of ``shard`` (read-only array; see class doc)."""
        self._check_shard(shard)
        return self._shard(shard)["lengths"]

    def locate(self, shard: int, record: int) -> dict:
        """Where a record lives: ``{"file", "locator"}`` (``line N`` 1-based for line formats,
        ``row N`` 0-based for Parquet/Arrow, ``whole file``), plus ``byte_offset`` /
        ``byte_length`` of the line in the (decompressed) file for line formats."""
        self._check_shard(shard)
        if not 0 <= record < self.shards[shard].num_records:
            raise IndexError(
                f"record {record} out of range for shard {shard} ({self.shards[shard].num_records} records)"
            )
        return {"file": self._specs[shard].display, **self._reader.locate(shard, record)}

    # -- reads ---------------------------------------------------------------------------------
    def read(self, shard: int, indices: Sequence[int]) -> list[str | BadRecord]:
        """Texts of records ``indices`` (0-based within the shard) of ``shard``, in the order
        given (duplicates allowed). Bad content comes back as ``BadRecord``; file-level problems
        raise ``DataError``. Thread-safe."""
        self._check_shard(shard)
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return []
        n = self.shards[shard].num_records
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise IndexError(
                f"dataset '{self.name}': record index {bad} is out of range for shard {shard} "
                f"('{self.shards[shard].path}', {n} records)"
            )
        return self._reader.read(shard, idx)

    def _check_shard(self, shard: int) -> None:
        if not isinstance(shard, (int, np.integer)) or not 0 <= shard < len(self.shards):
            raise IndexError(f"dataset '{self.name}': shard {shard!r} out of range (0..{len(self.shards) - 1})")

    def _build_arrays(self, s: int) -> dict[str, np.ndarray]:
        arrays = _empty_arrays()
        if self._specs[s].size == 0:
            return arrays  # zero-byte shard: allowed, no records
        # a remote fault restarts the shard's indexing from its start (within the retry budget)
        arrays.update(self._retrying(s, "indexing", lambda: self._reader.build(s)))
        return {k: v.astype(_dtype(k), copy=False) for k, v in arrays.items()}

    # -- metadata cache -------------------------------------------------------------------------
    def _cache_path(self, s: int) -> str | None:
        if not self.cache_dir:
            return None
        key = _cache_key(self._specs[s].url, self.format, self.text_field, self.text_mode)
        return os.path.join(self.cache_dir, key + ".npz")

    def _header(self, s: int, size: int, version: str, n: int | None) -> dict[str, Any]:
        return {
            "cache_format": CACHE_FORMAT_VERSION,
            "url": self._specs[s].url,
            "format": self.format,
            "text_field": self.text_field,
            "text_mode": self.text_mode,
            "size": size,
            "version": version,
            "num_records": n,
        }

    def _load_cache(self, s: int, size: int, version: str, n: int | None) -> dict[str, np.ndarray] | None:
        path = self._cache_path(s)
        if path is None:
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(bytes(z["header"]).decode("utf-8"))
                want = self._header(s, size, version, header.get("num_records") if n is None else n)
                if header != want:
                    return None  # stale or foreign: never use it
                arrays = {k: z[k].astype(_dtype(k), copy=False) for k in _ARRAY_KEYS}
            if len(arrays["lengths"]) != header["num_records"]:
                return None
            return arrays
        except FileNotFoundError:
            return None
        except Exception:  # corrupt/partial/foreign cache file: rebuild it
            return None

    def _store(self, s: int, arrays: dict[str, np.ndarray]) -> bool:
        path = self._cache_path(s)
        if path is None or self.cache_dir is None:
            return False
        sp = self._specs[s]
        header = self._header(s, sp.size, sp.version, int(len(arrays["lengths"])))
        hb = np.frombuffer(json.dumps(header, sort_keys=True).encode("utf-8"), dtype=np.uint8)
        try:
            write_npz(self.cache_dir, path, {"header": hb, **arrays}, prefix=os.path.basename(path) + ".")
            return True
        except OSError as e:
            warnings.warn(
                f"zephon: cannot write the index cache in '{self.cache_dir}' ({e}); "
                "keeping metadata in memory. Set ZEPHON_CACHE_DIR to a writable directory.",
                stacklevel=3,
            )
            return False

    def _load_cached(self, s: int) -> dict[str, np.ndarray] | None:
        sp = self._specs[s]
        if not sp.version:
            return None  # the storage reports no version: a cache entry cannot be told stale
        return self._load_cache(s, sp.size, sp.version, None)

    def _reload(self, s: int) -> dict[str, np.ndarray]:
        m, sp = self.shards[s], self._specs[s]
        a = self._load_cache(s, m.size_bytes, sp.version, m.num_records)
        if a is None or (m.version.startswith("content:") and content_version(a) != m.version):
            # cache gone (cleaned?) or rebuilt for a newer file: rebuild only if the file is
            # still the one we indexed
            if self._retrying(s, "checking", lambda: stat_spec(sp)) != (m.size_bytes, sp.version):
                raise self._changed_error(s)
            a = self._build_arrays(s)
            if len(a["lengths"]) != m.num_records or (
                m.version.startswith("content:") and content_version(a) != m.version
            ):
                raise self._changed_error(s)
            self._cached[s] = self._store(s, a)
        for v in a.values():
            v.flags.writeable = False
        return a


# ----------------------------------------------------------------------------------------------


def _check_settings(name: str, format: str, text_field: str, text_mode: str) -> None:
    """Refuse an unknown format or text mode, or a text field that is not a non-empty string."""
    if format not in ("auto",) + FORMATS:
        raise DataError(
            f"unknown format {format!r}",
            dataset=name,
            fix=f'{_FORMAT_FIX}, or "auto" to infer it from the file extensions.',
        )
    if text_mode not in TEXT_MODES:
        raise DataError(
            f"unknown text_mode {text_mode!r}",
            dataset=name,
            fix='Set text_mode = "line" (one document per line) or "file" (one per file).',
        )
    if not isinstance(text_field, str) or not text_field:
        raise DataError(
            "text_field must be a non-empty string",
            dataset=name,
            fix='Set text_field = "text" (or the name of the text column).',
        )


def _prepare_all(idx: DatasetIndex, progress: bool | None) -> list[tuple[dict[str, np.ndarray], bool]]:
    """Every shard's ``(arrays, cached)``, indexed (or loaded) by up to 8 threads, in shard
    order; the first failing shard's error is raised (the others are cancelled)."""
    n = len(idx._specs)
    if progress is None:
        progress = n > 4 and sys.stderr.isatty()
    bar = None
    if progress:
        from tqdm.std import tqdm

        bar = tqdm(total=n, desc=f"indexing {idx.name}", unit="shard")
    results: dict[int, tuple[dict[str, np.ndarray], bool]] = {}
    errors: dict[int, BaseException] = {}
    workers = max(1, min(8, os.cpu_count() or 1, n))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zephon-index")
    try:
        futs = {pool.submit(idx._prepare, s): s for s in range(n)}
        for fut in as_completed(futs):
            s = futs[fut]
            try:
                results[s] = fut.result()
            except BaseException as e:
                errors[s] = e
                for f in futs:
                    f.cancel()
            if bar is not None:
                bar.update(1)
    except BaseException:
        # interrupted (Ctrl-C, SIGTERM): the queued shards are dropped, not indexed first; the
        # few being indexed end by themselves (their cache writes are atomic)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    else:
        pool.shutdown(wait=True)
    finally:
        if bar is not None:
            bar.close()
    if errors:
        raise errors[min(errors)]
    return [results[s] for s in range(n)]


def index_dataset(
    name: str,
    path: str | list[str],
    format: str = "auto",
    text_field: str = "text",
    text_mode: str = "line",
    cache_dir: str | None = None,
    progress: bool | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    same_file: str = "each",
    empty: str = "bad",
) -> DatasetIndex:
    """Find the shards of dataset ``name`` and build (or load cached) per-shard metadata.

    ``path``: a path, glob, folder, fsspec URL (``memory://``, ``s3://``, ``gs://``, ``hf://``
    with the backend installed), or a list of those. A folder written by Hugging Face
    ``save_to_disk`` (it has ``state.json``) is read as ``format="arrow"``.
    ``format``: "auto" (from the extensions), "jsonl", "parquet", "text" or "arrow".
    Compression (.gz, .zst, .zstd) of jsonl/text files follows the extension.
    ``text_mode`` (format "text"): "line" = one document per non-blank line, "file" = one per file.
    ``cache_dir``: where per-shard metadata is cached (default ``$ZEPHON_CACHE_DIR`` or
    ``~/.cache/zephon/index``).
    ``max_record_bytes``: the per-record size limit; a larger record reads back as a
    :class:`BadRecord` naming its file and line, without its bytes being read.
    ``same_file``: "once" reads a file reached through several paths (symlinks) once, from its
    first path in sorted order; "each" reads every path.
    ``empty``: an empty or whitespace-only text is a "document" (data: its BOS/EOS) or a "bad"
    record (an empty file has no record either way).
    """
    if empty not in EMPTY:
        raise DataError(f"unknown empty = {empty!r}", dataset=name, fix=f"Use one of {EMPTY}.")
    _check_settings(name, format, text_field, text_mode)
    files = resolve_files(name, path, format)
    fmt, comps = pick_format(name, files, format)
    specs = shard_specs(name, files, comps, same_file)
    cache_dir = open_cache_dir(cache_dir)

    # a placeholder index (no records yet) does the indexing, one shard per thread
    placeholder = [ShardMeta(sp.display, 0, sp.size, sp.version) for sp in specs]
    idx = DatasetIndex(name, fmt, text_field, text_mode, specs, placeholder, cache_dir, {}, [False] * len(specs))
    shards = []
    for s, (sp, (arrays, cached)) in enumerate(zip(specs, _prepare_all(idx, progress))):
        for v in arrays.values():
            v.flags.writeable = False
        idx._arrays[s] = arrays
        idx._cached[s] = cached
        version = sp.version or content_version(arrays)  # no version from the storage: the content's
        shards.append(ShardMeta(sp.display, int(len(arrays["lengths"])), sp.size, version))
    out = DatasetIndex(
        name, fmt, text_field, text_mode, specs, shards, cache_dir, idx._arrays, idx._cached, max_record_bytes
    )
    out.empty_ok = empty == "document"
    return out
