"""Pretokenized datasets: documents stored as token ids, read memory-mapped, never re-tokenized.

Two layouts, one index (:class:`TokenIndex`, a :class:`~zephon.data.datasets.protocol.ShardIndex`
whose records are integer arrays):

* ``format = "tokens"``: a token file ``NAME.npy`` (a 1-D integer array) or ``NAME.bin`` (raw
  little-endian ids) and beside it ``NAME.offsets.npy``: integers ``[documents + 1]``, the first
  0, non-decreasing, the last the token count; document ``i`` is ``tokens[offsets[i]:offsets[i+1]]``.
  A ``.bin`` file does not say its id width: the dataset's ``dtype`` ("uint8", "uint16", "int32"
  or "int64") states it, checked against the file's size and the last offset (without it, a
  ``.bin`` is refused: an int32 file whose offsets count twice its ids reads as uint16 too).
* ``format = "megatron"``: Megatron-LM's indexed dataset, ``NAME.bin`` with ``NAME.idx``
  (``MMIDIDX`` header, version 1, dtype code, sequence and document counts, sequence lengths and
  byte pointers, document indices). A document is its sequences, which lie contiguously.

A dataset's path names the token files (``data/*.npy``, ``data/*.bin``, a folder); the offset and
index files beside them are found by name. Remote files (``s3://``, ``https://``, ...) are
memory-mapped from their copies in the node shard cache (``$ZEPHON_SHARD_CACHE``,
:mod:`.shardcopy`), and refused without one. Documents are delivered as stored: no BOS/EOS is
added (Megatron's ``--append-eod`` data already ends each document with its EOD). A record's
"bytes", what mixing by tokens weighs it by, are 4 per token (the int32 zephon holds), so token
estimation is exact: 0.25 tokens per byte. Which tokenizer wrote the ids: the stored id width
bounds the vocabulary (ids stored as uint16 cannot come from a tokenizer of more than 65,536
tokens) and every document read is checked against the recipe tokenizer's vocabulary size by
the fetch (``zephon.nodes.FetchTokenize``).

>>> import tempfile, numpy as np
>>> root = tempfile.mkdtemp()
>>> write_tokens(f"{root}/a.npy", [np.array([5, 6, 7]), np.array([8])], dtype="uint16")
>>> ix = index_tokens("tok", f"{root}/*.npy", "tokens")
>>> ix.num_records, [d.tolist() for d in ix.read(0, [1, 0])], ix.record_bytes(0).tolist()
(2, [[8], [5, 6, 7]], [12, 4])
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .errors import BadRecord, DataError
from .mds import mds_shards, write_mds
from .nodecache import node_cache
from .resolve import ShardMeta, resolve_files
from .shardcopy import CopiedFiles

__all__ = [
    "BYTES_PER_TOKEN",
    "MEGATRON_DTYPES",
    "MEGATRON_HEADER",
    "TOKEN_FORMATS",
    "TokenIndex",
    "index_tokens",
    "out_of_vocab",
    "write_mds",
    "write_megatron",
    "write_tokens",
]

#: the pretokenized formats (their records are token-id arrays)
TOKEN_FORMATS = ("tokens", "megatron", "mds")
#: the first bytes of a Megatron ``.idx`` file
MEGATRON_HEADER = b"MMIDIDX\x00\x00"
#: Megatron's dtype codes (``indexed_dataset.DType``)
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
_BIN_WIDTH = {1: "uint8", 2: "uint16", 4: "int32", 8: "int64"}
#: bytes a token weighs in the plan (the int32 zephon holds): token estimation is exact
BYTES_PER_TOKEN = 4


def _stem(path: str) -> str:
    for ext in (".npy", ".bin"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def _fail(name: str, file: str, why: str, fix: str) -> DataError:
    return DataError(why, dataset=name, file=file, fix=fix)


def _offsets(name: str, path: str, tokens: int, where: str | None = None) -> np.ndarray:
    """The checked document offsets in ``path`` (read at ``where``, its local copy, if given;
    ``tokens``: the token file's id count, or -1)."""
    try:
        off = np.load(where or path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise _fail(
            name, path, f"cannot read the document offsets ({e})", "Write NAME.offsets.npy beside each token file."
        ) from None
    fix = "Write the offsets as integers [documents + 1]: 0, each document's end, the last = the token count."
    if off.ndim != 1 or off.dtype.kind not in "iu" or len(off) < 1:
        raise _fail(name, path, f"offsets must be a 1-D integer array, got {off.dtype} {off.shape}", fix)
    off = np.asarray(off, dtype=np.int64)
    if off[0] != 0 or (np.diff(off) < 0).any():
        raise _fail(name, path, "offsets must start at 0 and never decrease", fix)
    if tokens >= 0 and off[-1] != tokens:
        raise _fail(name, path, f"the last offset is {int(off[-1])} but the token file holds {tokens} ids", fix)
    return off


def out_of_vocab(ids: np.ndarray, vocab_size: int) -> str | None:
    """Why a stored document cannot come from a tokenizer of ``vocab_size`` ids (an id outside
    ``[0, vocab_size)``), or None."""
    if not ids.size:
        return None
    hi, lo = int(ids.max()), int(ids.min())
    if hi < vocab_size and lo >= 0:
        return None
    return (
        f"token id {hi if hi >= vocab_size else lo} is outside the recipe tokenizer's vocabulary of {vocab_size} ids: "
        "the data was tokenized with another tokenizer"
    )


class _Shard:
    """One token file: its ids (memory-mapped, opened lazily per process) and document starts.
    ``copies``: a remote file's token file (0) and offsets or index file (1), read from their
    copies in the node shard cache (:class:`~.shardcopy.CopiedFiles`; ``path`` is its URL)."""

    def __init__(
        self,
        name: str,
        fmt: str,
        path: str,
        layout: tuple | None = None,
        bin_dtype: str | None = None,
        copies: CopiedFiles | None = None,
    ) -> None:
        self.name, self.fmt, self.path, self.bin_dtype, self.copies = name, fmt, path, bin_dtype, copies
        self._raw: np.ndarray | None = None
        self._held: Any = None  # the open node-cache copy that the map reads (held: not evicted)
        if layout is not None:  # MDS: laid out by .mds.mds_shards
            self.side, self.lo, self.n, self.dtype = layout
            return
        self.side = _stem(path) + (".offsets.npy" if fmt == "tokens" else ".idx")
        self._where: dict[str, str] = {}  # where a remote file's local copy is, while it is parsed
        if copies is not None:
            with contextlib.ExitStack() as stack:
                self._where[self.side] = stack.enter_context(copies.held(1))
                if path.endswith(".npy"):  # its header says where the ids start (the file is downloaded)
                    self._where[path] = stack.enter_context(copies.held(0))
                self._parse()
            self._where = {}
            return
        for p in (path, self.side):
            if not os.path.isfile(p):
                raise _fail(
                    name,
                    p,
                    "missing"
                    if p == path
                    else f"the {'offsets' if fmt == 'tokens' else 'Megatron index'} file is missing",
                    "Every NAME.npy / NAME.bin needs NAME.offsets.npy beside it (format tokens), "
                    "every Megatron NAME.bin its NAME.idx (format megatron).",
                )
        self._parse()

    def _local(self, p: str) -> str:
        return self._where.get(p, p)

    def _size(self, p: str) -> int:
        if self.copies is not None:
            return self.copies._specs[0 if p == self.path else 1].size
        return os.path.getsize(p)

    def identity(self) -> tuple[int, str]:
        """(size, version) of the token file and its offsets or index file together."""
        if self.copies is not None:
            tok, side = self.copies._specs
            return tok.size, f"{tok.version} {side.version}"
        return os.path.getsize(self.path), ":".join(str(os.stat(p).st_mtime_ns) for p in (self.path, self.side))

    def _parse(self) -> None:
        self.base = 0  # the byte offset of the first id in the file (a .npy file's header)
        starts, self.dtype = self._megatron() if self.fmt == "megatron" else self._tokens()
        #: each document's first id (byte offset in the file) and id count
        self.lo = self.base + starts[:-1] * self.dtype.itemsize
        self.n = np.diff(starts)

    def _tokens(self) -> tuple[np.ndarray, np.dtype]:
        if self.path.endswith(".npy"):
            ids = self._open_npy()
            self.base = int(getattr(ids, "offset", 0))
            return _offsets(self.name, self.side, len(ids), self._local(self.side)), ids.dtype
        off = _offsets(self.name, self.side, -1, self._local(self.side))
        size, n = self._size(self.path), int(off[-1])
        width = size // n if n and size % n == 0 else 0
        if self.bin_dtype is None:
            guess = f" (its size suggests {_BIN_WIDTH[width]!r})" if width in _BIN_WIDTH else ""
            raise _fail(
                self.name,
                self.path,
                f"a raw .bin does not say the width of its ids{guess}",
                'State it: dtype = "uint16" (or "uint8", "int32", "int64") in the dataset, or save the ids as .npy.',
            )
        dtype = np.dtype(self.bin_dtype)
        if size != n * dtype.itemsize:
            raise _fail(
                self.name,
                self.path,
                f"{size} bytes do not hold the {n} ids its offsets count as {self.bin_dtype} ({n * dtype.itemsize} bytes)",
                "Check the dataset's dtype, and that NAME.offsets.npy belongs to this file (its last value is the token count).",
            )
        return off, dtype

    def _megatron(self) -> tuple[np.ndarray, np.dtype]:
        fix = "Rebuild the .idx with Megatron's preprocess_data.py (or zephon.data.datasets.tokens.write_megatron)."
        with open(self._local(self.side), "rb") as f:
            head = f.read(34)
        if len(head) < 34 or head[:9] != MEGATRON_HEADER:
            raise _fail(self.name, self.side, "not a Megatron index (no MMIDIDX header)", fix)
        version, code, seqs, docs = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in MEGATRON_DTYPES or MEGATRON_DTYPES[code].startswith("float"):
            raise _fail(self.name, self.side, f"unsupported index version {version} or dtype code {code}", fix)
        dtype = np.dtype(MEGATRON_DTYPES[code])
        need = 34 + seqs * 12 + docs * 8
        if self._size(self.side) < need:
            raise _fail(self.name, self.side, f"the index is cut short ({need} bytes expected)", fix)
        raw = np.memmap(self._local(self.side), dtype=np.uint8, mode="r")
        lengths = np.frombuffer(raw, np.int32, seqs, 34).astype(np.int64)
        pointers = np.frombuffer(raw, np.int64, seqs, 34 + seqs * 4)
        doc_idx = np.frombuffer(raw, np.int64, docs, 34 + seqs * 12)
        tok_start = pointers // dtype.itemsize
        contiguous = seqs == 0 or (pointers[0] == 0 and (np.diff(tok_start) == lengths[:-1]).all())
        if not contiguous or docs < 1 or doc_idx[0] != 0 or doc_idx[-1] != seqs or (np.diff(doc_idx) < 0).any():
            raise _fail(
                self.name, self.side, "its sequences are not contiguous or its document indices are inconsistent", fix
            )
        total = int(tok_start[-1] + lengths[-1]) if seqs else 0
        if self._size(self.path) < total * dtype.itemsize:
            raise _fail(self.name, self.path, f"the .bin holds fewer than the {total} ids its .idx counts", fix)
        bounds = np.append(tok_start, total)
        return bounds[doc_idx], dtype

    def _open_npy(self) -> np.ndarray:
        try:
            ids = np.load(self._local(self.path), mmap_mode="r", allow_pickle=False)
        except Exception as e:  # a corrupt header raises what numpy's parser meets (tokenize.TokenError...)
            why = " ".join(str(e).split())[:200] or type(e).__name__
            raise _fail(
                self.name,
                self.path,
                f"cannot read the token array ({type(e).__name__}: {why})",
                "Save it with numpy.save.",
            ) from None
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise _fail(
                self.name,
                self.path,
                f"tokens must be a 1-D integer array, got {ids.dtype} {ids.shape}",
                "Save the ids flat.",
            )
        return ids

    def doc(self, i: int) -> np.ndarray:
        """Document ``i``'s ids: a view of the memory-mapped file (nothing is read until used)."""
        if self._raw is None:
            if self.copies is None:
                self._raw = np.memmap(self.path, dtype=np.uint8, mode="r")
            else:  # the copy in the node cache, held (not evicted) while it is mapped
                self._held = self.copies.opened(0)
                self._raw = np.memmap(self._held, dtype=np.uint8, mode="r")
        return np.frombuffer(self._raw, self.dtype, int(self.n[i]), int(self.lo[i]))

    def close(self) -> None:
        """Drop the map (documents already read stay readable)."""
        self._raw = None
        if self._held is not None:
            self._held.close()
            self._held = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_raw": None, "_held": None}


class TokenIndex:
    """A pretokenized dataset's documents (module doc): reads return integer arrays (views of
    the memory-mapped file, native width), records above ``max_record_bytes`` (4 bytes a token)
    are a :class:`BadRecord`."""

    pretokenized = True

    def __init__(self, name: str, fmt: str, shards: list[_Shard], max_record_bytes: int) -> None:
        self.name, self.format, self.max_record_bytes = name, fmt, int(max_record_bytes)
        self._shards = shards
        self.shards = [ShardMeta(s.path, len(s.n), *s.identity()) for s in shards]
        self.num_records = sum(m.num_records for m in self.shards)
        h = hashlib.sha256(f"{fmt}\0".encode())
        for m in self.shards:
            h.update(f"{m.path}\0{m.num_records}\0{m.size_bytes}\0{m.version}\0".encode())
        self.fingerprint = h.hexdigest()
        self._lock = threading.Lock()

    @property
    def dtypes(self) -> list[np.dtype]:
        """The stored id type of each shard (it bounds the vocabulary that wrote it)."""
        return [s.dtype for s in self._shards]

    def shard_offsets(self) -> np.ndarray:
        """int64 ``[shards + 1]``: each shard's first document's global index, then the total."""
        return np.concatenate([[0], np.cumsum([m.num_records for m in self.shards])]).astype(np.int64)

    def record_bytes(self, shard: int) -> np.ndarray:
        """Each document's weight in the plan: 4 bytes a token (so token estimation is exact)."""
        return self._shards[shard].n * BYTES_PER_TOKEN

    def read(self, shard: int, indices: Sequence[int]) -> list[Any]:
        """Documents ``indices`` of ``shard`` as views of the mapped file (native id width), in
        the order given; one above ``max_record_bytes`` as a :class:`BadRecord`."""
        sh = self._shards[shard]
        out: list[Any] = []
        with self._lock:  # the map is opened once per process
            for i in indices:
                n = int(sh.n[i])
                if n * BYTES_PER_TOKEN > self.max_record_bytes:
                    why = f"{n} tokens exceed max_record_bytes (4 a token)"
                    out.append(BadRecord(self.name, sh.path, f"document {i}", why))
                else:
                    out.append(sh.doc(i))
        return out

    def locate(self, shard: int, record: int) -> dict[str, Any]:
        """Where a document lives: its file, ``document N``, its first id's byte offset and its length."""
        sh = self._shards[shard]
        return {
            "file": sh.path,
            "locator": f"document {record}",
            "byte_offset": int(sh.lo[record]),
            "tokens": int(sh.n[record]),
        }

    def prefetch(self, shards: Iterable[int]) -> int:
        """Download remote token files ``shards`` into the node cache in the background
        (download-ahead): how many were started. Reads are unchanged."""
        started = 0
        for s in dict.fromkeys(int(x) for x in shards):
            copies = self._shards[s].copies
            if copies is not None:
                started += copies.prefetch([0])
        return started

    def close(self) -> None:
        """Drop the memory maps (a later read maps the files again)."""
        with self._lock:
            for s in self._shards:
                s.close()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"TokenIndex({self.name!r}, format={self.format!r}, shards={len(self.shards)}, documents={self.num_records})"


def index_tokens(
    name: str,
    path: str | list[str],
    format: str,
    *,
    max_record_bytes: int = 32 << 20,
    same_file: str = "each",
    column: str | None = None,
    dtype: str | None = None,
) -> TokenIndex:
    """Index a pretokenized dataset (``format`` "tokens", "megatron" or "mds"): its token files,
    each with its offsets / index file (MDS: folders with ``index.json``; ``column`` names the
    token column; ``dtype``: the id width of raw ``.bin`` files of format "tokens"). Files are
    memory-mapped: a remote one (``s3://``, ``https://``, ...) is read from its copy in the node
    shard cache (``$ZEPHON_SHARD_CACHE``; MDS datasets are local only)."""
    if format not in TOKEN_FORMATS:
        raise DataError(f"format {format!r} is not pretokenized", dataset=name, fix=f"Use one of {TOKEN_FORMATS}.")
    if format == "mds":
        shards = [_Shard(name, format, p, (ix, lo, n, dt)) for p, ix, lo, n, dt in mds_shards(name, path, column)]
        return TokenIndex(name, format, shards, max_record_bytes)
    exts = (".npy", ".bin") if format == "tokens" else (".bin",)
    paths: list[str] = []
    remote: dict[str, CopiedFiles] = {}  # URL -> the remote token file and its offsets / index file
    for fs, fp, _info, _forced in resolve_files(name, path, format):
        if not fp.endswith(exts) or fp.endswith(".offsets.npy"):
            continue
        if type(fs).__name__ == "LocalFileSystem":
            paths.append(fp)
            continue
        url = fs.unstrip_protocol(fp)
        if node_cache() is None:
            raise DataError(
                "pretokenized files are memory-mapped, so a remote one is read from a local copy, and no node "
                "shard cache is set to hold it",
                dataset=name,
                file=url,
                fix="Set $ZEPHON_SHARD_CACHE to a local folder with room (each remote file is downloaded there once "
                "per node), or copy the files to a local disk.",
            )
        side = _stem(fp) + (".offsets.npy" if format == "tokens" else ".idx")
        remote[url] = CopiedFiles.stat(name, fs, [fp, side])
    paths = sorted(set(paths))
    if same_file == "once":
        seen: set[str] = set()
        paths = [p for p in paths if not (os.path.realpath(p) in seen or seen.add(os.path.realpath(p)))]  # type: ignore[func-returns-value]
    if not paths and not remote:
        raise DataError(
            f"no token files ({' or '.join(exts)}) at {path!r}",
            dataset=name,
            fix=f'Point path at the token files of format = "{format}".',
        )
    shards = [_Shard(name, format, p, bin_dtype=dtype) for p in paths]
    shards += [_Shard(name, format, u, bin_dtype=dtype, copies=c) for u, c in sorted(remote.items())]
    return TokenIndex(name, format, sorted(shards, key=lambda sh: sh.path), max_record_bytes)


def write_tokens(path: str, docs: Iterable[Sequence[int] | np.ndarray], dtype: str = "uint16") -> None:
    """Write documents as ``format = "tokens"``: ``path`` (``.npy``, or raw ``.bin``) and
    ``<stem>.offsets.npy`` beside it."""
    arrays = [np.asarray(d, dtype=dtype) for d in docs]
    ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype)
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
    if path.endswith(".npy"):
        np.save(path, ids)
    else:
        ids.astype(ids.dtype.newbyteorder("<")).tofile(path)
    np.save(_stem(path) + ".offsets.npy", offsets)


def write_megatron(prefix: str, docs: Iterable[Sequence[Sequence[int]] | np.ndarray], dtype: str = "uint16") -> None:
    """Write ``prefix.bin`` / ``prefix.idx`` in Megatron-LM's indexed-dataset layout. A document
    is an array of ids (one sequence) or a list of sequences (Megatron's ``--split-sentences``)."""
    code = {v: k for k, v in MEGATRON_DTYPES.items()}[dtype]
    lengths: list[int] = []
    doc_idx = [0]
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            seqs = [d] if isinstance(d, np.ndarray) or (len(d) and np.isscalar(d[0])) else d
            for s in seqs:
                a = np.asarray(s, dtype=dtype)
                f.write(a.astype(a.dtype.newbyteorder("<")).tobytes())
                lengths.append(len(a))
            doc_idx.append(len(lengths))
    size = np.dtype(dtype).itemsize
    pointers = (
        np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * size if lengths else np.zeros(0, np.int64)
    )
    with open(prefix + ".idx", "wb") as f:
        f.write(MEGATRON_HEADER + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx)))
        f.write(np.asarray(lengths, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes())
        f.write(np.asarray(doc_idx, "<i8").tobytes())
