"""Mosaic Streaming's MDS format, read for a token column (``format = "mds"``), from its layout.

``mosaicml-streaming`` itself pins torch versions zephon does not use, so it is not a
dependency: this module reads the files (and :func:`write_mds` writes them, for tests and
conversions) from the format as Streaming's ``MDSWriter`` and its encodings define it:

* ``index.json``: ``{"version": 2, "shards": [...]}``, each shard with ``format = "mds"``,
  ``column_names`` / ``column_encodings`` / ``column_sizes`` (sorted by name; a size is null for
  a variable-size column), ``samples``, ``raw_data.basename``, ``compression`` (null) ...
* a shard file: uint32 sample count, uint32 byte offsets ``[count + 1]`` (from the file's start),
  the shard's config JSON, then the samples; a sample is the uint32 sizes of its variable-size
  columns followed by every column's bytes, in column order.
* the token column's encoding: ``ndarray`` (its bytes: a dtype code byte when the encoding names
  none, then ``ndim << 2 | shape-width`` and the shape when it names no shape, then the ids), or
  ``ndarray:DTYPE`` / ``ndarray:DTYPE:SHAPE``. ``bytes`` columns record no id width and are refused.

Only uncompressed shards are memory-mapped (``compression`` null); compressed ones are refused.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterable, Sequence

import numpy as np

from .errors import DataError

__all__ = ["MDS_DTYPES", "mds_shards", "write_mds"]

#: Streaming's NDArray value dtype codes (integers only: ids)
MDS_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 32: "uint32", 33: "int32", 64: "uint64", 65: "int64"}
_SHAPE_WIDTH = {0: 1, 1: 2, 2: 4, 3: 8}
_FIX = "Write the dataset with an ndarray token column (MDSWriter columns={'tokens': 'ndarray:uint32'}), uncompressed."


def _index_files(name: str, path: str | Sequence[str]) -> list[str]:
    entries = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    out: list[str] = []
    for e in map(os.fspath, entries):
        if "://" in e and not e.startswith("file://"):
            raise DataError(
                "MDS datasets are read from local folders only (the node shard cache serves remote token files of "
                'format = "tokens" and "megatron", not MDS yet)',
                dataset=name,
                file=e,
                fix="Copy the MDS folders to a local disk and point path at them.",
            )
        hits = sorted(glob.glob(e)) if any(c in e for c in "*?[") else [e]
        for h in hits:
            p = os.path.join(h, "index.json") if os.path.isdir(h) else h
            if os.path.basename(p) != "index.json" or not os.path.isfile(p):
                raise DataError(
                    "not an MDS dataset (no index.json)",
                    dataset=name,
                    file=h,
                    fix='Point path at MDS folders (each with its index.json) for format = "mds".',
                )
            out.append(p)
    if not out:
        raise DataError(f"no MDS dataset at {path!r}", dataset=name, fix="Check the path.")
    return sorted(set(out))


def _column(name: str, where: str, shard: dict, column: str | None) -> tuple[int, str]:
    names = shard.get("column_names") or []
    want = column if column is not None else next((c for c in ("tokens", "input_ids") if c in names), None)
    if want is None or want not in names:
        raise DataError(
            f"no token column {want or '(tokens / input_ids)'!r}; the columns are {names}",
            dataset=name,
            file=where,
            fix="Name the token column in the dataset's text_field.",
        )
    return names.index(want), want


def _sample_layout(data: memoryview, at: int, k: int, sizes: list, enc: str) -> tuple[int, int, str]:
    """(byte offset, id count, dtype) of column ``k`` of the sample at byte ``at``."""
    var = [i for i, s in enumerate(sizes) if s is None]
    lens = struct.unpack_from(f"<{len(var)}I", data, at) if var else ()
    width = dict(zip(var, lens))
    pos = at + 4 * len(var) + sum(width.get(i, sizes[i]) for i in range(k))
    nbytes = width.get(k, sizes[k])
    args = enc.split(":")[1:]
    start = pos
    if args:
        dtype = args[0]
    else:
        dtype = MDS_DTYPES.get(data[pos], "")
        pos += 1
    if len(args) < 2:
        ndim, code = data[pos] >> 2, data[pos] & 3
        pos += 1 + ndim * _SHAPE_WIDTH[code]
    if dtype not in MDS_DTYPES.values():
        raise ValueError(f"the column holds {dtype or 'non-integer'} values, not token ids")
    return pos, (nbytes - (pos - start)) // np.dtype(dtype).itemsize, dtype


def mds_shards(
    name: str, path: str | Sequence[str], column: str | None = None
) -> list[tuple[str, str, np.ndarray, np.ndarray, np.dtype]]:
    """Every shard of the MDS datasets at ``path``: ``(shard file, index.json, byte offset of each
    sample's first id, ids per sample, dtype)``; ``column``: the token column (default
    ``tokens``, else ``input_ids``)."""
    out = []
    for ix_path in _index_files(name, path):
        folder = os.path.dirname(ix_path)
        try:
            with open(ix_path, encoding="utf-8") as f:
                shards = json.load(f)["shards"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"cannot read the MDS index ({e})", dataset=name, file=ix_path, fix=_FIX) from None
        for sh in shards:
            base = os.path.basename(str((sh.get("raw_data") or {}).get("basename", "")))
            where = os.path.join(folder, base)
            if sh.get("format") != "mds" or sh.get("compression") or not base or not os.path.isfile(where):
                raise DataError(
                    "an MDS shard that is compressed, of another format, or missing",
                    dataset=name,
                    file=where or ix_path,
                    fix=_FIX,
                )
            k, col = _column(name, ix_path, sh, column)
            enc = sh["column_encodings"][k]
            if not enc.startswith("ndarray"):
                raise DataError(f"the token column {col!r} is encoded as {enc!r}", dataset=name, file=ix_path, fix=_FIX)
            raw = np.memmap(where, dtype=np.uint8, mode="r")
            data = memoryview(raw)  # type: ignore[arg-type]
            count = struct.unpack_from("<I", data, 0)[0]
            offsets = np.frombuffer(raw, "<u4", count + 1, 4).astype(np.int64)
            try:
                layout = [_sample_layout(data, int(a), k, sh["column_sizes"], enc) for a in offsets[:-1]]
            except (ValueError, KeyError, IndexError, struct.error) as e:
                raise DataError(
                    f"cannot read the token column {col!r} ({e})", dataset=name, file=where, fix=_FIX
                ) from None
            dtypes = {d for _, _, d in layout}
            if len(dtypes) > 1:
                raise DataError(f"the token column mixes id types {sorted(dtypes)}", dataset=name, file=where, fix=_FIX)
            lo = np.array([p for p, _, _ in layout], np.int64)
            n = np.array([c for _, c, _ in layout], np.int64)
            out.append((where, ix_path, lo, n, np.dtype(dtypes.pop() if dtypes else "uint16")))
            del data, raw
    return out


def _ndarray(a: np.ndarray, enc: str) -> bytes:
    """Streaming's NDArray encoding of a 1-D id array (dtype in the encoding, shape in the bytes)."""
    code = {0: "uint8", 1: "uint16", 2: "uint32", 3: "uint64"}
    n = len(a)
    w = 0 if n < 256 else 1 if n < 65536 else 2
    head = bytes([] if ":" in enc else [{v: k for k, v in MDS_DTYPES.items()}[a.dtype.name]])
    return head + bytes([(1 << 2) | w]) + np.array([n], code[w]).tobytes() + a.tobytes()


def write_mds(
    folder: str,
    docs: Iterable[Sequence[int] | np.ndarray],
    dtype: str = "uint32",
    column: str = "tokens",
    encoding: str | None = None,
) -> None:
    """Write one uncompressed MDS shard (``shard.00000.mds``) and its ``index.json``: a token
    column (``ndarray:DTYPE``, or ``encoding``) and an ``id`` column (``int``: fixed size), as
    Streaming's ``MDSWriter`` lays them out (columns sorted by name)."""
    enc = encoding or f"ndarray:{dtype}"
    cols = sorted([(column, enc, None), ("id", "int", 8)])
    samples = []
    for i, d in enumerate(docs):
        a = np.asarray(d, dtype=dtype)
        parts = {column: _ndarray(a, enc), "id": np.int64(i).tobytes()}
        sizes = [len(parts[c]) for c, _, s in cols if s is None]
        samples.append(np.array(sizes, np.uint32).tobytes() + b"".join(parts[c] for c, _, _ in cols))
    config = {
        "column_encodings": [e for _, e, _ in cols],
        "column_names": [c for c, _, _ in cols],
        "column_sizes": [s for _, _, s in cols],
        "compression": None,
        "format": "mds",
        "hashes": [],
        "size_limit": None,
        "version": 2,
    }
    head = json.dumps(config, sort_keys=True).encode("utf-8")
    offsets = np.array([0] + [len(s) for s in samples]).cumsum().astype(np.uint32)
    offsets += 4 + len(offsets.tobytes()) + len(head)
    blob = np.uint32(len(samples)).tobytes() + offsets.tobytes() + head + b"".join(samples)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "shard.00000.mds"), "wb") as f:
        f.write(blob)
    shard = dict(
        config,
        raw_data={"basename": "shard.00000.mds", "bytes": len(blob), "hashes": {}},
        samples=len(samples),
        zip_data=None,
    )
    with open(os.path.join(folder, "index.json"), "w", encoding="utf-8") as f:
        json.dump({"shards": [shard], "version": 2}, f, sort_keys=True)
