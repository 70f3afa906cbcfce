"""The bytes of the token cache's blocks: framed entries, each with its own CRC-32.

Why a module of its own: the local cache (:mod:`.tokencache`) reads and appends these frames, and
the remote tier checks every entry of a fetched block the same way before it is used.

A block is a sequence of frames: a header (magic, the block's tag, record, part, parts, offset,
id count, id width, flags), a CRC-32 of the header and the ids, then the ids at the tokenizer's
width (uint16 or uint32).
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from typing import NamedTuple

import numpy as np

__all__ = ["FORMAT_VERSION", "TokenEntry", "checked_entries", "frame", "frames", "width_of"]

#: 1: framed entries (magic, block tag, record, part, parts, offset, count, width, flags, CRCs)
FORMAT_VERSION = 1
_MAGIC = b"ZTC1"
_HDR = struct.Struct("<4s8sqiiqIBB2x")  # then a CRC-32 of these bytes and the ids, then the ids
_CRC = struct.Struct("<I")
_FRAME = _HDR.size + _CRC.size


class TokenEntry(NamedTuple):
    """One cached tokenization: the ids (int32), ``offset`` (where they start in the document's
    tokens, for a "tokens"-mode part) and ``text_part`` (a part cut from the text)."""

    tokens: np.ndarray
    offset: int = 0
    text_part: bool = False


def width_of(vocab_size: int) -> int:
    """Bytes per stored id: 2 when every id fits in uint16, else 4.

    >>> width_of(50_000), width_of(128_256)
    (2, 4)
    """
    return 2 if vocab_size <= 1 << 16 else 4


def frame(tag: bytes, key: tuple[int, int, int], e: TokenEntry, width: int) -> bytes:
    """The bytes of one entry in a block file (header, ids at ``width`` bytes, CRC-32)."""
    ids = np.asarray(e.tokens).astype(np.uint16 if width == 2 else np.uint32).tobytes()
    hdr = _HDR.pack(_MAGIC, tag, key[0], key[1], key[2], int(e.offset), len(ids) // width, width, int(e.text_part))
    return hdr + _CRC.pack(zlib.crc32(ids, zlib.crc32(hdr))) + ids


def frames(
    tag: bytes, items: list[tuple[tuple[int, int, int], TokenEntry]], width: int
) -> tuple[bytes, list[tuple[tuple[int, int, int], tuple[int, int, int, int, bool, int]]]]:
    """The bytes of ``items``' frames, one after another (as :func:`frame` makes each), and each
    entry's place as :meth:`_Block.parse` records it, relative to the buffer's start: many small
    entries (conversations) framed with one conversion of their ids."""
    ids = np.concatenate([np.asarray(e.tokens) for _, e in items]).astype(np.uint16 if width == 2 else np.uint32)
    raw = memoryview(ids.tobytes())
    parts: list[bytes | memoryview] = []
    places = []
    at = pos = 0
    for key, e in items:
        n = len(e.tokens)
        body = raw[at * width : (at + n) * width]
        hdr = _HDR.pack(_MAGIC, tag, key[0], key[1], key[2], int(e.offset), n, width, int(e.text_part))
        crc = zlib.crc32(body, zlib.crc32(hdr))
        parts += (hdr, _CRC.pack(crc), body)
        places.append((key, (pos + _FRAME, n, width, crc, bool(e.text_part), int(e.offset))))
        at += n
        pos += _FRAME + n * width
    return b"".join(parts), places


def _checked(
    tag: bytes, key: tuple[int, int, int], meta: tuple[int, int, int, int, bool, int], ids: bytes
) -> TokenEntry | None:
    """The entry of ``key`` from its ids' bytes and parsed header ``meta``, if its CRC matches."""
    _, n, width, crc, text_part, off = meta
    hdr = _HDR.pack(_MAGIC, tag, key[0], key[1], key[2], off, n, width, int(text_part))
    if len(ids) != n * width or zlib.crc32(ids, zlib.crc32(hdr)) != crc:
        return None
    return TokenEntry(np.frombuffer(ids, np.uint16 if width == 2 else np.uint32).astype(np.int32), off, text_part)


def checked_entries(buf: bytes, tag: bytes) -> tuple[dict[int, list[tuple[tuple[int, int, int], TokenEntry]]], int]:
    """The intact entries of block bytes ``buf`` (frames of block ``tag`` whose CRC matches), by
    width, and how many frames failed (a corrupt entry, or a corrupt or cut tail)."""
    b = _Block("", tag)
    end = b.parse(buf, 0)
    out: dict[int, list[tuple[tuple[int, int, int], TokenEntry]]] = {}
    bad = int(end < len(buf))
    for key, meta in sorted(b.entries.items()):
        e = _checked(tag, key, meta, buf[meta[0] : meta[0] + meta[1] * meta[2]])
        if e is None:
            bad += 1
        else:
            out.setdefault(meta[2], []).append((key, e))
    return out, bad


class _Block:
    """One block file as this process knows it: the entries parsed so far (key -> position),
    the open file, and where the valid frames end. Guarded by its own lock."""

    def __init__(self, path: str, tag: bytes) -> None:
        self.path, self.tag = path, tag
        self.lock = threading.Lock()
        self.fd = -1
        self.ino = -1
        self.end = 0  # end of the last valid frame parsed
        # key -> (ids' file offset, count, width, CRC, text_part, offset)
        self.entries: dict[tuple[int, int, int], tuple[int, int, int, int, bool, int]] = {}
        self.touched = 0.0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def refresh(self) -> None:
        """Parse the frames appended since the last look (reopen if the file was replaced)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.close()
            self.entries, self.end, self.ino = {}, 0, -1
            return
        if st.st_ino != self.ino or self.fd < 0:
            self.close()
            self.fd = os.open(self.path, os.O_RDONLY)
            self.ino, self.end, self.entries = os.fstat(self.fd).st_ino, 0, {}
        if st.st_size > self.end:
            self.end = self.parse(os.pread(self.fd, st.st_size - self.end, self.end), self.end)

    def parse(self, buf: bytes, base: int) -> int:
        """Record the complete frames of ``buf`` (read at file offset ``base``); returns where the
        valid frames end (an incomplete or corrupt header ends the parse)."""
        pos = 0
        while pos + _FRAME <= len(buf):
            magic, tag, rec, part, parts, off, n, width, flags = _HDR.unpack_from(buf, pos)
            end = pos + _FRAME + n * width
            if magic != _MAGIC or width not in (2, 4) or end > len(buf):
                break
            if tag == self.tag:  # a frame of another block (a copied file) is skipped
                (crc,) = _CRC.unpack_from(buf, pos + _HDR.size)
                self.entries[rec, part, parts] = (base + pos + _FRAME, n, width, crc, bool(flags & 1), off)
            pos = end
        return base + pos

    def read(self, key: tuple[int, int, int]) -> TokenEntry | None:
        """The entry of ``key`` if present and intact (a corrupt one is forgotten: a miss)."""
        got = self.entries.get(key)
        if got is None:
            return None
        e = _checked(self.tag, key, got, os.pread(self.fd, got[1] * got[2], got[0]))
        if e is None:
            del self.entries[key]
        return e
