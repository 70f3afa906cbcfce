"""The text index: per-shard metadata (record counts, sizes, offsets) and random-access reads
of text records, for every text format (JSON Lines, plain text, Parquet, Arrow).

This layer does no shuffling or planning. It answers: how many records, how big is each, and
"give me records i, j, k of shard s". Each format's indexing and reading is its own module
(:mod:`.jsonl`, :mod:`.text`, :mod:`.parquet`, :mod:`.arrow`); finding the files is
:mod:`.resolve`; the metadata cache and pickling are :mod:`.cache`.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._scan import LRU
from .arrow import ArrowReader
from .cache import fingerprint
from .errors import BadRecord, DataError
from .jsonl import JsonJsonlReader, JsonlReader
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
from .spread import Exchange, as_exchange, index_missing
from .table import ShardTable, table_path, write_table
from .text import LineReader, Reader, TextFileReader
from .tokens import TOKEN_FORMATS, index_tokens

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
#: record modes beyond TEXT_MODES: "json" reads a JSONL/Parquet/Arrow field's value, whatever its
#: type, as JSON text (chat datasets)
_JSON_MODE = "json"
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
    ("jsonl", _JSON_MODE): JsonJsonlReader,
    ("parquet", _JSON_MODE): ParquetReader,
    ("arrow", _JSON_MODE): ArrowReader,
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
        table: str | None = None,
        fingerprint_of: bool = True,
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
        self._table_path = table  # the dataset's metadata table in the cache folder (.table)
        self._set_shards(shards)
        # (a placeholder that indexes the shards has none: its records are not counted yet)
        self.fingerprint = fingerprint(shards, format, text_field, text_mode) if fingerprint_of else ""
        self._init_runtime()

    def _init_runtime(self) -> None:
        super()._init_runtime()
        self._reader = _READERS[self.format, self.text_mode](self)
        self._table: ShardTable | None = None  # loaded on first need

    def __getstate__(self) -> dict:
        st = super().__getstate__()
        del st["_reader"], st["_table"]
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

    # -- metadata cache: one table per dataset (see .table) --------------------------------------
    def _cache_path(self, s: int) -> str | None:
        return self._table_path

    def _settings(self) -> list[str]:
        return [str(CACHE_FORMAT_VERSION), self.format, self.text_field, self.text_mode]

    def _load_table(self) -> ShardTable | None:
        """The dataset's table in the cache folder (read once per index copy), or None."""
        if self._table is None and self._table_path is not None:
            with self._lock:
                if self._table is None:
                    dtypes = {k: _dtype(k) for k in _ARRAY_KEYS}
                    self._table = ShardTable.load(self._table_path, self._settings(), dtypes)
        return self._table

    def _store_table(self, arrays: Sequence[dict[str, np.ndarray]]) -> bool:
        """Write every shard's arrays to the table; whether they are now on disk."""
        if self._table_path is None or self.cache_dir is None:
            return False
        rows = [(sp.url, sp.size, sp.version) for sp in self._specs]
        try:
            dtypes = {k: _dtype(k) for k in _ARRAY_KEYS}
            write_table(self.cache_dir, self._table_path, self._settings(), rows, arrays, dtypes)
            return True
        except OSError as e:
            warnings.warn(
                f"zephon: cannot write the index cache in '{self.cache_dir}' ({e}); "
                "keeping metadata in memory. Set ZEPHON_CACHE_DIR to a writable directory.",
                stacklevel=3,
            )
            return False

    def _store(self, s: int, arrays: dict[str, np.ndarray]) -> bool:
        return False  # shards are stored together, by _store_table

    def _load_cached(self, s: int) -> dict[str, np.ndarray] | None:
        sp = self._specs[s]
        table = self._load_table()
        if not sp.version or table is None:
            return None  # the storage reports no version: a cache entry cannot be told stale
        return table.get(sp.url, sp.size, sp.version)

    def _reload(self, s: int) -> dict[str, np.ndarray]:
        m, sp = self.shards[s], self._specs[s]
        table = self._load_table()
        a = None if table is None else table.get(sp.url, m.size_bytes, sp.version, m.num_records)
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
    if text_mode not in (*TEXT_MODES, _JSON_MODE) or (text_mode == _JSON_MODE and format == "text"):
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


def _prepare_all(
    idx: DatasetIndex, progress: bool | None, exchange: Exchange | None
) -> tuple[list[dict[str, np.ndarray]], bool]:
    """Every shard's arrays, in shard order, from the dataset's table where fresh, the others
    indexed (by threads; over the ranks with ``exchange``); the table is rewritten when any
    shard was indexed, or it holds other shards. And whether all are in the table on disk."""
    n = len(idx._specs)
    table = idx._load_table()
    have: dict[int, dict[str, np.ndarray]] = {}
    for s in range(n):
        a = idx._load_cached(s)
        if a is not None:
            have[s] = a
    missing = [s for s in range(n) if s not in have]
    built = index_missing(
        idx._build_arrays, have, missing, _ARRAY_KEYS, exchange=exchange, progress=progress, desc=idx.name
    )
    have.update((s, {k: v.astype(_dtype(k), copy=False) for k, v in a.items()}) for s, a in built.items())
    arrays = [have[s] for s in range(n)]
    stale = table is None or bool(missing) or table.urls != {sp.url for sp in idx._specs}
    if exchange is None or exchange.world <= 1:
        return arrays, (idx._store_table(arrays) if stale else True)
    # every rank takes the same turns (each all_gather is a collective): rank 0 writes first, so
    # a cache folder the ranks share is written once; a rank whose folder still lacks the table
    # after it (a node-local folder) writes its own
    if not any(exchange.all_gather(stale)):
        return arrays, True
    stored = idx._store_table(arrays) if exchange.rank == 0 and stale else not stale
    exchange.all_gather(None)
    if exchange.rank != 0 and stale:
        idx._table = None
        fresh = idx._load_table()
        stored = fresh is not None and all(fresh.get(sp.url, sp.size, sp.version) is not None for sp in idx._specs)
        stored = stored or idx._store_table(arrays)
    return arrays, stored


def _placeholder(
    name: str,
    path: Any,
    fmt: str,
    text_field: str,
    text_mode: str,
    specs: list[ShardSpec],
    cache_dir: str | None,
    limit: int,
) -> DatasetIndex:
    """The index that indexes the shards (no records counted yet), with its table's path."""
    table = None
    if cache_dir is not None:
        entries = [os.fspath(p) for p in ([path] if isinstance(path, (str, os.PathLike)) else path)]
        table = table_path(cache_dir, entries, [fmt, text_field, text_mode], _ARRAY_KEYS)
    shards = [ShardMeta(sp.display, 0, sp.size, sp.version) for sp in specs]
    return DatasetIndex(
        name, fmt, text_field, text_mode, specs, shards, cache_dir, {}, [], limit, table=table, fingerprint_of=False
    )


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
    group: Any = None,
    dtype: str | None = None,
) -> DatasetIndex:
    """Find the shards of dataset ``name`` and build (or load cached) per-shard metadata.

    ``path``: a path, glob, folder, fsspec URL (``memory://``, ``s3://``, ``gs://``, ``hf://``
    with the backend installed), or a list of those. A folder written by Hugging Face
    ``save_to_disk`` (it has ``state.json``) is read as ``format="arrow"``.
    ``format``: "auto" (from the extensions), "jsonl", "parquet", "text" or "arrow"; "tokens",
    "megatron" or "mds" index pretokenized files instead (:func:`~zephon.data.datasets.tokens.index_tokens`;
    ``text_field`` then names an MDS token column).
    Compression (.gz, .zst, .zstd) of jsonl/text files follows the extension.
    ``text_mode`` (format "text"): "line" = one document per non-blank line, "file" = one per file.
    ``cache_dir``: where the metadata table is cached (default ``$ZEPHON_CACHE_DIR`` or
    ``~/.cache/zephon/index``).
    ``max_record_bytes``: the per-record size limit; a larger record reads back as a
    :class:`BadRecord` naming its file and line, without its bytes being read.
    ``same_file``: "once" reads a file reached through several paths (symlinks) once, from its
    first path in sorted order; "each" reads every path.
    ``empty``: an empty or whitespace-only text is a "document" (data: its BOS/EOS) or a "bad"
    record (an empty file has no record either way).
    ``group``: spread the indexing over the ranks of a job: a ``torch.distributed`` process
    group, ``"world"`` (the default group) or an :class:`~zephon.data.datasets.spread.Exchange`;
    each rank indexes a slice of the shards the cache lacks and the slices are exchanged (the
    index is the one a single process builds). Every rank of the group must call it (a collective).
    ``dtype`` (format "tokens"): the id width of raw ``.bin`` token files, which do not state it.
    """
    if format in TOKEN_FORMATS:  # pretokenized: token files, memory-mapped (see .tokens)
        column = None if text_field == "text" else text_field  # MDS: the token column
        kw = {"dtype": dtype} if dtype is not None else {}
        return index_tokens(  # type: ignore[return-value]
            name, path, format, max_record_bytes=max_record_bytes, same_file=same_file, column=column, **kw
        )
    if empty not in EMPTY:
        raise DataError(f"unknown empty = {empty!r}", dataset=name, fix=f"Use one of {EMPTY}.")
    _check_settings(name, format, text_field, text_mode)
    files = resolve_files(name, path, format)
    fmt, comps = pick_format(name, files, format)
    if (fmt, text_mode) not in _READERS:
        raise DataError(
            f"format {fmt!r} has no records of {text_mode!r}", dataset=name, fix="Use JSONL, Parquet or Arrow files."
        )
    specs = shard_specs(name, files, comps, same_file)
    cache_dir = open_cache_dir(cache_dir)

    # a placeholder index (no records yet) does the indexing, then takes the records' counts
    idx = _placeholder(name, path, fmt, text_field, text_mode, specs, cache_dir, max_record_bytes)
    arrays, cached = _prepare_all(idx, progress, as_exchange(group))
    shards = []
    for s, (sp, a) in enumerate(zip(specs, arrays)):
        for v in a.values():
            v.flags.writeable = False
        idx._arrays[s] = a
        version = sp.version or content_version(a)  # no version from the storage: the content's
        shards.append(ShardMeta(sp.display, int(len(a["lengths"])), sp.size, version))
    idx._cached = [cached] * len(specs)
    idx._set_shards(shards)
    idx.fingerprint = fingerprint(shards, fmt, text_field, text_mode)
    idx.empty_ok = empty == "document"
    return idx
