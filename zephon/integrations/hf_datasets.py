"""Hugging Face ``datasets`` objects and folders as zephon dataset sources.

zephon indexes files (random access, exactly once per epoch, any lane count), so a ``datasets``
object is read through the files behind it, never iterated: :func:`hf_source` returns the
``path`` and ``format`` of a recipe's ``[[datasets]]`` entry for

* a ``datasets.Dataset`` (``load_dataset(...)`` without streaming, ``load_from_disk``): its
  Arrow cache files; refused when it is a view (``select``, ``shuffle``, ``filter`` keep an
  indices mapping: ``flatten_indices()`` first) or lives only in memory (``save_to_disk`` first);
* a ``datasets.IterableDataset`` streamed from files (``load_dataset(..., streaming=True)``, or
  ``Dataset.to_iterable_dataset()``): the files it streams; refused when it carries
  transformations (``map``, ``filter``, ``shuffle``...), which zephon would not apply;
* a ``DatasetDict`` (with ``split``);
* a folder: a ``save_to_disk`` folder (``state.json``; a ``DatasetDict`` folder with ``split``),
  or a local hub cache folder (``~/.cache/huggingface/hub/datasets--ORG--NAME``, or one of its
  ``snapshots/REV``): the data files of ``split`` (by the hub's file naming), or all of them.

``import datasets`` is never needed here: objects are read through their attributes.

    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> os.makedirs(f"{root}/datasets--org--web/snapshots/abc/data"); os.makedirs(f"{root}/datasets--org--web/refs")
    >>> _ = open(f"{root}/datasets--org--web/refs/main", "w").write("abc")
    >>> for s in ("train", "test"):
    ...     _ = open(f"{root}/datasets--org--web/snapshots/abc/data/{s}-00000-of-00001.parquet", "wb").write(b"")
    >>> src = hf_source(f"{root}/datasets--org--web", split="train")
    >>> [os.path.relpath(p, root) for p in src["path"]], src["format"]
    (['datasets--org--web/snapshots/abc/data/train-00000-of-00001.parquet'], 'parquet')
"""

from __future__ import annotations

import os
import re
from typing import Any

import pyarrow as pa

from zephon.data import DataError

__all__ = ["hf_source"]

_EXT = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".arrow": "arrow", ".txt": "text"}
_BASE_ITERABLES = ("ArrowExamplesIterable", "ExamplesIterable", "RebatchedArrowExamplesIterable")


def _format_of(name: str, files: list[str]) -> str:
    fmts = set()
    for f in files:
        low = re.sub(r"\.(gz|zst|zstd)$", "", f.lower())
        fmts.add(next((v for k, v in _EXT.items() if low.endswith(k)), None))
    if len(fmts) != 1 or None in fmts:
        raise DataError(
            f"the files are not of one format zephon reads ({sorted(map(str, fmts))})",
            dataset=name,
            file=files[0] if files else None,
            fix="Give the data files of one format (parquet, jsonl, arrow, text).",
        )
    return str(fmts.pop())


def _files(paths: list[str]) -> dict[str, Any]:
    return {"path": paths, "format": _format_of("hf", paths)}


def _snapshot(folder: str) -> str:
    """A hub cache folder's snapshot: ``refs/main``'s revision, else the only one."""
    snaps = os.path.join(folder, "snapshots")
    ref = os.path.join(folder, "refs", "main")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            rev = f.read().strip()
        if os.path.isdir(os.path.join(snaps, rev)):
            return os.path.join(snaps, rev)
    revs = sorted(os.listdir(snaps))
    if len(revs) != 1:
        raise DataError(
            f"the hub cache folder has {len(revs)} snapshots and no refs/main",
            file=folder,
            fix="Point path at one snapshots/REV folder.",
        )
    return os.path.join(snaps, revs[0])


def _hub_files(root: str, split: str | None) -> list[str]:
    found = []
    for dirpath, dirnames, names in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for n in sorted(names):
            p = os.path.join(dirpath, n)
            if n.startswith(".") or not any(re.sub(r"\.(gz|zst|zstd)$", "", n.lower()).endswith(e) for e in _EXT):
                continue
            rel = os.path.relpath(p, root).replace(os.sep, "/")
            if split is None or re.search(rf"(^|[/_.-]){re.escape(split)}([/_.-]|$)", rel):
                found.append(p)
    if not found:
        raise DataError(
            f"no data files{f' of split {split!r}' if split else ''} in the hub cache folder",
            file=root,
            fix="Check the split name, or point path at the files.",
        )
    return found


def _folder(path: str, split: str | None) -> dict[str, Any]:
    if os.path.isfile(os.path.join(path, "state.json")):
        return {"path": path, "format": "arrow"}
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        if split is None:
            raise DataError("a DatasetDict folder", file=path, fix="Pass split='train' (or another split).")
        return _folder(os.path.join(path, split), None)
    root = _snapshot(path) if os.path.isdir(os.path.join(path, "snapshots")) else path
    return _files(_hub_files(root, split))


def _iterable(obj: Any) -> list[str]:
    ex = obj._ex_iterable
    kind = type(ex).__name__
    if kind not in _BASE_ITERABLES:
        raise DataError(
            f"this IterableDataset carries transformations ({kind}) that zephon would not apply",
            fix="Give the IterableDataset as loaded from its files (zephon tokenizes, packs and shuffles itself), "
            "or save the transformed data and point path at it.",
        )
    kw = getattr(ex, "kwargs", {}) or {}
    if kw.get("base_files"):
        return [str(p) for p in kw["base_files"]]
    shards = kw.get("shards") or []
    files = [c["filename"] for s in shards for c in getattr(s, "cache_files", [])]
    if not files or len(files) < len(shards):
        raise DataError(
            "cannot find the files this IterableDataset streams",
            fix="Load it with load_dataset(..., streaming=True) from files, or pass the files as path.",
        )
    return files


def hf_source(obj: Any, split: str | None = None) -> dict[str, Any]:
    """``{"path": ..., "format": ...}`` of a recipe dataset entry reading ``obj`` (module doc)."""
    if isinstance(obj, (str, os.PathLike)):
        return _folder(os.fspath(obj), split)
    if isinstance(obj, dict):  # a DatasetDict (a dict of splits)
        if split is None:
            raise DataError(f"a DatasetDict with splits {sorted(obj.keys())}", fix="Pass split='train' (or another).")
        return hf_source(obj[split])
    if hasattr(obj, "_ex_iterable"):
        return _files(_iterable(obj))
    if getattr(obj, "_indices", None) is not None:
        raise DataError(
            "this Dataset is a view (select / shuffle / filter keep an indices mapping over the files)",
            fix="Call ds = ds.flatten_indices() (it writes the view's rows), or save_to_disk it.",
        )
    files = [c["filename"] for c in getattr(obj, "cache_files", [])]
    if not files:
        raise DataError(
            "this Dataset has no files (it lives in memory)",
            fix="ds.save_to_disk(folder) and point path at the folder.",
        )
    rows = sum(pa.ipc.open_stream(pa.memory_map(f)).read_all().num_rows for f in files)
    if rows != obj.num_rows:  # a contiguous select / slice: a window over the files
        raise DataError(
            f"this Dataset is a view of {obj.num_rows} of its files' {rows} rows (select / slice)",
            file=files[0],
            fix="Call ds = ds.flatten_indices() or save_to_disk the view, and read that.",
        )
    return {"path": files, "format": "arrow"}
