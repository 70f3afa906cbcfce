"""Worker pools shared by all lanes of a rank.

One pool of threads or processes per (backend, size) per rank: lanes submit their tasks to it
and put the results back in their own order, so 256 lanes on one rank do not mean 256 pools.
Pools are closed explicitly (never through ``__del__``).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["BACKENDS", "PoolSet", "ProcessLocal", "WorkerConfig", "WorkerPool"]

BACKENDS = ("thread", "process")


@dataclass(frozen=True)
class WorkerConfig:
    """How many workers an operator uses and of which kind. Never changes the data.

    ``count=0`` runs the work inline in the consumer's thread. ``timeout_s`` bounds how long the
    consumer waits for one task before it reports a hung worker.

    >>> WorkerConfig(4, "process").count
    4
    >>> WorkerConfig(2, "gpu")
    Traceback (most recent call last):
    ...
    ValueError: workers.backend must be one of ('thread', 'process'), got 'gpu'
    """

    count: int = 0
    backend: str = "thread"
    timeout_s: float = 300.0
    start_method: str = "forkserver"

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 0:
            raise ValueError(f"workers.count must be an integer >= 0 (0 = inline), got {self.count!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"workers.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"workers.timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if self.start_method not in mp.get_all_start_methods():
            raise ValueError(
                f"workers.start_method {self.start_method!r} is not available here; "
                f"use one of {mp.get_all_start_methods()}"
            )


def _lifeline(main_pid: int) -> None:
    """Initializer of every process worker: the worker dies with the process that started its
    pool, however that one ends (SIGKILL included), and leaves Ctrl-C to it.

    Why: a worker blocks on its task queue, and each worker (and the fork server) holds pipe
    ends that keep the others alive, so after the main process is killed (what a scheduler does
    on preemption) nothing would ever tell them to exit. A daemon thread waits on a pidfd of the
    main process (readable when it exits; polling ``kill(pid, 0)`` where pidfds are missing)
    and ends the worker. Under a fork server the worker's parent is the server, so
    ``PR_SET_PDEATHSIG`` also ends it if the server dies first; it is not set when the parent is
    the main process, where it would fire when the *thread* that started the worker exits.
    Once the workers are gone, the fork server and the resource tracker see their pipes close
    and exit by themselves."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    if sys.platform.startswith("linux") and os.getppid() != main_pid:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    fd: int | None = None
    try:
        fd = os.pidfd_open(main_pid)  # type: ignore[attr-defined,unused-ignore]  # Linux >= 5.3
    except ProcessLookupError:
        os._exit(1)  # the main process is already gone
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the main process has exited
        else:
            while True:
                time.sleep(1.0)
                try:
                    os.kill(main_pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    continue
        os._exit(1)

    threading.Thread(target=watch, name="zephon-lifeline", daemon=True).start()


class WorkerPool:
    """A lazily started thread or process pool with an idempotent ``close()``.

    Why lazy: a rank builds its pipelines (and pools) before it knows whether it will iterate;
    nothing starts until the first task.

    >>> pool = WorkerPool(WorkerConfig(2, "thread"))
    >>> pool.submit(pow, 2, 10).result()
    1024
    >>> pool.close(); pool.close()   # idempotent
    """

    def __init__(self, config: WorkerConfig) -> None:
        if config.count < 1:
            raise ValueError("a WorkerPool needs count >= 1; use inline execution for count=0")
        self.config = config
        self._executor: cf.Executor | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def executor(self) -> cf.Executor:
        """The underlying ``concurrent.futures`` executor, started on first use."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if self._executor is None:
                if self.config.backend == "thread":
                    self._executor = cf.ThreadPoolExecutor(self.config.count, thread_name_prefix="zephon-worker")
                else:
                    ctx = mp.get_context(self.config.start_method)
                    if self.config.start_method == "forkserver":
                        # children fork from a server that imported zephon once: fast starts,
                        # and no fork of this (threaded) process
                        ctx.set_forkserver_preload(["zephon"])
                    self._executor = cf.ProcessPoolExecutor(
                        self.config.count, mp_context=ctx, initializer=_lifeline, initargs=(os.getpid(),)
                    )
            return self._executor

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a closed pool takes no more tasks)."""
        return self._closed

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """Run ``fn(*args)`` on the pool; a future of its result."""
        return self.executor.submit(fn, *args)

    def close(self) -> None:
        """Stop the workers (processes hung in user code are terminated). Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ex, self._executor = self._executor, None
        if ex is None:
            return
        if isinstance(ex, cf.ProcessPoolExecutor):
            procs = list(getattr(ex, "_processes", {}).values())
            ex.shutdown(wait=False, cancel_futures=True)
            for p in procs:
                p.join(timeout=2)
                if p.is_alive():  # hung in user code: stop it
                    p.terminate()
                    p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            # let the executor's management thread finish
            ex.shutdown(wait=True)
        else:
            ex.shutdown(wait=True, cancel_futures=True)

    def __repr__(self) -> str:
        return f"WorkerPool({self.config.count} {self.config.backend}s)"


class PoolSet:
    """The pools of one rank, keyed by (backend, count, start method): shared by its lanes.

    >>> pools = PoolSet()
    >>> pools.get(WorkerConfig(2)) is pools.get(WorkerConfig(2)), pools.get(WorkerConfig(0))
    (True, None)
    >>> pools.close()
    """

    def __init__(self) -> None:
        self._pools: dict[tuple[str, int, str], WorkerPool] = {}
        self._lock = threading.Lock()

    def get(self, config: WorkerConfig) -> WorkerPool | None:
        """The shared pool for ``config``, or None for inline execution."""
        if config.count == 0:
            return None
        key = (config.backend, config.count, config.start_method)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None or pool.closed:
                pool = self._pools[key] = WorkerPool(config)
            return pool

    def close(self) -> None:
        """Close every pool of the set (a later :meth:`get` starts a new one)."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            p.close()

    def __repr__(self) -> str:
        return f"PoolSet({list(self._pools.values())})"


_PROCESS_OBJECTS: dict[str, Any] = {}


def _process_local(cls: type[Any], key: str, state: dict[str, Any]) -> Any:
    obj = _PROCESS_OBJECTS.get(key)
    if obj is None:
        obj = object.__new__(cls)
        obj.__dict__.update(state)
        _PROCESS_OBJECTS[key] = obj
    return obj


class ProcessLocal:
    """Base for worker functions that are expensive to unpickle (tokenizers, dataset handles).

    Pickled with every task sent to a process pool, but unpickled once per worker process: the
    first copy is kept under a key made at construction and reused by later tasks. Attributes
    named in ``_transient`` (caches) are not pickled.

    >>> import pickle
    >>> from zephon.engine.testing import AddOffset
    >>> fn = AddOffset(10)   # a ProcessLocal
    >>> a, b = pickle.loads(pickle.dumps(fn)), pickle.loads(pickle.dumps(fn))
    >>> a is b   # the second task's copy is the first one: unpickled once per process
    True
    """

    _transient: tuple[str, ...] = ()

    def __init__(self) -> None:
        import uuid

        self._process_key = uuid.uuid4().hex

    def __reduce__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in self._transient}
        return (_process_local, (type(self), self._process_key, state))
