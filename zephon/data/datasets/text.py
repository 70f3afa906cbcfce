"""Plain-text shards (format ``"text"``): one document per non-blank line (``text_mode =
"line"``) or one per file (``"file"``), optionally ``.gz``/``.zst`` compressed; and the base of
every text-format reader (:class:`Reader`), which the JSON Lines, Parquet and Arrow readers
extend.

Indexing a line shard records each non-blank line's byte offset and length (a vectorised scan,
no parse), so a read is a few coalesced ``pread`` calls; the text is checked as it is read.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ._scan import BOM, SMALL_STREAM, LineScanner, line_number, scan_small
from .errors import BadRecord
from .shardio import ShardFiles

__all__ = ["LineReader", "Reader", "TextFileReader", "check_text", "parse_text_file", "parse_text_line", "utf8_reason"]


def utf8_reason(raw: bytes, e: UnicodeDecodeError, where: str) -> str:
    """The bad-record reason for bytes that are not UTF-8, naming the first bad byte."""
    return f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start} of the {where})"


def check_text(text: str, what: str, empty_ok: bool = False) -> str | None:
    """The bad-record reason of an empty or whitespace-only text, else None (it is trainable).
    With ``empty_ok`` (a dataset's ``empty = "document"``) such a text is data too: a document
    of its BOS/EOS (and its whitespace's tokens)."""
    if not empty_ok and (not text or text.isspace()):
        return f"{what} is empty" if not text else f"{what} is empty (whitespace only)"
    return None


def parse_text_line(raw: bytes) -> tuple[str | None, str | None]:
    """``(text, None)`` or ``(None, reason)`` for one line of a text shard.

    >>> parse_text_line(b"caf\\xc3\\xa9"), parse_text_line(b"\\xff")[1]
    (('café', None), 'invalid UTF-8 (byte 0xff at byte 0 of the line)')
    """
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, utf8_reason(raw, e, "line")


def parse_text_file(raw: bytes, empty_ok: bool = False) -> tuple[str | None, str | None]:
    """``(text, None)`` or ``(None, reason)`` for a whole-file document (a UTF-8 BOM is dropped;
    a whitespace-only file is data with ``empty_ok``)."""
    if raw.startswith(BOM):
        raw = raw[3:]
    try:
        t = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, utf8_reason(raw, e, "file")
    bad = check_text(t, "the file", empty_ok)
    return (None, bad) if bad else (t, None)


class Reader:
    """How one text format is indexed and read, for the text index ``ix`` that owns it:
    ``build`` (a shard's metadata arrays), ``read`` (records, in the order asked), ``locator``
    (where a record is, for messages) and ``locate`` (what the index's ``locate`` reports)."""

    def __init__(self, ix: ShardFiles) -> None:
        self.ix = ix

    def build(self, s: int) -> dict[str, np.ndarray]:
        """The metadata arrays of shard ``s`` (``lengths`` and the format's own), from its file."""
        raise NotImplementedError

    def read(self, s: int, idx: np.ndarray) -> list[str | BadRecord]:
        """Records ``idx`` of shard ``s`` (checked in range), in order."""
        raise NotImplementedError

    def locator(self, s: int, i: int) -> str:
        """Where record ``i`` is in its file: ``row N`` (0-based) unless the format says otherwise."""
        return f"row {i}"

    def locate(self, s: int, i: int) -> dict[str, Any]:
        """The format's part of the index's ``locate``."""
        return {"locator": self.locator(s, i)}

    def oversized(self, s: int, i: int, n: int) -> BadRecord:
        """The bad record of a record above ``max_record_bytes`` (its bytes are never read)."""
        ix = self.ix
        return BadRecord(
            ix.name,
            ix._specs[s].display,
            self.locator(s, i),
            f"the record is {n} bytes, more than max_record_bytes = {ix.max_record_bytes} (the per-record size "
            f"limit); it was not read. Raise max_record_bytes for dataset '{ix.name}' to read it",
        )

    def drop_oversized(self, s: int, idx: np.ndarray, lens: np.ndarray, out: list) -> np.ndarray:
        """Put a BadRecord in ``out`` for each record above the size limit; the positions left."""
        big = lens > self.ix.max_record_bytes
        for k in np.flatnonzero(big).tolist():
            out[k] = self.oversized(s, int(idx[k]), int(lens[k]))
        return np.flatnonzero(~big)


class LineReader(Reader):
    """Line shards: records are the non-blank lines, located by byte offset (``line N``, 1-based)."""

    def parser(self) -> Callable[[bytes], tuple[str | None, str | None]]:
        """The function that turns one record's bytes into ``(text, None)`` or ``(None, reason)``."""
        return parse_text_line

    def build(self, s: int) -> dict[str, np.ndarray]:
        """Scan the (decompressed) stream for the non-blank lines."""
        sp = self.ix._specs[s]
        if sp.compression is None and 0 <= sp.size <= SMALL_STREAM:  # a short shard: whole
            return scan_small(b"".join(self.ix._stream(s, "indexing")))
        sc = LineScanner()
        for chunk in self.ix._stream(s, "indexing"):
            sc.feed(chunk)
        return sc.finish()

    def locator(self, s: int, i: int) -> str:
        """``line N``, the 1-based physical line (blank lines counted)."""
        a = self.ix._shard(s)
        return f"line {line_number(a['gap_rec'], a['gap_cum'], i)}"

    def locate(self, s: int, i: int) -> dict[str, Any]:
        """``locator`` and the line's ``byte_offset`` / ``byte_length`` in the (decompressed) file."""
        a = self.ix._shard(s)
        return {"locator": self.locator(s, i), "byte_offset": int(a["offsets"][i]), "byte_length": int(a["lengths"][i])}

    def read(self, s: int, idx: np.ndarray) -> list[str | BadRecord]:
        """Coalesced byte-range reads, then the format's parse of each record."""
        ix = self.ix
        a = ix._shard(s)
        out: list[Any] = [None] * idx.size
        lens = a["lengths"][idx]
        todo = self.drop_oversized(s, idx, lens, out) if (lens > ix.max_record_bytes).any() else np.arange(idx.size)
        if todo.size:
            sel = idx[todo]
            offs, lens_ = a["offsets"][sel].tolist(), a["lengths"][sel].tolist()
            raws = ix._verified_ranges(s, offs, lens_, a["crcs"][sel], lambda k: self.locator(s, int(sel[k])))
            parse = self.parser()
            for k, i, (text, reason) in zip(todo.tolist(), sel.tolist(), map(parse, raws)):
                if reason is None and text is not None:
                    out[k] = text
                else:
                    out[k] = BadRecord(ix.name, ix._specs[s].display, self.locator(s, i), reason or "unreadable")
        return out


class TextFileReader(LineReader):
    """Whole-file documents (``text_mode = "file"``): one record per non-empty file."""

    def parser(self) -> Callable[[bytes], tuple[str | None, str | None]]:
        """:func:`parse_text_file` (whitespace-only files are data with ``empty = "document"``)."""
        return partial(parse_text_file, empty_ok=self.ix.empty_ok)

    def build(self, s: int) -> dict[str, np.ndarray]:
        """One record of the (decompressed) file's size and CRC-32 (the file is read once);
        none for an empty file."""
        ix, sp = self.ix, self.ix._specs[s]
        if sp.local and not os.access(sp.fspath, os.R_OK):
            raise ix._io_error(s, PermissionError("not readable"), "indexing")
        total = crc = 0
        for c in ix._stream(s, "indexing"):
            total += len(c)
            crc = zlib.crc32(c, crc)
        if total > 0:
            return {
                "offsets": np.zeros(1, np.int64),
                "lengths": np.full(1, total, np.int64),
                "crcs": np.full(1, crc, np.uint32),
            }
        return {}

    def locator(self, s: int, i: int) -> str:
        """``whole file``."""
        return "whole file"

    def locate(self, s: int, i: int) -> dict[str, Any]:
        """``locator`` only: the record is the file."""
        return {"locator": "whole file"}
