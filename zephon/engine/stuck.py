"""Where a hung call is stuck: the line of the user's function or of the read it waits in,
for a thread worker (its live stack) and for a process worker (a stack dump on a signal).

Why: a call past ``timeout_s`` is named by the code it is stuck in, not by the pool that ran it:
"stuck at filters.py:12 in is_spam" tells the user what to fix."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import sys
import sysconfig
import time
import traceback
from collections.abc import Sequence
from typing import Any

__all__ = ["dump_stacks_on_signal", "where_processes_stuck", "where_stuck"]

_STDLIB = os.path.normpath(sysconfig.get_paths()["stdlib"]) + os.sep
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
_ZEPHON = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: the signal that makes a process worker write its stacks (see :func:`dump_stacks_on_signal`)
DUMP_SIGNAL: int | None = getattr(signal, "SIGUSR2", None)
_dump_file: Any = None  # (in a worker) the open file faulthandler writes to


def _place(frames: Sequence[tuple[str, int, str]]) -> str:
    """``file:line in function`` of the innermost frame (outermost first) outside the standard
    library (and not ``<string>``: a fork server's own code) and, when that one is in an
    installed library, the innermost frame of zephon or of the user's own code that called it;
    '' without such a frame."""
    frames = [f for f in frames if not (f[0].startswith("<") or os.path.normpath(f[0]).startswith(_STDLIB))]
    if not frames:
        return ""
    path, line, name = frames[-1]
    text = f"{path}:{line} in {name}"
    if any(p in path for p in _INSTALLED) and not path.startswith(_ZEPHON):
        own = [f for f in frames if f[0].startswith(_ZEPHON) or not any(p in f[0] for p in _INSTALLED)]
        if own:
            text += f", called from {own[-1][0]}:{own[-1][1]} in {own[-1][2]}"
    return text


def where_stuck(ident: int) -> str:
    """Where thread ``ident`` of this process is now (see :func:`_place`); '' when it is gone."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return ""
    return _place([(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack(frame)])


def dump_stacks_on_signal(folder: str) -> None:
    """Worker-start step of a process worker: :data:`DUMP_SIGNAL` writes its threads' stacks to
    ``folder/<pid>`` (``faulthandler``: safe in any state, even inside C code). Never raises."""
    global _dump_file
    if DUMP_SIGNAL is None:
        return
    try:
        _dump_file = open(os.path.join(folder, str(os.getpid())), "w")  # kept open: the signal writes to it
        faulthandler.register(DUMP_SIGNAL, file=_dump_file, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        _dump_file = None


_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.+)$')


def where_processes_stuck(folder: str, pids: Sequence[int], wait_s: float = 1.0) -> str:
    """Where the process workers ``pids`` that are inside a task are now, each named with its
    pid: signals each to dump its stacks into ``folder`` (see :func:`dump_stacks_on_signal`) and
    reads the dumps that arrive within ``wait_s`` seconds; '' when none is inside a task."""
    if DUMP_SIGNAL is None:
        return ""
    before: dict[int, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            before[pid] = os.path.getsize(os.path.join(folder, str(pid)))
            os.kill(pid, DUMP_SIGNAL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_size(folder, pid) <= n for pid, n in before.items()):
        time.sleep(0.05)
    time.sleep(0.1)  # a dump is written at once, in one go: let the last one finish
    places: list[str] = []
    for pid, n in before.items():
        with contextlib.suppress(OSError), open(os.path.join(folder, str(pid))) as f:
            f.seek(n)
            text = f.read()
            for block in text.split("\n\n"):  # one block per thread, innermost frame first
                frames = [m.groups() for m in map(_FRAME.match, block.splitlines()) if m]
                if any(name.strip() == "_process_worker" for _, _, name in frames):  # the task-running thread
                    place = _place([(path, int(line), name.strip()) for path, line, name in reversed(frames)])
                    if place:  # (an idle worker waits in the standard library only)
                        places.append(f"{place} (worker process {pid})")
    return "; ".join(places)


def _size(folder: str, pid: int) -> int:
    try:
        return os.path.getsize(os.path.join(folder, str(pid)))
    except OSError:
        return -1
