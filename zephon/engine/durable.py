"""Files that survive a crash: written whole or not at all, and on disk when the call returns.

A checkpoint written with ``open(tmp, "w")`` + ``os.replace(tmp, path)`` is atomic for readers
but not durable: after a power loss the new name can point at an empty or torn file, because
neither the file's data nor the rename reached the disk. :func:`write_atomic` fsyncs the file
before the rename and the folder after it. Each call uses its own temporary name in the target's
folder, so two writers of one path never trip over each other's temporary file (the last
complete write wins), and a failed write (a full disk) removes its temporary file and names the
target in its error. A write interrupted by an exception of any kind (Ctrl-C, a SIGTERM handler's
exit) removes its temporary file too, and :func:`abandon_pending` removes those of writes still
running when a process must exit at once (``os._exit``): the target is the previous complete file
or the new one, never a torn one, and no temporary file stays behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import threading

__all__ = ["abandon_pending", "write_atomic"]

_pending: set[str] = set()  # temporary files of the writes in progress (any thread)
_pending_lock = threading.Lock()


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (see the module docstring). Raises
    :class:`OSError` naming ``path`` when it cannot (no temporary file is left behind).

    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "state.json")
    >>> write_atomic(p, b"{}")
    >>> open(p, "rb").read(), os.listdir(os.path.dirname(p))
    (b'{}', ['state.json'])
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        with _pending_lock:
            _pending.add(tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _forget(tmp)
        tmp = None
        _fsync_folder(folder)
    except BaseException as e:  # a full disk, or an interruption (Ctrl-C, SIGTERM): no temp file left
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            _forget(tmp)
        if not isinstance(e, OSError):
            raise
        reason = e.strerror or str(e)
        hint = " (the disk is full: free space or write elsewhere)" if e.errno == errno.ENOSPC else ""
        raise OSError(e.errno, f"cannot write {path}: {reason}{hint}") from e


def abandon_pending() -> list[str]:
    """Remove the temporary files of the writes in progress and return their names: for a
    process about to end with ``os._exit`` (a shutdown past its grace period), whose writing
    threads will never reach their own clean-up. Their targets keep their previous content."""
    with _pending_lock:
        names = sorted(_pending)
        _pending.clear()
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(name)
    return names


def _forget(tmp: str) -> None:
    with _pending_lock:
        _pending.discard(tmp)


def _fsync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable (where the platform lets a folder be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # e.g. Windows: a folder cannot be opened; NTFS journals the rename
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
