"""Per-shard metadata (record counts, sizes, offsets) and random-access reads of text records.

This layer does no shuffling or planning. It answers: how many records, how big is each, and
"give me records i, j, k of shard s".
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import json
import os
import sys
import tempfile
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ._scan import BOM, LRU, CompressionError, LineScanner, iter_decompressed, line_number
from .errors import BadRecord, DataError

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES",
    "FORMATS",
    "TEXT_MODES",
    "DatasetIndex",
    "ShardMeta",
    "default_cache_dir",
    "index_dataset",
    "resolve_files",
]

FORMATS = ("jsonl", "parquet", "text", "arrow")
#: the per-record size limit unless a recipe sets max_record_bytes: larger records are bad records
#: (an error naming file and line, or a counted skip), read neither at indexing nor at run time
DEFAULT_MAX_RECORD_BYTES = 32 << 20
#: an Arrow IPC stream ends with this end-of-stream marker (continuation token, length 0); a file
#: cut at a message boundary reads as a shorter valid stream without it
_ARROW_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
TEXT_MODES = ("line", "file")
CACHE_FORMAT_VERSION = 1
_ARRAY_KEYS = ("offsets", "lengths", "gap_rec", "gap_cum", "groups")

# read coalescing for plain (seekable) files: neighbouring records closer than _GAP bytes are
# fetched with one read, up to _MAX_SPAN bytes per read.
_GAP = 64 << 10
_MAX_SPAN = 8 << 20

_EXT_FORMAT = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",  # C4 & co ship JSON Lines as .json(.gz)
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".arrow": "arrow",
}
_EXT_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_VERSION_KEYS = (
    "ETag",
    "etag",
    "md5Hash",
    "blob_id",
    "generation",
    "mtime",
    "LastModified",
    "last_modified",
    "updated",
    "modified",
    "created",
)
_FORMAT_FIX = 'Set format = "jsonl" (or "parquet", "text", "arrow") for this dataset in the recipe'


@dataclass(frozen=True)
class ShardMeta:
    path: str  # local path, or fsspec URL for remote files
    num_records: int
    size_bytes: int  # size of the file as stored (compressed size for .gz/.zst); -1 if unknown
    version: str  # mtime (ns) for local files; etag/mtime/... as reported by fsspec otherwise


@dataclass
class _Spec:
    """Private: how to reach one shard."""

    fs: Any
    fspath: str
    url: str
    display: str
    local: bool
    compression: str | None
    size: int
    version: str


# ----------------------------------------------------------------------------------------------
# helpers


def _ext_info(path: str) -> tuple[str | None, str | None]:
    """(format guessed from the extension or None, compression or None)."""
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    comp = None
    for ext, c in _EXT_COMPRESSION.items():
        if name.endswith(ext):
            comp, name = c, name[: -len(ext)]
            break
    dot = name.rfind(".")
    return (_EXT_FORMAT.get(name[dot:]) if dot > 0 else None), comp


def _version_of(info: dict) -> str:
    for k in _VERSION_KEYS:
        v = info.get(k)
        if v not in (None, ""):
            if isinstance(v, _dt.datetime):
                v = v.timestamp()
            return f"{k}:{v}"
    return ""


def default_cache_dir() -> str:
    """Where dataset indexes (and a finite recipe's per-lane step counts) are cached when a
    recipe sets no ``cache_dir``: ``$ZEPHON_CACHE_DIR``, else ``~/.cache/zephon/index``."""
    env = os.environ.get("ZEPHON_CACHE_DIR")
    return env if env else os.path.join(os.path.expanduser("~"), ".cache", "zephon", "index")


_default_cache_dir = default_cache_dir


def _cache_key(url: str, fmt: str, text_field: str, text_mode: str) -> str:
    blob = json.dumps([url, fmt, text_field, text_mode], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _empty_arrays() -> dict[str, np.ndarray]:
    return {k: np.zeros(0, np.int64) for k in _ARRAY_KEYS}


def _is_text_type(t) -> bool:
    import pyarrow as pa

    checks = [pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary]
    for name in ("is_string_view", "is_binary_view"):
        if hasattr(pa.types, name):
            checks.append(getattr(pa.types, name))
    return any(c(t) for c in checks)


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _utf8_reason(raw: bytes, e: UnicodeDecodeError, where: str) -> str:
    return f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start} of the {where})"


def _check_text(text: str, what: str) -> str | None:
    if not text or text.isspace():
        return f"{what} is empty" if not text else f"{what} is empty (whitespace only)"
    return None


def _parse_jsonl(raw: bytes, field: str) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason)."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, _utf8_reason(raw, e, "line")
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg} (column {e.colno})"
    except RecursionError:
        return None, "invalid JSON: nested too deeply"
    if not isinstance(obj, dict):
        return None, f"the line is valid JSON but {_json_type(obj)}, not an object"
    if field not in obj:
        keys = list(obj)[:8]
        shown = ", ".join(repr(k) for k in keys) + (", ..." if len(obj) > 8 else "")
        return None, f"missing field '{field}' (fields present: {shown or 'none'})"
    v = obj[field]
    if v is None:
        return None, f"field '{field}' is null"
    if not isinstance(v, str):
        return None, f"field '{field}' is {_json_type(v)}, not a string"
    bad = _check_text(v, f"field '{field}'")
    if bad:
        return None, bad
    # lone surrogates can only come from \\u escapes (raw was valid UTF-8); isascii() is O(1)
    if not v.isascii() and b"\\u" in raw:
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            return None, f"field '{field}' contains an unpaired surrogate escape (\\u{ord(v[e.start]):04x})"
    return v, None


def _parse_text_line(raw: bytes) -> tuple[str | None, str | None]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, _utf8_reason(raw, e, "line")


def _parse_text_file(raw: bytes) -> tuple[str | None, str | None]:
    if raw.startswith(BOM):
        raw = raw[3:]
    try:
        t = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, _utf8_reason(raw, e, "file")
    bad = _check_text(t, "the file")
    return (None, bad) if bad else (t, None)


# ----------------------------------------------------------------------------------------------
# path resolution


def resolve_files(name: str, path, fmt: str) -> list[tuple[Any, str, dict, str | None]]:
    """Expand a dataset's globs, folders and URLs into its files: ``[(fs, fspath, info, forced_format)]``
    (shared by the text and image-text indexes)."""
    if isinstance(path, (str, os.PathLike)):
        entries = [os.fspath(path)]
    elif isinstance(path, (list, tuple)):
        entries = [os.fspath(p) for p in path]
        if not entries:
            raise DataError("the path list is empty", dataset=name, fix="Give at least one path or glob.")
    else:
        raise DataError(
            f"path must be a string or a list of strings, got {type(path).__name__}",
            dataset=name,
            fix="Give a path, a glob, an fsspec URL, or a list of those.",
        )
    out: list[tuple[Any, str, dict, str | None]] = []
    for entry in entries:
        try:
            fs, p = fsspec.core.url_to_fs(entry)
        except (ImportError, ValueError) as e:
            raise DataError(
                f"cannot open the file system for '{entry}': {e}",
                dataset=name,
                fix="Install the fsspec backend for this URL scheme (e.g. s3fs, gcsfs, huggingface_hub).",
            ) from None
        disp = lambda q, fs=fs: q if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(q)  # noqa: E731
        if any(c in p for c in "*?["):
            try:
                matches = fs.glob(p, detail=True)
            except PermissionError as e:
                raise DataError(
                    f"permission denied while expanding the pattern '{entry}' ({e})",
                    dataset=name,
                    fix="Make the directories readable by the user running the job.",
                ) from None
            n = 0
            for mp, info in sorted(matches.items()):
                if info.get("type") == "directory":
                    if fs.exists(mp.rstrip("/") + "/state.json"):
                        got = _arrow_folder(name, fs, mp, fmt, disp)
                        out.extend(got)
                        n += len(got) or 1
                    continue
                out.append((fs, mp, info, None))
                n += 1
            if n == 0:
                raise DataError(
                    f"the path pattern '{entry}' matched no files",
                    dataset=name,
                    fix="Check the pattern (and the working directory, for relative paths); "
                    "quote it so the shell does not expand it.",
                )
            continue
        try:
            info = fs.info(p)
        except FileNotFoundError:
            raise DataError(
                "file not found",
                dataset=name,
                file=entry,
                fix="Check the path (relative paths are resolved from the working directory "
                f"'{os.getcwd()}'), or remove it from the dataset's path list in the recipe.",
            ) from None
        except PermissionError as e:
            raise DataError(
                f"permission denied ({e})",
                dataset=name,
                file=entry,
                fix="Make the file and its directories readable by the user running the job.",
            ) from None
        if info.get("type") == "directory":
            out.extend(_expand_dir(name, fs, p, fmt, disp))
        else:
            out.append((fs, p, info, None))
    return out


def _expand_dir(name, fs, p, fmt, disp):
    base = p.rstrip("/")
    if fs.exists(base + "/state.json"):
        return _arrow_folder(name, fs, p, fmt, disp)
    if fs.exists(base + "/dataset_dict.json"):
        try:
            with fs.open(base + "/dataset_dict.json", "rb") as f:
                splits = json.load(f).get("splits", [])
        except Exception:
            splits = []
        eg = f"'{disp(base)}/{splits[0]}'" if splits else f"'{disp(base)}/train'"
        raise DataError(
            f"this is a Hugging Face DatasetDict folder with splits {splits}, not a single dataset",
            dataset=name,
            file=disp(base),
            fix=f"Point path at one split folder, e.g. {eg}.",
        )
    found = fs.find(p, detail=True)
    files = [
        (fs, fp, info, None)
        for fp, info in sorted(found.items())
        if info.get("type") != "directory" and not fp[len(base) :].lstrip("/").split("/")[-1].startswith((".", "_"))
    ]
    if not files:
        raise DataError(
            "the directory contains no data files",
            dataset=name,
            file=disp(base),
            fix="Check the path, or use a glob such as 'dir/*.jsonl'.",
        )
    return files


def _arrow_folder(name, fs, folder, fmt, disp):
    base = folder.rstrip("/")
    if fmt not in ("auto", "arrow"):
        raise DataError(
            f'this is a Hugging Face save_to_disk folder (it has state.json) but format = "{fmt}"',
            dataset=name,
            file=disp(base),
            fix='Set format = "arrow" (or "auto") for this dataset in the recipe.',
        )
    try:
        with fs.open(base + "/state.json", "rb") as f:
            state = json.load(f)
        names = [d["filename"] for d in state["_data_files"]]
        if not all(isinstance(n, str) and n for n in names):
            raise ValueError("a filename is not a non-empty string")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"cannot read the file list from state.json ({type(e).__name__}: {e})",
            dataset=name,
            file=disp(base + "/state.json"),
            fix="Re-save the dataset with `datasets.Dataset.save_to_disk`, or point path at the .arrow files.",
        ) from None
    out = []
    for fn in names:
        fp = _confined(name, fs, base, fn, disp)
        try:
            info = fs.info(fp)
        except FileNotFoundError:
            raise DataError(
                "listed in state.json but missing",
                dataset=name,
                file=disp(fp),
                fix="Re-save or re-copy the whole dataset folder.",
            ) from None
        out.append((fs, fp, info, "arrow"))
    return out


def _confined(name: str, fs, base: str, fn: str, disp) -> str:
    """The path of a file that a folder's ``state.json`` lists, refused unless it lies inside the
    folder: no absolute name, no ``..``, and (local folders) no symlink resolving outside it. A
    dataset folder cannot make zephon read files elsewhere on the machine."""
    parts = fn.replace("\\", "/").split("/")
    if fn.startswith(("/", "\\")) or "://" in fn or (len(fn) > 1 and fn[1] == ":") or ".." in parts:
        raise DataError(
            f"state.json lists {fn!r}, which is outside the dataset folder (absolute, or with '..')",
            dataset=name,
            file=disp(base + "/state.json"),
            fix="A save_to_disk folder lists its own files by bare name; re-save the dataset, or point path at "
            "the .arrow files themselves.",
        )
    fp = f"{base}/{fn}"
    if isinstance(fs, LocalFileSystem):
        root = os.path.realpath(base)
        real = os.path.realpath(fp)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise DataError(
                f"state.json lists {fn!r}, which resolves to {real!r}, outside the dataset folder (a symlink?)",
                dataset=name,
                file=disp(base + "/state.json"),
                fix="Copy the file into the dataset folder instead of linking it, or point path at the files.",
            )
    return fp


def _pick_format(name: str, files, fmt: str) -> tuple[str, list[str | None]]:
    """Decide the dataset's format; return (format, per-file compression)."""
    comps: list[str | None] = []
    guessed: dict[str, list[str]] = {}
    unknown = []
    for _fs, fp, _info, forced in files:
        g, comp = _ext_info(fp)
        if forced:
            g, comp = forced, None
        comps.append(comp)
        if g is None:
            unknown.append(fp)
        else:
            guessed.setdefault(g, []).append(fp)
    if fmt == "auto":
        if unknown:
            raise DataError(
                f"cannot infer the format of '{unknown[0]}' from its extension",
                dataset=name,
                fix=f"{_FORMAT_FIX}, or narrow the path to the data files.",
            )
        if len(guessed) > 1:
            kinds = ", ".join(f"{k} (e.g. '{v[0]}')" for k, v in sorted(guessed.items()))
            raise DataError(
                f"ambiguous format: the path matches files of several formats: {kinds}",
                dataset=name,
                fix=f"Narrow the path pattern (e.g. 'data/*.jsonl'), or {_FORMAT_FIX[0].lower()}{_FORMAT_FIX[1:]}.",
            )
        fmt = next(iter(guessed))
    if fmt in ("parquet", "arrow"):
        for (_fs, fp, _i, _f), c in zip(files, comps):
            if c:
                raise DataError(
                    f"{fmt} files compressed as a whole ({c}) are not supported",
                    dataset=name,
                    file=fp,
                    fix=f"Decompress the file ({fmt} compresses internally), or check the format setting.",
                )
    return fmt, comps


# ----------------------------------------------------------------------------------------------
# the index


class DatasetIndex:
    """Metadata of one dataset's shards plus thread-safe random-access reads.

    ``record_bytes(s)`` is the byte size used for token-weighted mixing:
      * jsonl: the byte length of the whole JSON line (an estimate of the text size: it includes
        the other fields, quoting and escapes; computing the exact text length would need a JSON
        parse of every line at indexing time);
      * text (line mode): the line's byte length; text (file mode): the (decompressed) file size;
      * parquet / arrow: the exact UTF-8 byte length of the text column (0 for nulls).
    """

    def __init__(
        self,
        name: str,
        format: str,
        text_field: str,
        text_mode: str,
        specs: list[_Spec],
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
        self.shards = shards
        self.cache_dir = cache_dir
        self._specs = specs
        self._arrays = arrays
        self._cached = cached
        self._offsets = np.zeros(len(shards) + 1, np.int64)
        np.cumsum([m.num_records for m in shards], out=self._offsets[1:])
        self.num_records = int(self._offsets[-1])
        self.fingerprint = _fingerprint(shards, format, text_field, text_mode)
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.RLock()
        self._blobs = LRU(2)  # decompressed .gz/.zst shards (and whole remote arrow files)
        self._row_groups = LRU(8)  # parquet (shard, row group) -> text column
        self._pq_meta = LRU(64)  # parquet shard -> FileMetaData
        self._arrow_cols = LRU(32)  # arrow shard -> text column (memory-mapped when local)

    # -- pickling: drop handles and caches; metadata arrays reload lazily from the cache dir --
    def __getstate__(self) -> dict:
        st = {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("_lock", "_blobs", "_row_groups", "_pq_meta", "_arrow_cols")
        }
        st["_arrays"] = {s: a for s, a in self._arrays.items() if not self._cached[s]}
        return st

    def __setstate__(self, st: dict) -> None:
        self.__dict__.update(st)
        self._init_runtime()

    def __repr__(self) -> str:
        return (
            f"DatasetIndex(name={self.name!r}, format={self.format!r}, shards={len(self.shards)}, "
            f"num_records={self.num_records}, fingerprint={self.fingerprint[:12]}...)"
        )

    def __enter__(self) -> DatasetIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release cached decompressed shards, row groups and memory maps. Reads still work
        afterwards (they reopen what they need)."""
        for c in (self._blobs, self._row_groups, self._pq_meta, self._arrow_cols):
            c.clear()

    # -- metadata ------------------------------------------------------------------------------
    def shard_offsets(self) -> np.ndarray:
        """int64 cumulative record counts, ``len(shards) + 1`` entries, starting at 0."""
        return self._offsets.copy()

    def record_bytes(self, shard: int) -> np.ndarray:
        """int64 byte size of every record of ``shard`` (read-only array; see class doc)."""
        self._check_shard(shard)
        return self._get_arrays(shard)["lengths"]

    def locate(self, shard: int, record: int) -> dict:
        """Where a record lives: ``{"file", "locator"}`` (``line N`` 1-based for line formats,
        ``row N`` 0-based for Parquet/Arrow, ``whole file``), plus ``byte_offset`` /
        ``byte_length`` of the line in the (decompressed) file for line formats."""
        self._check_shard(shard)
        if not 0 <= record < self.shards[shard].num_records:
            raise IndexError(
                f"record {record} out of range for shard {shard} ({self.shards[shard].num_records} records)"
            )
        out: dict[str, Any] = {"file": self._specs[shard].display}
        if self.format == "jsonl" or (self.format == "text" and self.text_mode == "line"):
            a = self._get_arrays(shard)
            out["locator"] = f"line {line_number(a['gap_rec'], a['gap_cum'], record)}"
            out["byte_offset"] = int(a["offsets"][record])
            out["byte_length"] = int(a["lengths"][record])
        elif self.format == "text":
            out["locator"] = "whole file"
        else:
            out["locator"] = f"row {record}"
        return out

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
        if self.format in ("jsonl", "text"):
            return self._read_lines(shard, idx)
        if self.format == "parquet":
            return self._read_parquet(shard, idx)
        return self._read_arrow(shard, idx)

    # ------------------------------------------------------------------------------------------
    def _check_shard(self, shard: int) -> None:
        if not isinstance(shard, (int, np.integer)) or not 0 <= shard < len(self.shards):
            raise IndexError(f"dataset '{self.name}': shard {shard!r} out of range (0..{len(self.shards) - 1})")

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

    def _open(self, s: int, doing: str = "reading"):
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

    def _stream(self, s: int, doing: str):
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
    def _build_arrays(self, s: int) -> dict[str, np.ndarray]:
        sp = self._specs[s]
        arrays = _empty_arrays()
        if sp.size == 0:
            return arrays  # zero-byte shard: allowed, no records
        if self.format == "jsonl" or (self.format == "text" and self.text_mode == "line"):
            sc = LineScanner()
            for chunk in self._stream(s, "indexing"):
                sc.feed(chunk)
            arrays.update(sc.finish())
        elif self.format == "text":  # file mode: the whole file is one document
            if sp.compression:
                total = sum(len(c) for c in self._stream(s, "indexing"))
            else:
                if sp.local and not os.access(sp.fspath, os.R_OK):
                    raise self._io_error(s, PermissionError("not readable"), "indexing")
                total = sp.size
            if total > 0:
                arrays["offsets"] = np.zeros(1, np.int64)
                arrays["lengths"] = np.full(1, total, np.int64)
        elif self.format == "parquet":
            arrays.update(self._index_parquet(s))
        else:
            arrays.update(self._index_arrow(s))
        return arrays

    def _check_text_column(self, s: int, schema) -> None:
        """Refuse a Parquet/Arrow shard whose text field is missing or not a string column."""
        if schema.get_field_index(self.text_field) < 0:
            raise self._text_column_error(s, schema.names)
        typ = schema.field(self.text_field).type
        if not _is_text_type(typ):
            raise self._text_column_error(s, schema.names, typ)

    def _text_column_error(self, s: int, names: list[str], typ=None) -> DataError:
        if typ is None:
            shown = ", ".join(repr(n) for n in names[:20])
            return self._err(
                s,
                f"column '{self.text_field}' not found (columns: {shown})",
                f"Set text_field = \"<column>\" for dataset '{self.name}' in the recipe.",
            )
        return self._err(
            s,
            f"column '{self.text_field}' has type {typ}, expected a string column",
            f"Set text_field to a string column for dataset '{self.name}' in the recipe.",
        )

    @contextlib.contextmanager
    def _parquet_file(self, s: int, metadata=None):
        """Open shard s as a ParquetFile (errors mapped to DataError); closes everything after."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        sp = self._specs[s]
        fh = None if sp.local else self._open(s)
        try:
            try:
                # pages written with a CRC are verified (a corrupted page raises instead of being
                # trained on); pages without one cannot be
                pf = pq.ParquetFile(sp.fspath if sp.local else fh, metadata=metadata, page_checksum_verification=True)
            except (FileNotFoundError, PermissionError) as e:
                raise self._io_error(s, e, "reading") from None
            except (pa.ArrowException, OSError) as e:
                raise self._err(
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

    def _index_parquet(self, s: int) -> dict[str, np.ndarray]:
        import pyarrow as pa
        import pyarrow.compute as pc

        with self._parquet_file(s) as pf:
            self._check_text_column(s, pf.schema_arrow)
            md = pf.metadata
            counts = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
            lengths = []
            for rg in range(md.num_row_groups):
                try:
                    col = pf.read_row_group(rg, columns=[self.text_field]).column(0)
                except (pa.ArrowException, OSError) as e:
                    raise self._err(
                        s,
                        f"cannot read row group {rg}: {e}",
                        "Re-download or rewrite the file, or remove it from the dataset's path list.",
                    ) from None
                lengths.append(pc.binary_length(col).fill_null(0).to_numpy().astype(np.int64))
        groups = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=groups[1:])
        lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        return {"groups": groups, "lengths": lens}

    def _arrow_reader(self, s: int):
        import pyarrow as pa

        sp = self._specs[s]
        try:
            if sp.local:
                src = pa.memory_map(sp.fspath, "r")
            else:
                src = pa.BufferReader(self._blobs.get(("raw", s), lambda: sp.fs.cat_file(sp.fspath)))
        except OSError as e:
            if isinstance(e, (FileNotFoundError, PermissionError)) or not isinstance(e, pa.ArrowException):
                raise self._io_error(s, e, "reading") from None
            raise
        try:
            reader = pa.ipc.open_stream(src)
        except pa.ArrowInvalid:
            try:  # a standalone .arrow file may use the IPC *file* format (its footer is checked)
                src.seek(0)
                return pa.ipc.open_file(src)
            except pa.ArrowInvalid as e:
                raise self._err(
                    s,
                    f"not a valid Arrow IPC stream or file: {e}",
                    "Re-save the dataset (datasets.save_to_disk) or re-copy the file.",
                ) from None
        # a stream cut at a message boundary reads as a valid, shorter one: it must end with the
        # end-of-stream marker (or the 4 zero bytes of the pre-1.0 format)
        size = src.size()
        tail = bytes(src.read_at(min(8, size), max(0, size - 8))) if size else b""
        if tail != _ARROW_EOS and tail[-4:] != b"\x00\x00\x00\x00":
            raise self._err(
                s,
                f"truncated Arrow stream: the file ({size} bytes) does not end with the end-of-stream marker, so "
                "record batches after its last complete one may be missing",
                "Re-save the dataset (datasets.save_to_disk) or re-copy the file.",
            )
        return reader

    def _index_arrow(self, s: int) -> dict[str, np.ndarray]:
        import pyarrow as pa
        import pyarrow.compute as pc

        r = self._arrow_reader(s)
        self._check_text_column(s, r.schema)
        lengths = []
        try:
            batches = (
                r
                if isinstance(r, pa.ipc.RecordBatchStreamReader)
                else (r.get_batch(i) for i in range(r.num_record_batches))
            )
            for b in batches:
                col = b.column(self.text_field)
                lengths.append(pc.binary_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64))
        except pa.ArrowInvalid as e:
            raise self._err(
                s,
                f"corrupt or truncated Arrow data: {e}",
                "Re-save the dataset (datasets.save_to_disk) or re-copy the file.",
            ) from None
        return {"lengths": np.concatenate(lengths) if lengths else np.zeros(0, np.int64)}

    # -- metadata cache -------------------------------------------------------------------------
    def _cache_path(self, s: int) -> str | None:
        if not self.cache_dir:
            return None
        key = _cache_key(self._specs[s].url, self.format, self.text_field, self.text_mode)
        return os.path.join(self.cache_dir, key + ".npz")

    def _header(self, s: int, size: int, version: str, n: int | None) -> dict:
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
                arrays = {k: z[k].astype(np.int64, copy=False) for k in _ARRAY_KEYS}
            if len(arrays["lengths"]) != header["num_records"]:
                return None
            return arrays
        except FileNotFoundError:
            return None
        except Exception:  # corrupt/partial/foreign cache file: rebuild it
            return None

    def _save_cache(self, s: int, arrays: dict[str, np.ndarray]) -> bool:
        path = self._cache_path(s)
        if path is None:
            return False
        sp = self._specs[s]
        header = self._header(s, sp.size, sp.version, int(len(arrays["lengths"])))
        hb = np.frombuffer(json.dumps(header, sort_keys=True).encode("utf-8"), dtype=np.uint8)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=os.path.basename(path) + ".", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                np.savez(f, header=hb, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
            os.replace(tmp, path)  # atomic: readers see the old file or the complete new one
            return True
        except OSError as e:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            warnings.warn(
                f"zephon: cannot write the index cache in '{self.cache_dir}' ({e}); "
                "keeping metadata in memory. Set ZEPHON_CACHE_DIR to a writable directory.",
                stacklevel=3,
            )
            return False

    def _prepare(self, s: int) -> tuple[dict[str, np.ndarray], bool]:
        """Index-time: load the shard's metadata from the cache if fresh, else build and store it."""
        sp = self._specs[s]
        arrays = self._load_cache(s, sp.size, sp.version, None)
        if arrays is not None:
            return arrays, True
        arrays = self._build_arrays(s)
        return arrays, self._save_cache(s, arrays)

    def _get_arrays(self, s: int) -> dict[str, np.ndarray]:
        a = self._arrays.get(s)
        if a is not None:
            return a
        with self._lock:
            a = self._arrays.get(s)
            if a is not None:
                return a
            m = self.shards[s]
            a = self._load_cache(s, m.size_bytes, m.version, m.num_records)
            if a is None:
                # cache gone (cleaned?) or rebuilt for a newer file: rebuild only if the file is
                # still the one we indexed
                live = _stat(self._specs[s])
                if live != (m.size_bytes, m.version):
                    raise self._changed_error(s)
                a = self._build_arrays(s)
                if len(a["lengths"]) != m.num_records:
                    raise self._changed_error(s)
                self._cached[s] = self._save_cache(s, a)
            for v in a.values():
                v.flags.writeable = False
            self._arrays[s] = a
            return a

    # -- reading --------------------------------------------------------------------------------
    def _blob(self, s: int) -> bytes:
        def load() -> bytes:
            self._check_unchanged_before_read(s)
            data = b"".join(self._stream(s, "reading"))
            return data

        return self._blobs.get(s, load)

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

    def _locator(self, s: int, i: int) -> str:
        if self.format == "text" and self.text_mode == "file":
            return "whole file"
        if self.format in ("jsonl", "text"):
            a = self._get_arrays(s)
            return f"line {line_number(a['gap_rec'], a['gap_cum'], i)}"
        return f"row {i}"

    def _oversized(self, s: int, i: int, n: int) -> BadRecord:
        return BadRecord(
            self.name,
            self._specs[s].display,
            self._locator(s, i),
            f"the record is {n} bytes, more than max_record_bytes = {self.max_record_bytes} (the per-record size "
            f"limit); it was not read. Raise max_record_bytes for dataset '{self.name}' to read it",
        )

    def _read_lines(self, s: int, idx: np.ndarray) -> list[str | BadRecord]:
        a = self._get_arrays(s)
        lens = a["lengths"][idx]
        out: list[str | BadRecord | None] = [None] * idx.size
        big = np.flatnonzero(lens > self.max_record_bytes)
        for k in big.tolist():  # never read: the bytes of an oversized record are not needed
            out[k] = self._oversized(s, int(idx[k]), int(lens[k]))
        todo = np.flatnonzero(lens <= self.max_record_bytes) if big.size else np.arange(idx.size)
        if todo.size:
            sel = idx[todo]
            raws = self._read_ranges(s, a["offsets"][sel].tolist(), a["lengths"][sel].tolist())
            if self.format == "jsonl":
                field = self.text_field
                parsed = [_parse_jsonl(r, field) for r in raws]
            elif self.text_mode == "line":
                parsed = [_parse_text_line(r) for r in raws]
            else:
                parsed = [_parse_text_file(r) for r in raws]
            for k, i, (text, reason) in zip(todo.tolist(), sel.tolist(), parsed):
                if reason is None and text is not None:
                    out[k] = text
                else:
                    out[k] = BadRecord(self.name, self._specs[s].display, self._locator(s, i), reason or "unreadable")
        return out  # type: ignore[return-value]

    def _value(self, s: int, row: int, v) -> str | BadRecord:
        if isinstance(v, str):
            bad = _check_text(v, f"field '{self.text_field}'")
            if bad is None:
                return v
        elif v is None:
            bad = f"field '{self.text_field}' is null"
        else:  # binary column
            try:
                v = bytes(v).decode("utf-8")
                bad = _check_text(v, f"field '{self.text_field}'")
                if bad is None:
                    return v
            except UnicodeDecodeError as e:
                bad = _utf8_reason(bytes(v), e, "value")
        return BadRecord(self.name, self._specs[s].display, f"row {row}", bad)

    def _read_parquet(self, s: int, idx: np.ndarray) -> list[str | BadRecord]:
        import pyarrow as pa

        a = self._get_arrays(s)
        groups = a["groups"]
        out: list = [None] * idx.size
        keep = self._drop_oversized(s, idx, a["lengths"][idx], out)
        rg_of = np.searchsorted(groups, idx, side="right") - 1
        for rg in np.unique(rg_of[keep]).tolist():
            col: Any = self._row_groups.get((s, rg), functools.partial(self._load_row_group, s, rg))
            ks = keep[rg_of[keep] == rg]
            vals = col.take(pa.array(idx[ks] - groups[rg])).to_pylist()
            for k, v in zip(ks.tolist(), vals):
                out[k] = self._value(s, int(idx[k]), v)
        return out

    def _drop_oversized(self, s: int, idx: np.ndarray, lens: np.ndarray, out: list) -> np.ndarray:
        """Put a BadRecord in ``out`` for each record above the size limit; the positions left."""
        big = lens > self.max_record_bytes
        for k in np.flatnonzero(big).tolist():
            out[k] = self._oversized(s, int(idx[k]), int(lens[k]))
        return np.flatnonzero(~big)

    def _load_row_group(self, s: int, rg: int):
        import pyarrow as pa

        self._check_unchanged_before_read(s)

        def meta():
            with self._parquet_file(s) as pf:
                return pf.metadata

        md = self._pq_meta.get(s, meta)
        with self._parquet_file(s, metadata=md) as pf:
            try:
                col = pf.read_row_group(rg, columns=[self.text_field]).column(0)
            except (pa.ArrowException, OSError) as e:
                raise self._err(
                    s,
                    f"cannot read row group {rg}: {e}",
                    "Re-download or rewrite the file, or remove it from the dataset's path list.",
                ) from None
        return col.combine_chunks()

    def _read_arrow(self, s: int, idx: np.ndarray) -> list[str | BadRecord]:
        import pyarrow as pa

        def load():
            self._check_unchanged_before_read(s)
            r = self._arrow_reader(s)
            try:
                t = r.read_all()
            except pa.ArrowInvalid as e:
                raise self._err(
                    s,
                    f"corrupt or truncated Arrow data: {e}",
                    "Re-save the dataset (datasets.save_to_disk) or re-copy the file.",
                ) from None
            return t.column(self.text_field)

        out: list = [None] * idx.size
        keep = self._drop_oversized(s, idx, self._get_arrays(s)["lengths"][idx], out)
        if keep.size:
            col = self._arrow_cols.get(s, load)
            vals = col.take(pa.array(idx[keep])).to_pylist()
            for k, v in zip(keep.tolist(), vals):
                out[k] = self._value(s, int(idx[k]), v)
        return out


def _stat(sp: _Spec) -> tuple[int, str]:
    if sp.local:
        st = os.stat(sp.fspath)
        return st.st_size, str(st.st_mtime_ns)
    info = sp.fs.info(sp.fspath)
    size = info.get("size")
    return (int(size) if size is not None else -1), _version_of(info)


def _fingerprint(shards: list[ShardMeta], fmt: str, text_field: str, text_mode: str) -> str:
    rows = [[m.path, m.size_bytes, m.version, fmt, text_field, text_mode] for m in shards]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------------------------


def index_dataset(
    name: str,
    path: str | list[str],
    format: str = "auto",
    text_field: str = "text",
    text_mode: str = "line",
    cache_dir: str | None = None,
    progress: bool | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
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
    """
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

    files = resolve_files(name, path, format)
    fmt, comps = _pick_format(name, files, format)

    specs_by_url: dict[str, _Spec] = {}
    for (fs, fp, info, _forced), comp in zip(files, comps):
        local = isinstance(fs, LocalFileSystem)
        display = fp if local else fs.unstrip_protocol(fp)
        url = fs.unstrip_protocol(fp)
        if url in specs_by_url:
            continue  # the same file matched twice
        if local:
            try:
                st = os.stat(fp)
            except OSError as e:
                raise DataError(
                    f"cannot stat the file ({type(e).__name__}: {e})",
                    dataset=name,
                    file=display,
                    fix="Check the path and its permissions.",
                ) from None
            size, version = st.st_size, str(st.st_mtime_ns)
            if not os.access(fp, os.R_OK):
                raise DataError(
                    "permission denied (the file is not readable)",
                    dataset=name,
                    file=display,
                    fix=f"Make the file readable by the user running the job (e.g. chmod a+r '{fp}'), "
                    "or remove it from the dataset's path list in the recipe.",
                )
        else:
            sz = info.get("size")
            size, version = (int(sz) if sz is not None else -1), _version_of(info)
        specs_by_url[url] = _Spec(fs, fp, url, display, local, comp, size, version)
    specs = sorted(specs_by_url.values(), key=lambda sp: sp.display)

    if cache_dir is None:
        cache_dir = _default_cache_dir()
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else None
    if cache_dir:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            warnings.warn(
                f"zephon: cannot create the index cache directory '{cache_dir}' ({e}); "
                "metadata will not be cached. Set ZEPHON_CACHE_DIR to a writable directory.",
                stacklevel=2,
            )
            cache_dir = None

    placeholder = [ShardMeta(sp.display, 0, sp.size, sp.version) for sp in specs]
    idx = DatasetIndex(name, fmt, text_field, text_mode, specs, placeholder, cache_dir, {}, [False] * len(specs))

    n = len(specs)
    if progress is None:
        progress = n > 4 and sys.stderr.isatty()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc=f"indexing {name}", unit="shard")
    results: dict[int, tuple[dict, bool]] = {}
    errors: dict[int, BaseException] = {}
    workers = max(1, min(8, os.cpu_count() or 1, n))
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zephon-index") as pool:
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
    finally:
        if bar is not None:
            bar.close()
    if errors:
        raise errors[min(errors)]

    shards = []
    for s, sp in enumerate(specs):
        arrays, cached = results[s]
        for v in arrays.values():
            v.flags.writeable = False
        idx._arrays[s] = arrays
        idx._cached[s] = cached
        shards.append(ShardMeta(sp.display, int(len(arrays["lengths"])), sp.size, sp.version))
    return DatasetIndex(
        name, fmt, text_field, text_mode, specs, shards, cache_dir, idx._arrays, idx._cached, max_record_bytes
    )
