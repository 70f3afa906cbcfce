"""A node-local cache of token ids, keyed by content, shared by every run, job and worker of a node.

Why: ablations read the same corpus again and again (another mixture, filter, seed), often several
jobs at once on one node, and the tokenizer is the ceiling of a text pipeline. A document's ids
depend only on its bytes, the tokenizer and the tokenize settings, so with ``$ZEPHON_TOKEN_CACHE``
set to a local folder the run that tokenizes a document writes its ids there (on a background
thread, off the critical path: :mod:`.tokenwriter`) and any later run or concurrent job whose key matches reads them
instead of tokenizing. A conversation's ids and assistant turns likewise depend only on its bytes,
the renderer (tokenizer, chat template) and how the record is read (its encoder's settings key;
entries at 32 bits, the ids then the turns' bounds). It is a setting of the node, like the shard
cache: not part of the data definition or its fingerprint, and the batches are byte-identical
with it cold, warm, partial, corrupted or absent.

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

With ``$ZEPHON_TOKEN_CACHE_REMOTE`` set to an fsspec URL the blocks are also shared through object
storage by the nodes of a cluster (:mod:`.tokenremote`): a block that lacks entries locally is
merged with the checked entries of its published versions before it is read, and blocks this
process wrote are published in the background.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import fcntl
import hashlib
import multiprocessing.util
import os
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

from .index import DatasetIndex, content_version
from .retry import env_number
from .tokenblock import FORMAT_VERSION, TokenEntry, _Block, checked_entries, frame, frames, width_of
from .tokenremote import ENV_REMOTE, RemoteTier
from .tokenwriter import GatheringWriter

__all__ = [
    "BLOCK_RECORDS",
    "ENV_DIR",
    "ENV_GB",
    "ENV_REMOTE",
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
_BLOCKS_KEPT = 64  # block indexes (and open files) a process keeps
_TOUCH_S = 5.0  # a block's last-use time is refreshed at most this often per process
_CHECK_BYTES = 64 << 20  # the folder's size is checked against the cap after this many written


def _digest(*parts: Any) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:40]


class TokenCache:
    """The token cache in folder ``root``, at most ``limit_bytes`` of blocks, shared through the
    object-storage tier at URL ``remote`` if given. ``stats`` counts this process's work: hits,
    misses, bytes read, entries and bytes written, corrupt entries met, entries dropped (writer
    behind), evictions; and of the remote tier: entries merged from it (``remote_hits``), bytes
    fetched, corrupt versions or entries ignored, versions and bytes published."""

    def __init__(self, root: str, limit_bytes: int, remote: str = "") -> None:
        self.root = os.path.abspath(root)
        self.limit = int(limit_bytes)
        self._dir = os.path.join(self.root, "blocks")
        self._mu = threading.Lock()
        self._blocks: collections.OrderedDict[str, _Block] = collections.OrderedDict()
        self._writer = GatheringWriter(self._write_one)
        self._since_check = _CHECK_BYTES  # check the folder's size on the first write
        self._folders: set[str] = set()  # block folders known to exist
        self._warned: set[str] = set()
        self.disabled: str | None = None
        self.stats = dict.fromkeys(
            ("hits", "misses", "bytes_read", "written", "bytes_written", "corrupt", "dropped", "evictions")
            + ("remote_hits", "remote_bytes", "remote_corrupt", "published", "bytes_published"),
            0,
        )
        self._remote_url = remote
        self.remote = RemoteTier(remote, self.pack, self.count, self._warn_remote) if remote else None
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

    def _warn_remote(self, reason: str) -> None:
        warnings.warn(
            f"zephon's token cache: the remote tier {self._remote_url!r} is given up for this process ({reason}); "
            f"the local cache {self.root!r} goes on alone (batches are unchanged). Check the storage and its "
            f"credentials, or unset ${ENV_REMOTE}.",
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

    def get_many(
        self, path: str, tag: bytes, keys: Sequence[tuple[int, int, int]], counted: bool = True
    ) -> list[TokenEntry | None]:
        """The entries of ``keys`` (record, part, parts) in block ``path`` (None: a miss);
        ``counted``: hits, misses and bytes in :attr:`stats` (not for a recipe's token estimates:
        those are the loader's counts)."""
        if self.disabled is not None:
            return [None] * len(keys)
        b = self._block(path, tag)
        self._pull_lacking(b, keys)
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
        self.count("corrupt", corrupt)  # met by anyone: the entry is forgotten, and re-tokenized
        if counted:
            hits = sum(e is not None for e in out)
            self.count("hits", hits)
            self.count("misses", len(keys) - hits)
            self.count("bytes_read", nbytes)
        return out

    def present(self, path: str, tag: bytes, keys: Sequence[tuple[int, int, int]]) -> list[bool]:
        """Whether block ``path`` holds an entry of each of ``keys`` (no ids read or checked,
        nothing counted): what a warm job skips, what ``zephon inspect`` calls warm."""
        if self.disabled is not None:
            return [False] * len(keys)
        b = self._block(path, tag)
        self._pull_lacking(b, keys)
        with b.lock:
            with contextlib.suppress(OSError):
                b.refresh()
            return [k in b.entries for k in keys]

    # -- the remote tier -----------------------------------------------------------------------
    def _pull_lacking(self, b: _Block, keys: Sequence[tuple[int, int, int]]) -> None:
        """With a remote tier, merge block ``b``'s published versions into it first if it lacks
        any of ``keys`` (one listing per block per minute at most)."""
        if self.remote is None or self.remote.failed is not None:
            return
        with b.lock:
            with contextlib.suppress(OSError):
                if any(k not in b.entries for k in keys):
                    b.refresh()
            lacking = any(k not in b.entries for k in keys)
        if lacking:
            self.pull(b.path, b.tag)

    def pull(self, path: str, tag: bytes) -> int:
        """Merge into block ``path`` the intact entries of its remote versions not fetched yet
        (each version checked against its digest, each entry against its tag and CRC); returns
        the entries added."""
        added = 0

        def merge(data: bytes) -> None:
            nonlocal added
            by_width, bad = checked_entries(data, tag)
            self.count("remote_corrupt", bad)
            for width, items in by_width.items():
                with contextlib.suppress(OSError):
                    added += self.append(path, tag, width, items, pulled=True)

        if self.remote is not None:
            self.remote.fetch_new(os.path.basename(path), merge)
        return added

    def pack(self, path: str, tag: bytes) -> bytes | None:
        """What to publish of block ``path``: its intact entries in key order (equal entries give
        equal bytes, so one object name); None when it holds none or cannot be read."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        by_width, _ = checked_entries(data, tag)
        frames = sorted((k, frame(tag, k, e, w)) for w, items in by_width.items() for k, e in items)
        return b"".join(f for _, f in frames) or None

    def publish(self, paths: Sequence[str] | None = None) -> int:
        """Publish now the blocks this process wrote (those of ``paths``; default all) to the
        remote tier; returns the objects written (0 without a tier)."""
        return 0 if self.remote is None else self.remote.publish(paths=paths)

    # -- writing -------------------------------------------------------------------------------
    def put_many(
        self, path: str, tag: bytes, width: int, items: Sequence[tuple[tuple[int, int, int], TokenEntry]]
    ) -> None:
        """Queue ``items`` ((key, entry) pairs) for the background writer to append to block
        ``path``; dropped when the writer is too far behind (the cache is optional)."""
        if self.disabled is not None or not items:
            return
        if not self._writer.put(path, tag, width, list(items), sum(e.tokens.size * width for _, e in items)):
            self.count("dropped", len(items))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until the queued entries are written (tests, benchmarks, the end of a process)."""
        return self._writer.flush(timeout_s)

    def _write_one(self, path: str, tag: bytes, width: int, items: list[Any]) -> None:
        try:
            self.append(path, tag, width, items)
        except OSError as e:
            self._warn("write", f"writing a block failed ({e})")
        except Exception as e:  # never let the writer die on one bad batch
            self._warn("write", f"writing a block failed ({type(e).__name__}: {e})")

    def append(
        self,
        path: str,
        tag: bytes,
        width: int,
        items: Sequence[tuple[tuple[int, int, int], TokenEntry]],
        pulled: bool = False,
    ) -> int:
        """Append the entries of ``items`` that block ``path`` lacks, under its exclusive lock
        (the tail after the last valid frame truncated first); returns the bytes written, or with
        ``pulled`` (entries from the remote tier, not to be published again) the entries."""
        folder = os.path.dirname(path)
        if folder not in self._folders:  # made once per process (eviction removes files, not folders)
            os.makedirs(folder, exist_ok=True)
            self._folders.add(folder)
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
                return self._append_locked(fd, path, tag, width, items, pulled)
            finally:
                os.close(fd)

    def _append_locked(self, fd: int, path: str, tag: bytes, width: int, items: Sequence[Any], pulled: bool) -> int:
        b = self._block(path, tag)
        with b.lock:
            b.refresh()
            st = os.fstat(fd)
            if st.st_size > b.end:  # an incomplete or corrupt tail (a writer killed mid-append)
                os.ftruncate(fd, b.end)
            fresh = [(k, e) for k, e in dict(items).items() if b.read(k) is None]
            if not fresh:
                return 0
            buf, places = frames(tag, fresh, width)
            os.pwrite(fd, buf, b.end)
            if b.fd >= 0 and b.ino == st.st_ino:  # what was just written, without reading it back
                b.entries.update((k, (b.end + p[0], *p[1:])) for k, p in places)
                b.end += len(buf)
            else:
                b.refresh()
        if pulled:
            self.count("remote_hits", len(fresh))
        else:
            self.count("written", len(fresh))
            self.count("bytes_written", len(buf))
            if self.remote is not None:
                self.remote.wrote(os.path.basename(path), path, tag)
        self._since_check += len(buf)
        if self._since_check >= min(_CHECK_BYTES, self.limit // 16):
            self._since_check = 0
            self.evict()
        return len(fresh) if pulled else len(buf)

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
        """Write what is queued (bounded wait), publish what this process wrote to the remote
        tier, and drop this process's open blocks."""
        self.flush(10.0)
        self.publish()
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


_CACHES: dict[tuple[int, str, str, str], TokenCache] = {}
_CACHES_MU = threading.Lock()
Setting = tuple[str, str, str]  # folder, cap in GB, remote tier URL


def cache_setting() -> Setting | None:
    """The token cache this process's environment sets: ``($ZEPHON_TOKEN_CACHE, $ZEPHON_TOKEN_CACHE_GB,
    $ZEPHON_TOKEN_CACHE_REMOTE)``, None when the folder is unset or empty. A pipeline reads it once
    when it is built and carries it to its worker processes (a worker started earlier may have
    another environment)."""
    root = os.environ.get(ENV_DIR, "").strip()
    if not root:
        return None
    return os.path.abspath(root), os.environ.get(ENV_GB, "").strip(), os.environ.get(ENV_REMOTE, "").strip()


def token_cache(setting: Setting | bool | None = True) -> TokenCache | None:
    """This process's token cache for ``setting`` (a :func:`cache_setting`; the default: the
    environment's now): the folder (``$ZEPHON_TOKEN_CACHE``; unset or empty: no cache), the cap
    (``$ZEPHON_TOKEN_CACHE_GB``, default 32) and the remote tier (``$ZEPHON_TOKEN_CACHE_REMOTE``,
    an fsspec URL; unset: none). One instance per process and setting."""
    if setting is True:
        setting = cache_setting()
    if not setting:
        return None
    root, gb, remote = setting
    k = (os.getpid(), root, gb, remote)
    with _CACHES_MU:
        c = _CACHES.get(k)
        if c is None:
            limit = float(gb) if gb else env_number(ENV_GB, _DEFAULT_GB)
            c = _CACHES[k] = TokenCache(root, int(limit * 1e9), remote)
        return c


@atexit.register
def _flush_at_exit() -> None:  # queued entries are written, and published, when the process ends normally
    for k, c in list(_CACHES.items()):
        if k[0] == os.getpid():
            c.flush(10.0)
            c.publish()


# worker processes (forkserver, fork) end through multiprocessing, which runs its finalizers, not atexit
multiprocessing.util.Finalize(None, _flush_at_exit, exitpriority=1)
