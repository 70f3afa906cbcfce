"""Low-level helpers: streaming decompression, vectorised line scanning, small thread-safe LRU."""

from __future__ import annotations

import gzip
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import numpy as np

CHUNK = 8 << 20  # bytes per read when scanning plain files
ZSTD_IN_CHUNK = 1 << 20  # compressed bytes per decompressobj call (bounds one output burst)
BOM = b"\xef\xbb\xbf"


class CompressionError(Exception):
    """Raised by ``iter_decompressed``; ``kind`` is "truncated" or "corrupt"."""

    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind


def iter_decompressed(f: BinaryIO, compression: str | None, chunk: int = CHUNK) -> Iterator[bytes]:
    """Yield the decompressed stream of ``f`` in chunks; detect truncated/corrupt streams."""
    if compression is None:
        while True:
            b = f.read(chunk)
            if not b:
                return
            yield b
    elif compression == "gzip":
        # GzipFile handles multi-member files and raises EOFError on truncation.
        g = gzip.GzipFile(fileobj=f, mode="rb")
        try:
            while True:
                b = g.read(chunk)
                if not b:
                    return
                yield b
        except EOFError as e:
            raise CompressionError("truncated", f"gzip stream is truncated ({e})") from None
        except (gzip.BadGzipFile, zlib.error) as e:
            raise CompressionError("corrupt", f"gzip stream is corrupt ({e})") from None
    elif compression == "zstd":
        import zstandard

        dctx = zstandard.ZstdDecompressor()
        d = dctx.decompressobj()
        fed = False  # has the current frame's decompressor seen any input?
        try:
            while True:
                raw = f.read(ZSTD_IN_CHUNK)
                if not raw:
                    break
                while raw:
                    out = d.decompress(raw)
                    fed = True
                    if out:
                        yield out
                    if d.eof:  # frame finished; the rest (if any) starts the next frame
                        raw = d.unused_data
                        d = dctx.decompressobj()
                        fed = False
                    else:
                        raw = b""
        except zstandard.ZstdError as e:
            raise CompressionError("corrupt", f"zstd stream is corrupt ({e})") from None
        if fed and not d.eof:
            raise CompressionError("truncated", "zstd stream is truncated (the last frame is incomplete)")
    else:  # pragma: no cover - guarded by the caller
        raise ValueError(f"unknown compression {compression!r}")


_WS = np.zeros(256, dtype=bool)
for _c in b" \t\r\n\x0b\x0c":
    _WS[_c] = True


class LineScanner:
    """Finds the non-blank lines of a byte stream fed in chunks, without parsing them.

    Produces, per record (non-blank line): byte offset and byte length in the stream (line
    terminator and a trailing ``\\r`` excluded; a leading UTF-8 BOM on the first line excluded),
    plus a sparse map from record index to physical line number (``gap_rec``/``gap_cum``:
    from record ``gap_rec[k]`` on, ``gap_cum[k]`` blank lines precede the record), and each
    record's CRC-32 (``crcs``, uint32: what a read checks the bytes it gets against).

    Linear in the stream's length whatever its lines' lengths: each chunk is searched for
    newlines once, and a line longer than ``carry_limit`` bytes is followed by its metadata
    alone (start, length, whether it is all whitespace, last byte), so a line without a newline
    for a gigabyte neither copies nor holds it.

    >>> sc = LineScanner(carry_limit=4)
    >>> for chunk in (b"ab\\n\\n  \\nlong", b"er line\\r\\nx"):
    ...     sc.feed(chunk)
    >>> a = sc.finish(); a["offsets"].tolist(), a["lengths"].tolist()
    ([0, 7, 20], [2, 11, 1])
    >>> a["crcs"].tolist() == [zlib.crc32(b) for b in (b"ab", b"longer line", b"x")]
    True
    """

    def __init__(self, carry_limit: int = 1 << 20) -> None:
        self.carry_limit = carry_limit
        self._carry = b""
        self._base = 0  # stream offset of the first byte of _carry
        self._long = False  # the line in progress is longer than carry_limit: metadata only
        self._long_len = 0
        self._long_ws = True
        self._long_last = -1
        self._long_bom = False
        self._long_crc = 0  # CRC-32 of the long line so far, without its last byte (_long_last)
        self._offs: list[np.ndarray] = []
        self._crcs: list[np.ndarray] = []
        self._lens: list[np.ndarray] = []
        self._gap_rec: list[np.ndarray] = []
        self._gap_cum: list[np.ndarray] = []
        self._nrec = 0
        self._blanks = 0
        self._last_bb = 0
        self._first = True
        self.total = 0  # decompressed stream length

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self._long:
            arr = np.frombuffer(chunk, dtype=np.uint8)
            nl = np.flatnonzero(arr == 10)
            if nl.size == 0:
                self._extend_long(arr)
                return
            first_nl = int(nl[0])
            self._extend_long(arr[:first_nl])
            self._end_long()
            chunk = chunk[first_nl + 1 :]
        buf = self._carry + chunk if self._carry else chunk
        arr = np.frombuffer(buf, dtype=np.uint8)
        nl = np.flatnonzero(arr == 10)
        if nl.size:
            ends = nl.astype(np.int64)
            starts = np.empty_like(ends)
            starts[0] = 0
            starts[1:] = ends[:-1] + 1
            self._process(buf, arr, starts, ends)
            cut = int(ends[-1]) + 1
            buf, arr = buf[cut:], arr[cut:]
            self._base += cut
        if len(buf) > max(self.carry_limit, 3):  # the line in progress is long: keep its metadata only
            self._long = True
            self._long_bom = self._first and self._base == 0 and buf[:3] == BOM
            self._long_len = 0
            self._long_ws = True
            self._long_last = -1
            self._long_crc = 0
            self._extend_long(arr[3:] if self._long_bom else arr)
            self._carry = b""
        else:
            self._carry = bytes(buf)

    def _extend_long(self, arr: np.ndarray) -> None:
        if arr.size:
            # the last byte is held back: a final \r is not part of the record
            if self._long_last >= 0:
                self._long_crc = zlib.crc32(bytes((self._long_last,)), self._long_crc)
            self._long_crc = zlib.crc32(arr[:-1].tobytes(), self._long_crc)
            self._long_len += int(arr.size)
            self._long_ws = self._long_ws and bool(_WS[arr].all())
            self._long_last = int(arr[-1])

    def _end_long(self) -> None:
        """The long line in progress ended (a newline, or the end of the stream): record it."""
        start = self._base + (3 if self._long_bom else 0)
        length = self._long_len - (1 if self._long_last == 13 else 0)
        crc = self._long_crc
        if self._long_last not in (-1, 13):
            crc = zlib.crc32(bytes((self._long_last,)), crc)
        self._first = False
        self._record(
            np.array([start], np.int64),
            np.array([length], np.int64),
            np.array([not self._long_ws]),
            np.array([crc], np.uint32),
        )
        self._base = start + self._long_len + 1  # stream offset after its newline
        self._long = False

    def finish(self) -> dict[str, np.ndarray]:
        if self._long:
            self._end_long()
        elif self._carry:
            buf = self._carry
            arr = np.frombuffer(buf, dtype=np.uint8)
            self._process(buf, arr, np.zeros(1, np.int64), np.full(1, len(buf), np.int64))
            self._carry = b""

        def cat(xs: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)

        return {
            "offsets": cat(self._offs),
            "lengths": cat(self._lens),
            "gap_rec": cat(self._gap_rec),
            "gap_cum": cat(self._gap_cum),
            "crcs": np.concatenate(self._crcs) if self._crcs else np.zeros(0, np.uint32),
        }

    def _process(self, buf: bytes, arr: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        if self._first:
            self._first = False
            if self._base == 0 and buf[:3] == BOM:
                starts = starts.copy()
                starts[0] = min(3, int(ends[0]))
        lens = ends - starts
        nz = lens > 0
        if nz.any():
            cr = np.zeros(lens.shape, dtype=bool)
            cr[nz] = arr[ends[nz] - 1] == 13
            ends = ends - cr
            lens = ends - starts
            nz = lens > 0
        nonblank = nz.copy()
        if nz.any():
            first = np.zeros(lens.shape, dtype=np.uint8)
            first[nz] = arr[starts[nz]]
            for j in np.flatnonzero(nz & _WS[first]):  # rare: lines starting with whitespace
                if buf[starts[j] : ends[j]].isspace():
                    nonblank[j] = False
        mv = memoryview(buf)
        crcs = np.fromiter(
            (zlib.crc32(mv[a:b]) for a, b in zip(starts[nonblank].tolist(), ends[nonblank].tolist())),
            np.uint32,
            int(nonblank.sum()),
        )
        self._record(starts + self._base, lens, nonblank, crcs)

    def _record(self, starts: np.ndarray, lens: np.ndarray, nonblank: np.ndarray, crcs: np.ndarray) -> None:
        """Book lines (absolute start offsets, lengths, whether each is a record, the records' CRC-32s)."""
        cumblank = np.cumsum(~nonblank, dtype=np.int64) + self._blanks
        rec_lines = np.flatnonzero(nonblank)
        if rec_lines.size:
            bb = cumblank[rec_lines]
            changes = np.flatnonzero(np.diff(bb, prepend=self._last_bb) != 0)
            if changes.size:
                self._gap_rec.append(changes + self._nrec)
                self._gap_cum.append(bb[changes])
            self._last_bb = int(bb[-1])
            self._offs.append(starts[rec_lines])
            self._lens.append(lens[rec_lines])
            self._crcs.append(crcs)
            self._nrec += rec_lines.size
        if cumblank.size:
            self._blanks = int(cumblank[-1])


#: streams up to this many bytes are scanned by :func:`scan_small` (one pass of Python)
SMALL_STREAM = 16 << 10


def scan_small(data: bytes) -> dict[str, np.ndarray]:
    """What :class:`LineScanner` finds in ``data`` fed whole, the same arrays, for a short
    stream: a loop over its lines. (Why: the vectorised scan costs about 0.3 ms a stream in
    numpy calls whatever its size; at 100,000 shards of a few lines that is half a minute.)

    >>> a = scan_small(BOM + b"ab\\n\\n  \\nx\\r\\n"); a["offsets"].tolist(), a["lengths"].tolist(), a["gap_rec"].tolist()
    ([3, 10], [2, 1], [1])
    """
    offs: list[int] = []
    lens: list[int] = []
    crcs: list[int] = []
    gap_rec: list[int] = []
    gap_cum: list[int] = []
    pos = blanks = last = 0
    n = len(data)
    while pos < n:
        nl = data.find(b"\n", pos)
        end = n if nl < 0 else nl
        start = min(3, end) if pos == 0 and data.startswith(BOM) else pos
        if end > start and data[end - 1] == 13:
            end -= 1
        seg = data[start:end]
        if seg and not seg.isspace():
            if blanks != last:
                gap_rec.append(len(offs))
                gap_cum.append(blanks)
                last = blanks
            offs.append(start)
            lens.append(end - start)
            crcs.append(zlib.crc32(seg))
        else:
            blanks += 1
        if nl < 0:
            break
        pos = nl + 1
    i64 = np.int64
    return {
        "offsets": np.array(offs, i64),
        "lengths": np.array(lens, i64),
        "gap_rec": np.array(gap_rec, i64),
        "gap_cum": np.array(gap_cum, i64),
        "crcs": np.array(crcs, np.uint32),
    }


def line_number(gap_rec: np.ndarray, gap_cum: np.ndarray, rec: int) -> int:
    """1-based physical line number of record ``rec`` (see ``LineScanner``)."""
    k = int(np.searchsorted(gap_rec, rec, side="right")) - 1
    return rec + (int(gap_cum[k]) if k >= 0 else 0) + 1


class LRU:
    """Small thread-safe LRU; concurrent misses on one key run the loader once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._inflight: dict[Any, threading.Event] = {}

    def get(self, key, loader: Callable[[], object]):
        while True:
            with self._lock:
                if key in self._d:
                    self._d.move_to_end(key)
                    return self._d[key]
                ev = self._inflight.get(key)
                owner = ev is None
                if ev is None:
                    ev = self._inflight[key] = threading.Event()
            if not owner:
                ev.wait()
                continue  # hit next time round, or (loader failed) try ourselves
            try:
                val = loader()
            except BaseException:
                with self._lock:
                    del self._inflight[key]
                ev.set()
                raise
            with self._lock:
                self._d[key] = val
                self._d.move_to_end(key)
                while len(self._d) > self.capacity:
                    self._d.popitem(last=False)
                del self._inflight[key]
            ev.set()
            return val

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
