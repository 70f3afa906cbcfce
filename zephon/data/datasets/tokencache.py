"""A node-local cache of token ids, keyed by content, shared by every run, job and worker of a node.

Why: ablations read the same corpus again and again (another mixture, filter, seed), often several
jobs at once on one node, and the tokenizer is the ceiling of a text pipeline. A document's ids
depend only on its bytes, the tokenizer and the tokenize settings, so with ``$ZEPHON_TOKEN_CACHE``
set to a local folder the run that tokenizes a document writes its ids there (on a background
thread, off the critical path) and any later run or concurrent job whose key matches reads them
instead of tokenizing. It is a setting of the node, like the shard cache: not part of the data
definition or its fingerprint, and the batches are byte-identical with it cold, warm, partial,
corrupted or absent.

What an entry is keyed by: a *block* (a file) holds the entries of :data:`BLOCK_RECORDS`
consecutive records of one shard under one setting; its name is a digest of

* the settings: this module's format version, the tokenizer's fingerprint (its file, BOS/EOS,
  special-token policy) and, for the parts of a long document, how parts are cut (split mode,
  row alignment, search window): whatever changes the ids changes the name;
* the shard's content: its format, text field and mode, size and the content digest of its index
  arrays (every read unit's CRC-32, offsets and lengths), so a changed shard is a new block and a
  copy of the same shard elsewhere shares it;

and each entry inside by (record, part, parts). Ids are stored at the tokenizer's width (uint16
below 65,536 ids, else uint32), each entry with a header and a CRC-32 of header and ids.

How it stays correct when many processes share the folder:

* A block is an append-only file of framed entries. A writer appends under the file's exclusive
  ``flock``, first checking the frames after the last ones it knows and truncating an incomplete
  or corrupt tail (a writer killed mid-append): a crash never leaves garbage that hides later
  entries. Readers take no lock: a frame is used only when complete and its CRC matches; a corrupt
  entry is a miss (re-tokenized, and the new frame replaces it).
* The folder is kept under ``$ZEPHON_TOKEN_CACHE_GB`` (default 32) by evicting the least recently
  used blocks (under one folder-wide lock; a block a writer holds is skipped). A reader keeps the
  unlinked file open and its bytes stay valid.
* A folder that cannot be used means no cache, with one warning per process.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import fcntl
import hashlib
import os
import queue
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .index import DatasetIndex, content_version
from .retry import env_number

__all__ = [
    "BLOCK_RECORDS",
    "ENV_DIR",
    "ENV_GB",
    "TokenCache",
    "TokenEntry",
    "cache_setting",
    "shard_identity",
    "token_cache",
    "width_of",
]

ENV_DIR = "ZEPHON_TOKEN_CACHE"
ENV_GB = "ZEPHON_TOKEN_CACHE_GB"
_DEFAULT_GB = 32.0
#: records of a shard per block file (a block of small documents is ~1 MB)
BLOCK_RECORDS = 1024
#: 1: framed entries (magic, block tag, record, part, parts, offset, count, width, flags, CRCs)
FORMAT_VERSION = 1
_MAGIC = b"ZTC1"
_HDR = struct.Struct("<4s8sqiiqIBB2x")  # then a CRC-32 of these bytes and the ids, then the ids
_CRC = struct.Struct("<I")
_FRAME = _HDR.size + _CRC.size
_BLOCKS_KEPT = 64  # block indexes (and open files) a process keeps
_TOUCH_S = 5.0  # a block's last-use time is refreshed at most this often per process
_QUEUE_BYTES = 256 << 20  # ids waiting for the writer; more are dropped (the cache is optional)
_CHECK_BYTES = 64 << 20  # the folder's size is checked against the cap after this many written


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


def _digest(*parts: Any) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:40]


def frame(tag: bytes, key: tuple[int, int, int], e: TokenEntry, width: int) -> bytes:
    """The bytes of one entry in a block file (header, ids at ``width`` bytes, CRC-32)."""
    ids = np.asarray(e.tokens).astype(np.uint16 if width == 2 else np.uint32).tobytes()
    hdr = _HDR.pack(_MAGIC, tag, key[0], key[1], key[2], int(e.offset), len(ids) // width, width, int(e.text_part))
    return hdr + _CRC.pack(zlib.crc32(ids, zlib.crc32(hdr))) + ids


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
        at, n, width, crc, text_part, off = got
        ids = os.pread(self.fd, n * width, at)
        hdr = _HDR.pack(_MAGIC, self.tag, key[0], key[1], key[2], off, n, width, int(text_part))
        if len(ids) != n * width or zlib.crc32(ids, zlib.crc32(hdr)) != crc:
            del self.entries[key]
            return None
        return TokenEntry(np.frombuffer(ids, np.uint16 if width == 2 else np.uint32).astype(np.int32), off, text_part)


class TokenCache:
    """The token cache in folder ``root``, at most ``limit_bytes`` of blocks. ``stats`` counts this
    process's work: hits, misses, bytes read, entries and bytes written, corrupt entries met,
    entries dropped (writer behind), evictions."""

    def __init__(self, root: str, limit_bytes: int) -> None:
        self.root = os.path.abspath(root)
        self.limit = int(limit_bytes)
        self._dir = os.path.join(self.root, "blocks")
        self._mu = threading.Lock()
        self._blocks: collections.OrderedDict[str, _Block] = collections.OrderedDict()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queued = 0  # bytes of ids waiting for the writer
        self._writer: threading.Thread | None = None
        self._since_check = _CHECK_BYTES  # check the folder's size on the first write
        self._warned: set[str] = set()
        self.disabled: str | None = None
        self.stats = dict.fromkeys(
            ("hits", "misses", "bytes_read", "written", "bytes_written", "corrupt", "dropped", "evictions"), 0
        )
        try:
            os.makedirs(self._dir, exist_ok=True)
            if not os.access(self._dir, os.W_OK):
                raise PermissionError("the folder is not writable")
        except OSError as e:
            self._disable(f"cannot use the folder ({e})")

    def __repr__(self) -> str:
        return f"TokenCache({self.root!r}, limit={self.limit / 1e9:g} GB)"

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` of :attr:`stats` (thread-safe)."""
        with self._mu:
            self.stats[name] += n

    def _warn(self, kind: str, reason: str) -> None:
        with self._mu:
            if kind in self._warned:
                return
            self._warned.add(kind)
        warnings.warn(
            f"zephon's token cache {self.root!r}: {reason}; documents are tokenized without it. "
            f"Point ${ENV_DIR} at a writable local folder with room, or raise ${ENV_GB}.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        self._warn("disabled", reason)

    # -- keys ----------------------------------------------------------------------------------
    @staticmethod
    def settings_key(tokenizer_fingerprint: str, cut: str = "") -> str:
        """The settings part of a block's name: the tokenizer's fingerprint, and ``cut`` (how the
        parts of a long document are made; empty for whole documents)."""
        return _digest("settings", FORMAT_VERSION, tokenizer_fingerprint, cut)

    @staticmethod
    def shard_key(format: str, text_field: str, text_mode: str, size: int, content: str) -> str:
        """The shard part of a block's name: how its texts are read and its content's identity."""
        return _digest("shard", format, text_field, text_mode, size, content)

    def block_path(self, settings: str, shard: str, record: int) -> tuple[str, bytes]:
        """The file of the block that holds ``record``'s entries, and the tag its frames carry."""
        d = _digest(settings, shard, record // BLOCK_RECORDS)
        return os.path.join(self._dir, d[:2], d), bytes.fromhex(d[:16])

    # -- reading -------------------------------------------------------------------------------
    def _block(self, path: str, tag: bytes) -> _Block:
        drop = []
        with self._mu:
            b = self._blocks.get(path)
            if b is None:
                b = self._blocks[path] = _Block(path, tag)
                while len(self._blocks) > _BLOCKS_KEPT:
                    drop.append(self._blocks.popitem(last=False)[1])
            else:
                self._blocks.move_to_end(path)
        for old in drop:
            with old.lock:
                old.close()
        return b

    def get_many(self, path: str, tag: bytes, keys: Sequence[tuple[int, int, int]]) -> list[TokenEntry | None]:
        """The entries of ``keys`` (record, part, parts) in block ``path`` (None: a miss)."""
        if self.disabled is not None:
            return [None] * len(keys)
        b = self._block(path, tag)
        out: list[TokenEntry | None] = []
        corrupt = nbytes = 0
        with b.lock:
            try:
                if any(k not in b.entries for k in keys):
                    b.refresh()
                for k in keys:
                    had = b.entries.get(k)
                    e = b.read(k)
                    corrupt += had is not None and e is None
                    nbytes += 0 if e is None or had is None else had[1] * had[2]
                    out.append(e)
            except OSError:  # unreadable: misses (the writer repairs or replaces the block)
                out += [None] * (len(keys) - len(out))
            now = time.time()
            if any(e is not None for e in out) and now - b.touched > _TOUCH_S:
                b.touched = now
                with contextlib.suppress(OSError):
                    os.utime(path, (now, now))
        hits = sum(e is not None for e in out)
        self.count("hits", hits)
        self.count("misses", len(keys) - hits)
        self.count("corrupt", corrupt)
        self.count("bytes_read", nbytes)
        return out

    def present(self, path: str, tag: bytes, keys: Sequence[tuple[int, int, int]]) -> list[bool]:
        """Whether block ``path`` holds an entry of each of ``keys`` (no ids read or checked,
        nothing counted): what a warm job skips, what ``zephon inspect`` calls warm."""
        if self.disabled is not None:
            return [False] * len(keys)
        b = self._block(path, tag)
        with b.lock:
            with contextlib.suppress(OSError):
                b.refresh()
            return [k in b.entries for k in keys]

    # -- writing -------------------------------------------------------------------------------
    def put_many(
        self, path: str, tag: bytes, width: int, items: Sequence[tuple[tuple[int, int, int], TokenEntry]]
    ) -> None:
        """Queue ``items`` ((key, entry) pairs) for the background writer to append to block
        ``path``; dropped when the writer is too far behind (the cache is optional)."""
        if self.disabled is not None or not items:
            return
        n = sum(e.tokens.size * width for _, e in items)
        with self._mu:
            if self._queued + n > _QUEUE_BYTES:
                self.stats["dropped"] += len(items)
                return
            self._queued += n
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, name="zephon-token-cache", daemon=True)
                self._writer.start()
        self._queue.put((path, tag, width, list(items), n))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until the queued entries are written (tests, benchmarks, the end of a process)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._mu:
                if self._queued == 0 and self._queue.unfinished_tasks == 0:
                    return True
            time.sleep(0.005)
        return False

    def _write_loop(self) -> None:
        while True:
            path, tag, width, items, n = self._queue.get()
            try:
                self.append(path, tag, width, items)
            except OSError as e:
                self._warn("write", f"writing a block failed ({e})")
            except Exception as e:  # never let the writer die on one bad batch
                self._warn("write", f"writing a block failed ({type(e).__name__}: {e})")
            finally:
                with self._mu:
                    self._queued -= n
                self._queue.task_done()

    def append(
        self, path: str, tag: bytes, width: int, items: Sequence[tuple[tuple[int, int, int], TokenEntry]]
    ) -> int:
        """Append the entries of ``items`` that block ``path`` lacks, under its exclusive lock
        (the tail after the last valid frame truncated first); returns the bytes written."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    same = os.stat(path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:  # evicted between open and lock: open the new file
                    continue
                return self._append_locked(fd, path, tag, width, items)
            finally:
                os.close(fd)

    def _append_locked(self, fd: int, path: str, tag: bytes, width: int, items: Sequence[Any]) -> int:
        b = self._block(path, tag)
        with b.lock:
            b.refresh()
            size = os.fstat(fd).st_size
            if size > b.end:  # an incomplete or corrupt tail (a writer killed mid-append)
                os.ftruncate(fd, b.end)
            fresh = [(k, e) for k, e in dict(items).items() if b.read(k) is None]
            if not fresh:
                return 0
            buf = b"".join(frame(tag, k, e, width) for k, e in fresh)
            os.pwrite(fd, buf, b.end)
            b.refresh()
        self.count("written", len(fresh))
        self.count("bytes_written", len(buf))
        self._since_check += len(buf)
        if self._since_check >= min(_CHECK_BYTES, self.limit // 16):
            self._since_check = 0
            self.evict()
        return len(buf)

    def evict(self) -> int:
        """Remove least recently used blocks (not held by a writer) until the folder is under the
        cap (to 90% of it); returns how many were removed."""
        gone = 0
        gfd = os.open(os.path.join(self.root, "evict.lock"), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(gfd, fcntl.LOCK_EX)
            files, total = [], 0
            for sub in os.scandir(self._dir):
                if not sub.is_dir():
                    continue
                for de in os.scandir(sub.path):
                    with contextlib.suppress(OSError):
                        st = de.stat()
                        files.append((st.st_mtime, st.st_size, de.path))
                        total += st.st_size
            if total <= self.limit:
                return 0
            for _, nbytes, p in sorted(files):
                if total <= 0.9 * self.limit:
                    break
                if self._evict_one(p):
                    total -= nbytes
                    gone += 1
        finally:
            os.close(gfd)
        self.count("evictions", gone)
        return gone

    @staticmethod
    def _evict_one(path: str) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def size_bytes(self) -> int:
        """Bytes of all blocks in the folder."""
        total = 0
        for dirpath, _, names in os.walk(self._dir):
            for n in names:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(dirpath, n))
        return total

    def close(self) -> None:
        """Write what is queued (bounded wait) and drop this process's open blocks."""
        self.flush(10.0)
        with self._mu:
            blocks, self._blocks = list(self._blocks.values()), collections.OrderedDict()
        for b in blocks:
            with b.lock:
                b.close()


_SHARDS: dict[tuple[str, int], str | None] = {}
_SHARDS_MU = threading.Lock()


def shard_identity(ix: Any, s: int) -> str | None:
    """The content identity of shard ``s`` of text dataset ``ix`` (:meth:`TokenCache.shard_key`
    of how it is read, its size and the digest of its index arrays: every read unit's CRC-32,
    offsets and lengths); None for an index whose records are not texts (nothing to cache)."""
    if not isinstance(ix, DatasetIndex) or not ix.fingerprint:
        return None
    k = (ix.fingerprint, s)
    got = _SHARDS.get(k, "")
    if got != "":
        return got
    meta = ix.shards[s]
    try:
        content = content_version(ix._shard(s))
    except KeyError:  # arrays without the read units' CRCs: the storage's identity, and the path
        content = f"{meta.path}\0{meta.version}"
    key = TokenCache.shard_key(ix.format, ix.text_field, ix.text_mode, meta.size_bytes, content)
    with _SHARDS_MU:
        if len(_SHARDS) > 1 << 16:
            _SHARDS.clear()
        _SHARDS[k] = key
    return key


_CACHES: dict[tuple[int, str, str], TokenCache] = {}
_CACHES_MU = threading.Lock()


def cache_setting() -> tuple[str, str] | None:
    """The token cache this process's environment sets: ``($ZEPHON_TOKEN_CACHE, $ZEPHON_TOKEN_CACHE_GB)``,
    None when the folder is unset or empty. A pipeline reads it once when it is built and carries it
    to its worker processes (a worker started earlier may have another environment)."""
    root = os.environ.get(ENV_DIR, "").strip()
    return (os.path.abspath(root), os.environ.get(ENV_GB, "").strip()) if root else None


def token_cache(setting: tuple[str, str] | bool | None = True) -> TokenCache | None:
    """This process's token cache for ``setting`` (a :func:`cache_setting`; the default: the
    environment's now): the folder (``$ZEPHON_TOKEN_CACHE``; unset or empty: no cache) and the cap
    (``$ZEPHON_TOKEN_CACHE_GB``, default 32). One instance per process and setting."""
    if setting is True:
        setting = cache_setting()
    if not setting:
        return None
    root, gb = setting
    k = (os.getpid(), root, gb)
    with _CACHES_MU:
        c = _CACHES.get(k)
        if c is None:
            limit = float(gb) if gb else env_number(ENV_GB, _DEFAULT_GB)
            c = _CACHES[k] = TokenCache(root, int(limit * 1e9))
        return c


@atexit.register
def _flush_at_exit() -> None:  # entries still queued are written when the process ends normally
    for k, c in list(_CACHES.items()):
        if k[0] == os.getpid():
            c.flush(10.0)
