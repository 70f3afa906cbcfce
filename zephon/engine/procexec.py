"""A process executor whose worker starts cannot be cut short by a signal (see
:class:`ProcessExecutor`), and the helpers that stop its workers in bounded time;
:class:`zephon.engine.workers.WorkerPool` runs process workers on it."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["ProcessExecutor", "pid_running", "release_manager", "stop_processes"]


class ProcessExecutor(cf.ProcessPoolExecutor):
    """A process executor whose workers start on a helper thread, never cut short half-way.

    Why: the executor starts a worker inside ``submit`` (Python >= 3.9 starts them as tasks
    arrive), and a start under the fork server waits for the server (seconds the first time: it
    imports zephon). SIGTERM or Ctrl-C then raises in that wait (Python runs signal handlers in
    the main thread), after the worker's start data was sent but before the executor listed the
    process: nothing joined it, and once this process had exited (removing the queues'
    semaphores) the half-started worker failed unpickling them and printed a traceback. On a
    helper thread the start always completes and lists the process, while the caller's wait
    stays interruptible; :meth:`zephon.engine.workers.WorkerPool.close` waits for starts in progress
    (:meth:`wait_for_starts`) before it stops the workers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._starts: list[threading.Thread] = []
        self._starts_lock = threading.Lock()
        self._left = False  # closed without waiting for the starts in progress
        self._recording = _Recording(self._mp_context)
        self._mp_context = self._recording  # type: ignore[assignment]

    def _spawn_process(self) -> None:
        done = threading.Event()
        error: list[BaseException] = []

        def start() -> None:
            try:
                super(ProcessExecutor, self)._spawn_process()  # type: ignore[misc]
            except BaseException as e:
                error.append(e)
            finally:
                done.set()
                proc = self._recording.made()
                if self._left and proc is not None and proc.pid is not None:
                    proc.kill()  # the pool closed while this start waited: stop what it started
                    proc.join(5.0)

        t = threading.Thread(target=start, name="zephon-worker-start", daemon=True)
        with self._starts_lock:
            self._starts = [s for s in self._starts if s.is_alive()]
            self._starts.append(t)
        t.start()
        done.wait()  # interruptible (a signal's handler raises here); the start goes on
        if error:
            raise error[0]

    def wait_for_starts(self, timeout: float = 60.0) -> None:
        """Wait (up to ``timeout`` seconds) for worker starts in progress to list their processes;
        a start still in progress then is left to stop its process itself once it has one.

        Why a bound: a start waits for the fork server, which imports zephon before its first
        fork (seconds on a busy machine), and a close after SIGTERM waited for that (2-7 s) to
        stop a process not yet made. Left, the start either never forks (once this process has
        exited, the server sees the end of its pipe and exits without forking) or kills what it
        started. The window in which a fork is done but the process not yet listed is
        milliseconds, well inside the bound."""
        with self._starts_lock:
            starts, self._starts = self._starts, []
            self._left = True
        deadline = time.monotonic() + timeout
        for t in starts:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in starts):
            _stop_fork_server()


class _Recording:
    """A multiprocessing context that notes the process each thread made last (the executor's
    own ``_spawn_process`` keeps it in a local; a start runs on a thread of its own)."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def Process(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 -- the context's own name
        proc = self._local.process = self._ctx.Process(*args, **kwargs)
        return proc

    def made(self) -> Any:
        """The process this thread made last, or None."""
        return getattr(self._local, "process", None)


def _stop_fork_server() -> None:
    """Kill this interpreter's fork server (a start still waits for it: it has not forked the
    process yet, or it would have been listed). Its connection then ends, so the start fails
    and forks nothing that could outlive this process half-started (such a worker printed a
    traceback, its queues gone); the next pool starts a new server."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def stop_processes(procs: Sequence[Any], grace_s: float) -> None:
    """Stop a closing pool's worker processes, all at once: wait ``grace_s`` for them to exit
    (an idle worker exits on the executor's shutdown), terminate the rest, then kill what is
    left. Why all at once: joining each in turn made a close (and the exit after SIGTERM) take
    seconds per busy worker; this takes at most ``grace_s`` + 4 s whatever the worker count."""
    left = _wait_processes(procs, grace_s)
    for p in left:  # inside a task (or hung in user code): stop it
        p.terminate()
    left = _wait_processes(left, 2.0)
    for p in left:
        p.kill()
    _wait_processes(left, 2.0)


def _wait_processes(procs: Sequence[Any], timeout: float) -> list[Any]:
    """Wait up to ``timeout`` seconds for all of ``procs`` to exit together; those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if p.is_alive()]  # (is_alive reaps the ones that exited)
    while alive and (left := deadline - time.monotonic()) > 0:
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=left)
        alive = [p for p in alive if p.is_alive()]
    return alive


def release_manager(manager: threading.Thread | None, results: Any) -> None:
    """Let a process executor's management thread end once its workers are gone.

    Why: a worker killed while writing its result leaves half a message in the result pipe; the
    management thread then waits for the rest forever (the pool never reports the death, and the
    interpreter's exit joins that thread, so the process never exits). With the workers gone,
    closing this process's copy of the pipe's write end turns that wait into end-of-file, which
    the executor handles as a broken pool and ends."""
    if manager is None or results is None:
        return
    manager.join(timeout=2)
    if manager.is_alive():
        writer = getattr(results, "_writer", None)
        if writer is not None:
            with contextlib.suppress(OSError):
                writer.close()
        manager.join(timeout=5)


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux: /proc; elsewhere ``kill(pid, 0)``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
