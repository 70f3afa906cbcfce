"""Worker pools shared by all lanes of a rank.

One pool of threads or processes per (backend, size) per rank: lanes submit their tasks to it
and put the results back in their own order, so 256 lanes on one rank do not mean 256 pools.
Pools are closed explicitly (never through ``__del__``).

A pool runs its tasks demand-first: at most two per worker are inside the executor, the rest
wait in the pool's backlog in submission order, and a task the consumer is waiting for
(:meth:`WorkerPool.demand`) moves to the front. With many lanes each lane's next chunk is then
computed when it is needed, not after every earlier lane's lookahead. Process pools move
results through shared memory (:mod:`zephon.engine.arena`): large arrays arrive as views, not
copies. Neither changes a byte of any result.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import math
import multiprocessing as mp
import os
import pickle
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from .arena import ArenaSet, arena_available, arena_worker_start, run_packed
from .mainguard import refuse_unguarded_main
from .procexec import ProcessExecutor, pid_running, release_manager, stop_processes
from .stuck import dump_stacks_on_signal, where_processes_stuck, where_stuck
from .threadexec import ThreadExecutor

__all__ = ["BACKENDS", "PoolSet", "ProcessLocal", "WorkerConfig", "WorkerPool", "WorkerStart"]

#: a worker-start step: a picklable function and its arguments, run in every process worker
#: when it starts (see :meth:`WorkerPool.add_worker_start`)
WorkerStart = tuple[Callable[..., Any], tuple[Any, ...]]

BACKENDS = ("thread", "process")

#: seconds a closing pool waits for the calls its workers are inside before it stops them (process
#: workers: terminated); thread workers: after a call was reported hung (else up to ``timeout_s``),
#: then left to end with the process (daemons)
CLOSE_GRACE_S = 0.5


@dataclass(frozen=True)
class WorkerConfig:
    """How many workers an operator uses and of which kind. Never changes the data.

    ``count=0`` runs the work inline: one chunk at a time, asked for by the consumer's thread
    (computed on a serving thread of its own, see :mod:`zephon.engine.bounded`, so that
    ``timeout_s`` bounds it too). ``timeout_s`` bounds how long the consumer waits for one
    task before it reports a hung worker. ``shm_mb`` (process workers):
    the shared-memory budget of each worker's result arena in MiB; None sizes it from the
    in-flight budget (see :mod:`zephon.engine.arena`), 0 turns arenas off (results pickled).

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
    shm_mb: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 0:
            raise ValueError(f"workers.count must be an integer >= 0 (0 = inline), got {self.count!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"workers.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"workers.timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if self.shm_mb is not None and (
            not isinstance(self.shm_mb, int) or isinstance(self.shm_mb, bool) or self.shm_mb < 0
        ):
            raise ValueError(f"workers.shm_mb must be an integer >= 0 (0 = off) or None (auto), got {self.shm_mb!r}")
        if self.start_method not in mp.get_all_start_methods():
            raise ValueError(
                f"workers.start_method {self.start_method!r} is not available here; "
                f"use one of {mp.get_all_start_methods()}"
            )


def _parent_environment(env: dict[str, str]) -> None:
    """A worker-start step: the worker's environment is its parent's at the pool's start. Why: a
    forkserver child inherits the server's environment, fixed when the server started (the first
    process pool of this interpreter), so a setting made later (``ZEPHON_SHARD_CACHE``, storage
    credentials, a notebook's ``os.environ[...] = ...``) would reach the main process and not
    its workers."""
    os.environ.clear()
    os.environ.update(env)


def _run_worker_starts(steps: Sequence[WorkerStart]) -> None:
    """The one initializer of a process pool: run its worker-start steps in order, so that
    independent set-up steps (result arenas, a parent-death watch, ...) compose."""
    for fn, args in steps:
        fn(*args)


class _PoolFuture(cf.Future):
    """A task of a :class:`WorkerPool`: it waits in the pool's backlog until the executor has
    room; ``cancel()`` succeeds while it waits or before the executor starts it."""

    def __init__(self, pool: WorkerPool, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        super().__init__()
        self._pool, self._fn, self._args = pool, fn, args
        self._inner: cf.Future | None = None

    def cancel(self) -> bool:
        return self._pool._cancel(self)


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
    nothing starts until the first task. Tasks run demand-first (see the module doc).

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
        self._hung = False  # a call was reported hung (see report_hung)
        self._dumps: str | None = None  # process workers: the folder of their stack dumps
        self._drop_dumps: weakref.finalize | None = None
        # demand-first backlog: tasks wait here until fewer than `max_inside` are in the executor
        self._plock = threading.Lock()
        self._backlog: collections.deque[_PoolFuture] = collections.deque()
        self._inside = 0
        self.max_inside = 2 * config.count
        self._local = threading.local()
        self.tasks = 0
        self._in_flight = 0  # tasks the pool's users may hold in flight (see note_in_flight)
        # process pools: steps every worker runs when it starts; result arenas
        self._worker_starts: list[WorkerStart] = []
        self.arenas: ArenaSet | None = None
        self.shm_status = "off (thread workers)" if config.backend == "thread" else "not started"

    @property
    def executor(self) -> cf.Executor:
        """The underlying ``concurrent.futures`` executor, started on first use."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if self._executor is None:
                if self.config.backend == "thread":
                    self._executor = ThreadExecutor(self.config.count, "zephon-worker")
                else:
                    self._executor = self._start_processes()
            return self._executor

    # -- process workers --------------------------------------------------------------------
    def add_worker_start(self, fn: Callable[..., Any], *args: Any) -> None:
        """Add a step every process worker runs when it starts (before any task), after the
        ones added before. Steps must be picklable and should not raise (a failing initializer
        breaks the pool). Only before the pool has started."""
        with self._lock:
            if self._executor is not None:
                raise RuntimeError(f"{self!r} has started; add worker-start steps before its first task")
            self._worker_starts.append((fn, args))

    def _start_processes(self) -> cf.ProcessPoolExecutor:
        refuse_unguarded_main(self.config.start_method)
        ctx = mp.get_context(self.config.start_method)
        if self.config.start_method == "forkserver":
            # children fork from a server that imported zephon once: fast starts, and no fork
            # of this (threaded) process
            ctx.set_forkserver_preload(["zephon"])
        # the lifeline first: a worker dies with the main process even while a later step runs
        steps: list[WorkerStart] = [(_lifeline, (os.getpid(),)), (_parent_environment, (dict(os.environ),))]
        self._dumps = tempfile.mkdtemp(prefix="zephon-stacks-")  # where a hung worker's stack is written
        # removed by close(), or at the interpreter's exit when the pool was never closed
        self._drop_dumps = weakref.finalize(self, shutil.rmtree, self._dumps, True)
        steps.append((dump_stacks_on_signal, (self._dumps,)))
        steps += self._worker_starts
        self.arenas = self._start_arenas()
        if self.arenas is not None:
            steps.append((arena_worker_start, self.arenas.initargs()))
        return ProcessExecutor(
            self.config.count, mp_context=ctx, initializer=_run_worker_starts, initargs=(tuple(steps),)
        )

    def _start_arenas(self) -> ArenaSet | None:
        """One shared-memory result arena per worker, or None (off, unavailable, refused)."""
        mb = self.config.shm_mb
        if mb == 0:
            self.shm_status = "off (shm_mb = 0)"
            return None
        if not arena_available():
            self.shm_status = "off (no memfd_create or /proc on this platform)"
            return None
        try:
            arenas = ArenaSet(self.config.count, capacity=(mb << 20) if mb else None)
        except (OSError, ValueError) as e:  # e.g. RLIMIT_AS refuses the mappings
            self.shm_status = f"off ({type(e).__name__}: {e})"
            print(f"zephon: {self!r}: no shared-memory result arenas ({e}); results are pickled", file=sys.stderr)
            return None
        self.shm_status = "on"
        if self._in_flight:
            arenas.set_in_flight(math.ceil(self._in_flight / self.config.count))
        return arenas

    def lost_workers(self) -> list[int]:
        """Pids of this pool's process workers that are gone (exited, killed, or a zombie not yet
        reaped). Why: the executor notices a dead worker only through its management thread and
        the start method's sentinel; a consumer waiting for a result checks this too, so a killed
        worker surfaces within seconds even when that notice is late."""
        ex = self._executor
        if not isinstance(ex, cf.ProcessPoolExecutor):
            return []
        procs = dict(getattr(ex, "_processes", None) or {})
        return [pid for pid in procs if not pid_running(pid)]

    def note_in_flight(self, tasks: int) -> None:
        """A user of the pool may hold ``tasks`` more (or, negative, fewer) tasks in flight:
        the unit of the result arenas' automatic budget."""
        with self._plock:
            self._in_flight = max(0, self._in_flight + tasks)
            arenas = self.arenas
        if arenas is not None:
            arenas.set_in_flight(math.ceil(max(1, self._in_flight) / self.config.count))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a closed pool takes no more tasks)."""
        return self._closed

    # -- tasks ------------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """Run ``fn(*args)`` on the pool; a future of its result (as ``fn`` returned it)."""
        self.executor  # noqa: B018  (start the pool; raises if it is closed)
        fut = _PoolFuture(self, fn, args)
        with self._plock:
            self._backlog.append(fut)
            self.tasks += 1
        self._dispatch()
        return fut

    def demand(self, future: cf.Future) -> None:
        """The consumer waits for ``future``: run it before the backlog's other tasks."""
        if not isinstance(future, _PoolFuture) or future._inner is not None:
            return
        with self._plock:
            if future._inner is None and self._backlog and self._backlog[0] is not future:
                try:
                    self._backlog.remove(future)
                except ValueError:
                    return
                self._backlog.appendleft(future)
        self._dispatch()

    def _dispatch(self) -> None:
        """Move tasks from the backlog into the executor while it has room. Re-entrant calls
        (a task finishing inside this loop's own submit) leave the work to the outer loop."""
        if getattr(self._local, "active", False):
            return
        self._local.active = True
        try:
            while True:
                with self._plock:
                    if self._closed or self._inside >= self.max_inside or not self._backlog:
                        return
                    fut = self._backlog.popleft()
                    if fut.cancelled():
                        continue
                    ex = self._executor
                    try:
                        if ex is None:
                            raise RuntimeError(f"{self!r} is closed")
                        if self.arenas is not None:
                            inner = ex.submit(run_packed, fut._fn, *fut._args)
                        else:
                            inner = ex.submit(fut._fn, *fut._args)
                    except (KeyboardInterrupt, SystemExit):
                        # Ctrl-C or SIGTERM (its handler raises here, in the main thread, often
                        # while a worker process starts): the run is stopping, not this task
                        cf.Future.cancel(fut)
                        raise
                    except BaseException as e:  # broken or shut down: this task and the backlog fail
                        failed = [fut, *self._backlog] if isinstance(e, BrokenProcessPool) else [fut]
                        if isinstance(e, BrokenProcessPool):
                            self._backlog.clear()
                        for f in failed:
                            _settle(f, exc=e)
                        continue
                    fut._inner = inner
                    self._inside += 1
                    fut._fn, fut._args = None, ()  # type: ignore[assignment]  # the executor holds them now
                inner.add_done_callback(functools.partial(self._finished, fut))
        finally:
            self._local.active = False

    def _finished(self, fut: _PoolFuture, inner: cf.Future) -> None:
        with self._plock:
            self._inside -= 1
        if inner.cancelled():
            cf.Future.cancel(fut)
        else:
            exc = inner.exception()
            if exc is not None:
                _settle(fut, exc=exc)
            else:
                try:
                    res = inner.result()
                    arenas = self.arenas
                    if arenas is not None:
                        res = arenas.unpack(res)
                except BaseException as e:
                    _settle(fut, exc=e)
                else:
                    _settle(fut, result=res)
        self._dispatch()

    def _cancel(self, fut: _PoolFuture) -> bool:
        with self._plock:
            inner = fut._inner
            if inner is None:
                return cf.Future.cancel(fut)  # still in the backlog: dispatch skips it
        if inner.cancel():  # in the executor's queue, not started: cancelled there
            cf.Future.cancel(fut)
            return True
        return fut.cancelled()

    def metrics(self) -> dict[str, Any]:
        """Tasks run, the backlog, the executor's share, and the shared-memory figures of a
        process pool (see :meth:`zephon.engine.arena.ArenaSet.metrics`)."""
        out: dict[str, Any] = {
            "workers": f"{self.config.count} {self.config.backend}",
            "tasks": self.tasks,
            "backlog": len(self._backlog),
            "inside": self._inside,
            "max_inside": self.max_inside,
            "in_flight_budget": self._in_flight,
            "shm": self.shm_status,
        }
        if self.arenas is not None:
            out.update(self.arenas.metrics())
        return out

    def close(self) -> None:
        """Stop the workers (processes hung in user code are terminated). Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ex, self._executor = self._executor, None
        with self._plock:
            waiting, self._backlog = list(self._backlog), collections.deque()
        for f in waiting:
            cf.Future.cancel(f)
        if ex is None:
            return
        if isinstance(ex, cf.ProcessPoolExecutor):
            if isinstance(ex, ProcessExecutor):
                # a start cut short by a signal lists its process within milliseconds once forked;
                # one still waiting for the fork server is not waited for (it stops what it makes)
                ex.wait_for_starts(CLOSE_GRACE_S)
            procs = list(getattr(ex, "_processes", {}).values())
            manager = getattr(ex, "_executor_manager_thread", None)
            results = getattr(ex, "_result_queue", None)
            # the task queue outlives the workers: shutdown drops the executor's reference, and a
            # worker still starting (unpickling it) fails, with a traceback, once its semaphores
            # are gone with the last reference
            calls = getattr(ex, "_call_queue", None)
            ex.shutdown(wait=False, cancel_futures=True)
            stop_processes(procs, CLOSE_GRACE_S)
            del calls
            release_manager(manager, results)
            # let the executor's management thread finish
            ex.shutdown(wait=True)
            if self.arenas is not None:
                self.arenas.close()  # the memory goes with the last view of each result
            if self._drop_dumps is not None:
                self._drop_dumps()
        elif isinstance(ex, ThreadExecutor):
            # a call still running after timeout_s would be reported hung: none is waited for longer
            stuck = ex.abandon(CLOSE_GRACE_S if self._hung else self.config.timeout_s)
            if stuck:
                print(
                    f"zephon: {self!r} closed with {len(stuck)} worker thread(s) still inside a call, left "
                    f"to end with the process (not waited for): {'; '.join(stuck)}",
                    file=sys.stderr,
                )
        else:
            ex.shutdown(wait=True, cancel_futures=True)

    def report_hung(self, future: cf.Future) -> str:
        """``future`` has no result within ``timeout_s``: the pool's close then waits only
        ``CLOSE_GRACE_S`` for running calls. Returns where the call is stuck (``file:line in
        function``, see :mod:`zephon.engine.stuck`): the thread worker computing it; for process
        workers (which one runs it is not known here), every worker inside a task, named by pid;
        '' when that cannot be told."""
        self._hung = True
        ex = self._executor
        if isinstance(ex, cf.ProcessPoolExecutor) and self._dumps is not None:
            pids = [pid for pid in dict(getattr(ex, "_processes", None) or {}) if pid_running(pid)]
            return where_processes_stuck(self._dumps, pids)
        inner = getattr(future, "_inner", None)
        if not isinstance(ex, ThreadExecutor) or inner is None:
            return ""
        ident = ex.running_thread(inner)
        return where_stuck(ident) if ident is not None else ""

    def __repr__(self) -> str:
        return f"WorkerPool({self.config.count} {self.config.backend}s)"


def _settle(fut: cf.Future, *, result: Any = None, exc: BaseException | None = None) -> None:
    """Set a future's outcome unless it was cancelled meanwhile."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except cf.InvalidStateError:
        pass


class PoolSet:
    """The pools of one rank, keyed by (backend, count, start method, shm budget): shared by its lanes.

    >>> pools = PoolSet()
    >>> pools.get(WorkerConfig(2)) is pools.get(WorkerConfig(2)), pools.get(WorkerConfig(0))
    (True, None)
    >>> pools.close()
    """

    def __init__(self) -> None:
        self._pools: dict[tuple[str, int, str, int | None], WorkerPool] = {}
        self._lock = threading.Lock()

    def get(self, config: WorkerConfig) -> WorkerPool | None:
        """The shared pool for ``config``, or None for inline execution."""
        if config.count == 0:
            return None
        key = (config.backend, config.count, config.start_method, config.shm_mb)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None or pool.closed:
                pool = self._pools[key] = WorkerPool(config)
            return pool

    def metrics(self) -> list[dict[str, Any]]:
        """:meth:`WorkerPool.metrics` of every pool of the set."""
        with self._lock:
            pools = list(self._pools.values())
        return [p.metrics() for p in pools]

    def close(self) -> None:
        """Close every pool of the set (a later :meth:`get` starts a new one)."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            p.close()

    def __repr__(self) -> str:
        return f"PoolSet({list(self._pools.values())})"


_PROCESS_OBJECTS: dict[str, Any] = {}


def _process_local(cls: type[Any], key: str, state: bytes | dict[str, Any]) -> Any:
    obj = _PROCESS_OBJECTS.get(key)
    if obj is None:
        if isinstance(state, bytes):  # pickled once by the consumer; unpickled once per worker
            state = pickle.loads(state)
        obj = object.__new__(cls)
        obj.__dict__.update(state)
        _PROCESS_OBJECTS[key] = obj
    return obj


class ProcessLocal:
    """Base for worker functions that are expensive to unpickle (tokenizers, dataset handles).

    Sent with every task to a process pool, but pickled once (the state is pickled into bytes
    the first time and those bytes travel with later tasks) and unpickled once per worker
    process: the first copy is kept under a key made at construction and reused by later
    tasks. So the state is frozen when the object is first pickled, as worker copies always
    were. Attributes named in ``_transient`` (caches) are not pickled.

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
        blob = self.__dict__.get("_pickled_state")
        if blob is None:
            state = {k: v for k, v in self.__dict__.items() if k not in self._transient and k != "_pickled_state"}
            blob = self.__dict__["_pickled_state"] = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        return (_process_local, (type(self), self._process_key, blob))
