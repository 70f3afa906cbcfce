"""Where a dataset's files are: paths, globs, folders, fsspec URLs and Hugging Face
``save_to_disk`` folders expanded into shard files, each file's format and compression decided
(text and image-text formats alike), and the file's identity (size and version) taken.

A ``save_to_disk`` folder's ``state.json`` may only name files inside the folder
(:func:`resolve_files` refuses absolute names, ``..`` and symlinks out of it).
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import DataError
from .retry import bound_retries, storage_failure, storage_options, with_retries

__all__ = [
    "FORMATS",
    "MM_FORMATS",
    "SAME_FILE",
    "ShardMeta",
    "ShardSpec",
    "default_cache_dir",
    "mm_shard_specs",
    "open_cache_dir",
    "pick_format",
    "pick_mm_format",
    "resolve_files",
    "shard_specs",
    "stat_spec",
]

#: how a file reached through several paths (a symlink and its target, matched by one glob or
#: two) is read: "each" path (data version 1), or "once" (the first path in sorted order)
SAME_FILE = ("each", "once")

#: the text formats
FORMATS = ("jsonl", "parquet", "text", "arrow")
#: the image-text formats: WebDataset-style tar shards, Parquet, JSON Lines (chat records only)
MM_FORMATS = ("wds", "parquet", "jsonl")

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
    "Last-Modified",
    "last_modified",
    "updated",
    "modified",
    "created",
)
_FORMAT_FIX = 'Set format = "jsonl" (or "parquet", "text", "arrow") for this dataset in the recipe'


@dataclass(frozen=True)
class ShardMeta:
    """One shard as the plan sees it: its file, record count and identity (size and version)."""

    path: str  # local path, or fsspec URL for remote files
    num_records: int
    size_bytes: int  # size of the file as stored (compressed size for .gz/.zst); -1 if unknown
    version: str  # mtime (ns) for local files; etag/mtime/... as reported by fsspec otherwise


@dataclass
class ShardSpec:
    """How to reach one shard file: its file system, path, URL (the cache key), display name,
    whole-file compression and identity (checked before every read of a local file)."""

    fs: Any
    fspath: str
    url: str
    display: str
    local: bool
    compression: str | None
    size: int
    version: str
    image_text: bool = False  # its remote version is the first of mtime / ETag (:func:`mm_shard_specs`)


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


#: the names of zephon's own cache files (index caches, lane step counts, their temporary and lock
#: files): never data, even where the cache folder lies inside a dataset's folder or glob
_OWN_FILE = re.compile(r"^(?:(?:mm-)?[0-9a-f]{64}\.npz|lane_steps-[0-9a-f]{32}\.json)(?:\..*)?$")


def _own_file(path: str) -> bool:
    """Whether ``path`` is one of zephon's cache files (by name).

    >>> _own_file("/c/" + "ab" * 32 + ".npz"), _own_file("lane_steps-" + "0" * 32 + ".json.lock"), _own_file("a.npz")
    (True, True, False)
    """
    return bool(_OWN_FILE.match(path.rstrip("/").rsplit("/", 1)[-1]))


def _remote(name: str, entry: str, what: str, fn):
    """``fn()`` on the storage of ``entry``, transient faults retried (a DataError naming the entry
    when they persist, or on another HTTP error)."""

    def fail(why: str) -> DataError:
        return DataError(
            f"{what} failed: the storage kept failing ({why})",
            dataset=name,
            file=entry,
            fix="Check that the server is up and reachable; raise $ZEPHON_IO_RETRY_S (seconds of retries) or "
            "$ZEPHON_IO_TIMEOUT_S (seconds one request may stall) to wait longer.",
        )

    try:
        return with_retries(fn, fail)
    except Exception as e:
        why = storage_failure(e)
        if why is None:
            raise
        raise DataError(
            f"{what} failed: {why}", file=entry, fix="Check the URL and the server's permissions."
        ) from None


def _version_of(info: dict) -> str:
    for k in _VERSION_KEYS:
        v = info.get(k)
        if v not in (None, ""):
            if isinstance(v, _dt.datetime):
                v = v.timestamp()
            return f"{k}:{v}"
    return ""


def _mm_version(info: dict) -> str:
    return str(info.get("mtime") or info.get("ETag") or "")


def default_cache_dir() -> str:
    """Where dataset indexes (and a finite recipe's per-lane step counts) are cached when a
    recipe sets no ``cache_dir``: ``$ZEPHON_CACHE_DIR``, else ``~/.cache/zephon/index``."""
    env = os.environ.get("ZEPHON_CACHE_DIR")
    return env if env else os.path.join(os.path.expanduser("~"), ".cache", "zephon", "index")


_default_cache_dir = default_cache_dir


def open_cache_dir(cache_dir: str | None, *, warn: bool = True) -> str | None:
    """The index cache folder to use (``cache_dir``, else :func:`default_cache_dir`), created;
    None (nothing cached) where it cannot be created, with a warning if ``warn``."""
    if cache_dir is None:
        cache_dir = default_cache_dir()
    if not warn:  # the image-text index: as given, silently uncached where it cannot be made
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError:
            return None
        return cache_dir
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else None
    if cache_dir:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            warnings.warn(
                f"zephon: cannot create the index cache directory '{cache_dir}' ({e}); "
                "metadata will not be cached. Set ZEPHON_CACHE_DIR to a writable directory.",
                stacklevel=3,
            )
            cache_dir = None
    return cache_dir


def resolve_files(name: str, path, fmt: str) -> list[tuple[Any, str, dict, str | None]]:
    """Expand a dataset's globs, folders and URLs into its files: ``[(fs, fspath, info, forced_format)]``
    (shared by the text and image-text indexes)."""
    out: list[tuple[Any, str, dict, str | None]] = []
    for entry in _entries(name, path):
        try:
            fs, p = fsspec.core.url_to_fs(entry, **storage_options(entry))
            bound_retries(fs)
        except (ImportError, ValueError) as e:
            raise DataError(
                f"cannot open the file system for '{entry}': {e}",
                dataset=name,
                fix="Install the fsspec backend for this URL scheme (e.g. s3fs, gcsfs, huggingface_hub).",
            ) from None
        disp = lambda q, fs=fs: q if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(q)  # noqa: E731
        if any(c in p for c in "*?["):
            out.extend(_expand_pattern(name, entry, fs, p, fmt, disp))
        else:
            out.extend(_expand_path(name, entry, fs, p, fmt, disp))
    return out


def _entries(name: str, path: Any) -> list[str]:
    """A dataset's ``path`` as a non-empty list of strings, or an error saying what to give."""
    if isinstance(path, (str, os.PathLike)):
        return [os.fspath(path)]
    if isinstance(path, (list, tuple)):
        entries = [os.fspath(p) for p in path]
        if not entries:
            raise DataError("the path list is empty", dataset=name, fix="Give at least one path or glob.")
        return entries
    raise DataError(
        f"path must be a string or a list of strings, got {type(path).__name__}",
        dataset=name,
        fix="Give a path, a glob, an fsspec URL, or a list of those.",
    )


def _expand_pattern(
    name: str, entry: str, fs: Any, p: str, fmt: str, disp: Callable[[str], str]
) -> list[tuple[Any, str, dict, str | None]]:
    """The files a glob matches (zephon's own cache files left out; a saved Arrow folder gives its
    files); a pattern that matches nothing is an error naming it."""
    try:
        matches = _remote(name, entry, "listing", lambda: fs.glob(p, detail=True))
    except PermissionError as e:
        raise DataError(
            f"permission denied while expanding the pattern '{entry}' ({e})",
            dataset=name,
            fix="Make the directories readable by the user running the job.",
        ) from None
    out: list[tuple[Any, str, dict, str | None]] = []
    n = 0
    for mp, info in sorted(matches.items()):
        if _own_file(mp):
            continue
        if info.get("type") == "directory":
            if fs.exists(mp.rstrip("/") + "/state.json"):
                got = _arrow_folder(name, fs, mp, fmt, disp)
                out.extend(got)
                n += len(got) or 1
            continue
        _check_link(name, fs, mp, info)
        out.append((fs, mp, info, None))
        n += 1
    if n == 0:
        raise DataError(
            f"the path pattern '{entry}' matched no files",
            dataset=name,
            fix="Check the pattern (and the working directory, for relative paths); "
            "quote it so the shell does not expand it.",
        )
    return out


def _expand_path(
    name: str, entry: str, fs: Any, p: str, fmt: str, disp: Callable[[str], str]
) -> list[tuple[Any, str, dict, str | None]]:
    """One file, or a folder's files; a missing or unreadable path is an error naming it."""
    try:
        info = _remote(name, entry, "looking up", lambda: fs.info(p))
    except FileNotFoundError:
        if isinstance(fs, LocalFileSystem) and os.path.islink(p):
            _check_link(name, fs, p, {"islink": True})
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
    except OSError as e:
        if isinstance(fs, LocalFileSystem) and os.path.islink(p):
            _check_link(name, fs, p, {"islink": True})
        raise DataError(f"cannot read ({e})", dataset=name, file=entry, fix="Check the path.") from None
    if info.get("type") == "directory":
        return list(_expand_dir(name, fs, p, fmt, disp))
    _check_link(name, fs, p, info)
    return [(fs, p, info, None)]


def _check_link(name: str, fs: Any, fp: str, info: dict) -> None:
    """A local symlink must lead to a file: a dangling link or a loop is an error naming it."""
    if not (isinstance(fs, LocalFileSystem) and info.get("islink")):
        return
    try:
        os.stat(fp)
    except OSError as e:
        what = (
            "a symlink loop (the links lead back to themselves)"
            if e.errno == errno.ELOOP
            else f"a dangling symlink (its target {os.readlink(fp)!r} does not exist)"
        )
        raise DataError(what, dataset=name, file=fp, fix="Fix or remove the link, or narrow the path.") from None


def _read_once(specs: list[ShardSpec]) -> list[ShardSpec]:
    """``specs`` (sorted by display name) less the later paths of a local file already listed
    (a symlink and its target, two links to one file): each file is read once, from its first
    path in sorted order."""
    seen: set[str] = set()
    out = []
    dirs: dict[str, str] = {}
    for sp in specs:
        real = _realpath(sp.fspath, dirs) if sp.local else sp.url
        if real not in seen:
            seen.add(real)
            out.append(sp)
    return out


def _realpath(path: str, dirs: dict[str, str]) -> str:
    """``os.path.realpath(path)``, with the real path of each folder found once (in ``dirs``):
    a file that is not a symlink is its folder's real path joined with its name. (Why: realpath
    stats every component of every path, 0.1-0.2 ms a shard, 10-20 s at 100,000 shards.)

    >>> _realpath("/usr/../usr/bin", {}) == os.path.realpath("/usr/bin")
    True
    """
    folder, base = os.path.split(path)
    if base in ("", ".", "..") or os.path.islink(path):
        return os.path.realpath(path)
    real = dirs.get(folder)
    if real is None:
        real = dirs[folder] = os.path.realpath(folder)
    return os.path.join(real, base)


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
        if info.get("type") != "directory"
        and not fp[len(base) :].lstrip("/").split("/")[-1].startswith((".", "_"))
        and not _own_file(fp)
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


def pick_format(name: str, files, fmt: str) -> tuple[str, list[str | None]]:
    """A text dataset's format (``fmt``, or from the extensions for "auto") and each file's
    compression; refuses mixed or unknown extensions and whole-file compressed columnar files."""
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


def pick_mm_format(name: str, files, fmt: str) -> str:
    """An image-text dataset's format: ``fmt``, or from the extensions (``.tar``: wds, ``.jsonl``) for "auto"."""
    exts = set()
    for _fs, fp, _info, _forced in files:
        ext = fp.lower().rsplit(".", 1)[-1]
        exts.add({"tar": "wds", "ndjson": "jsonl"}.get(ext, ext))
    if fmt == "auto":
        if len(exts) != 1 or next(iter(exts)) not in MM_FORMATS:
            raise DataError(
                f"cannot infer the image-text format from the file extensions {sorted(exts)}",
                dataset=name,
                fix='Use .tar (WebDataset), .parquet or .jsonl shards, or set format = "wds" / "parquet" / "jsonl".',
            )
        return next(iter(exts))
    if fmt not in MM_FORMATS:
        raise DataError(
            f"format {fmt!r} is not an image-text format",
            dataset=name,
            fix='Set format = "wds" (tar shards), "parquet", "jsonl" (chat records) or "auto" for this dataset.',
        )
    return fmt


def stat_spec(sp: ShardSpec) -> tuple[int, str]:
    """(size, version) of a shard file now (to tell whether it changed since it was indexed)."""
    if sp.local:
        st = os.stat(sp.fspath)
        return st.st_size, str(st.st_mtime_ns)
    info = sp.fs.info(sp.fspath)
    if sp.image_text:
        return int(info.get("size") or -1), _mm_version(info)
    size = info.get("size")
    return (int(size) if size is not None else -1), _version_of(info)


def _local_identity(name: str, fp: str, display: str) -> tuple[int, str]:
    """(size, mtime ns) of a local text shard, refused unless it is readable."""
    try:
        st = os.stat(fp)
    except OSError as e:
        raise DataError(
            f"cannot stat the file ({type(e).__name__}: {e})",
            dataset=name,
            file=display,
            fix="Check the path and its permissions.",
        ) from None
    if not os.access(fp, os.R_OK):
        raise DataError(
            "permission denied (the file is not readable)",
            dataset=name,
            file=display,
            fix=f"Make the file readable by the user running the job (e.g. chmod a+r '{fp}'), "
            "or remove it from the dataset's path list in the recipe.",
        )
    return st.st_size, str(st.st_mtime_ns)


def shard_specs(name: str, files, comps: list[str | None], same_file: str = "each") -> list[ShardSpec]:
    """The text shards of resolved ``files`` (with their compressions), each path once (each
    file once with ``same_file = "once"``), sorted by display name (the shard order)."""
    by_url: dict[str, ShardSpec] = {}
    for (fs, fp, info, _forced), comp in zip(files, comps):
        local = isinstance(fs, LocalFileSystem)
        display = fp if local else fs.unstrip_protocol(fp)
        url = fs.unstrip_protocol(fp)
        if url in by_url:
            continue  # the same file matched twice
        if local:
            size, version = _local_identity(name, fp, display)
        else:
            sz = info.get("size")
            size, version = (int(sz) if sz is not None else -1), _version_of(info)
        by_url[url] = ShardSpec(fs, fp, url, display, local, comp, size, version)
    out = sorted(by_url.values(), key=lambda sp: sp.display)
    return _read_once(out) if same_file == "once" else out


def mm_shard_specs(files, same_file: str = "each") -> list[ShardSpec]:
    """The image-text shards of resolved ``files``, each path once (each file once with
    ``same_file = "once"``), sorted by display name. (Their remote version is the first of
    mtime / ETag: it is part of the cache key and fingerprint.)"""
    by_display: dict[str, ShardSpec] = {}
    for fs, fp, info, _forced in files:
        local = isinstance(fs, LocalFileSystem)
        disp = fp if local else fs.unstrip_protocol(fp)
        if local:
            st = os.stat(fp)
            size, version = int(st.st_size), str(st.st_mtime_ns)
        else:
            size, version = int(info.get("size") or -1), _mm_version(info)
        by_display[disp] = ShardSpec(fs, fp, fs.unstrip_protocol(fp), disp, local, None, size, version, True)
    out = [by_display[k] for k in sorted(by_display)]
    return _read_once(out) if same_file == "once" else out
