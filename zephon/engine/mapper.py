"""The ordered-parallel mapper: a stateless function over a lane's records, N workers, input order.

Items are pulled from upstream by the consumer's thread in chunks, each chunk is one task on a
thread or process pool (possibly shared with other lanes), and results come back strictly in
input order. So the output never depends on the worker count or backend: parallelism is a pure
performance knob. Memory is bounded by ``max_in_flight`` chunks; when they are all pending, the
consumer waits (backpressure) and nothing more is read.

Checkpoint: the upstream's state at the start of the chunk being delivered plus the number of
items delivered since. Restore resets upstream there and skips those items *without* mapping
them, so replay costs at most one chunk of upstream reads. The restored mapper then maps the rest
of that chunk under that anchor, so it reports the state it was given and, after every later item,
the state an uninterrupted run reports (a resumed run writes the same checkpoints).

Tasks ramp up after a reset: the first chunk (fresh or restored) is mapped as tasks of 1, 2, 4, ...
items, all under the chunk's anchor, before whole chunks. A lane needs only the records of its
first micro-batch before the first batch: with lanes far above the records (4,096 lanes, one row
each), a whole first chunk per lane mapped 32 records where one was used. The chunks, and so every
state and every output, are those of whole chunks; only how a chunk is cut into tasks differs.

Read-ahead sized by cost: with ``cost`` (an item's estimated cost, e.g. its tokens) and
``cost_ahead``, a task also ends once its items cost ``cost_ahead / max_in_flight``, so the items
pulled ahead of the consumer cost about ``cost_ahead`` whatever the chunk size (a lane of 16 with
chunks of 32 documents tokenized ~80,000 tokens ahead of rows of 2,048, which a run that stops
never uses). The chunk stays open across its tasks, as under the ramp: states are unchanged.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import math
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from torchdata.nodes import BaseNode

from .bounded import BoundedCaller, release_thread_caller, thread_caller
from .node import ANCHOR, SINCE, PipelineError, StateError, ZNode, check_state_keys, state_int, state_node
from .workers import WorkerConfig, WorkerPool

__all__ = ["MAX_CHUNK_SIZE", "OrderedMapper", "WorkerError", "WorkerTraceback", "describe_item"]

#: the largest chunk a mapper hands one worker task. The chunk size is a performance setting (a
#: run may resume with another one), so a restored state's ``since`` is bounded by this, not by
#: the current chunk size
MAX_CHUNK_SIZE = 4096


class WorkerError(PipelineError):
    """A worker could not deliver a result: it died (killed, out of memory), hung past
    ``workers.timeout_s``, or its function raised an exception that cannot travel back from a
    process worker (the message then names that exception's type and text).

    An exception a function raises on a record reaches the caller as itself (a ``DataError``
    as a ``DataError``, a ``KeyError`` as a ``KeyError``), as torchdata's ``ParallelMapper``
    re-raises it: the worker's traceback is chained as its ``__cause__`` and kept in its
    ``worker_traceback`` attribute, and a note names the lane and the record. The worker's
    traceback of a WorkerError is in :attr:`worker_traceback` (not in the message: an error
    about the data reads as a message, not as a crash; ``zephon --debug`` prints it)."""

    def __init__(self, message: str, worker_traceback: str = "") -> None:
        super().__init__(message)
        self.worker_traceback = worker_traceback

    def __reduce__(self):
        return (type(self), (str(self), self.worker_traceback))


class WorkerTraceback(Exception):  # noqa: N818 -- not an error of its own: a traceback carried as a cause
    """The traceback of an exception raised in a worker, as text: the ``__cause__`` of the
    re-raised exception, so a printed traceback shows where in the worker it happened."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'


def _portable(exc: BaseException) -> bytes | None:
    """``exc`` pickled, if it pickles and its pickle rebuilds an exception of the same type
    (checked here in the worker, so a bad one never reaches the executor's result pipe)."""
    try:
        blob = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        back = pickle.loads(blob)
    except Exception:
        return None
    return blob if type(back) is type(exc) else None


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (no ``add_note``: the list is kept in
    ``__notes__`` all the same, where a caller can read it)."""
    with contextlib.suppress(AttributeError, TypeError):
        notes = list(getattr(exc, "__notes__", None) or [])
        exc.__notes__ = [*notes, note]  # type: ignore[attr-defined]


def _rebuild_failure(blob: bytes | None, type_name: str, message: str, tb: str, note: str) -> _Failure:
    f = _Failure.__new__(_Failure)
    f.exc, f.blob, f.type_name, f.message, f.tb, f.note = None, blob, type_name, message, tb, note
    return f


class _Failure:
    """A function's exception on its way back from a worker. A thread worker hands over the
    exception itself; a process worker sends it pickled (checked to rebuild, see
    :func:`_portable`) with its type's name, message and traceback, so the consumer can still
    name it when it cannot be rebuilt."""

    def __init__(self, exc: BaseException, tb: str, note: str = "") -> None:
        self.exc: BaseException | None = exc
        self.blob: bytes | None = None
        self.type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        self.message, self.tb, self.note = str(exc), tb, note

    def __reduce__(self):
        blob = self.blob if self.exc is None else _portable(self.exc)
        return (_rebuild_failure, (blob, self.type_name, self.message, self.tb, self.note))

    def exception(self, where: str, context: str) -> BaseException:
        """The exception to raise in the consumer: the function's own, with the worker's
        traceback as its cause and a note saying where; a :class:`WorkerError` naming its type
        and message when it cannot be rebuilt here."""
        exc = self.exc
        if exc is None and self.blob is not None:
            try:
                exc = pickle.loads(self.blob)
            except Exception:
                exc = None
        if exc is None:
            return WorkerError(
                f"{where}: the function raised {self.type_name}: {self.message}\n  {context}\n  "
                "(that exception cannot be sent back from a process worker: it does not pickle, or "
                "its pickle does not rebuild it; give the exception class a working __reduce__, or "
                'run with workers.backend = "thread" to get it as itself)',
                self.tb,
            )
        if self.tb:
            exc.__cause__ = WorkerTraceback(self.tb)
            exc.__suppress_context__ = True
        for line in (self.note, f"{context} in {where}"):
            if line:
                _add_note(exc, line)
        with contextlib.suppress(AttributeError, TypeError):
            exc.worker_traceback = self.tb  # type: ignore[attr-defined]  # `zephon --debug` prints it
        return exc


def describe_item(item: Any, limit: int = 160) -> str:
    """A short provenance string for an item: its ``provenance`` if it has one, else its repr."""
    prov = getattr(item, "provenance", None)
    if prov is None and isinstance(item, dict):
        prov = item.get("provenance")
    if prov is not None:
        return str(prov() if callable(prov) else prov)
    text = repr(item)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _function_name(fn: Any) -> str:
    """``module.qualname`` of a function, or of a callable object's class."""
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def _run_chunk(fn: Callable[..., Any], is_batch: bool, items: Sequence[Any]) -> tuple:
    """Worker side: run the function; an exception comes back as a :class:`_Failure` with the
    index of the failing item and the results before it."""
    if is_batch:
        try:
            out = fn(list(items))
        except (KeyboardInterrupt, SystemExit):
            raise  # not an error of the function's: it ends the run
        except BaseException as chunk_error:  # find the failing item by running them one at a time
            chunk_tb = traceback.format_exc()
            done: list[Any] = []
            for i, item in enumerate(items):
                try:
                    done.extend(fn([item]))
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as e:
                    return ("err", i, _Failure(e, traceback.format_exc()), done)
            note = f"the batch function failed on the chunk of {len(items)} items but on no item alone"
            return ("err", 0, _Failure(chunk_error, chunk_tb, note), [])
        if not isinstance(out, (list, tuple)) or len(out) != len(items):
            got = len(out) if isinstance(out, (list, tuple)) else type(out).__name__
            bad = TypeError(f"batch function must return a list with one result per item ({len(items)}), got {got}")
            return ("err", 0, _Failure(bad, ""), [])
        return ("ok", list(out))
    results: list[Any] = []
    for i, item in enumerate(items):
        try:
            results.append(fn(item))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            return ("err", i, _Failure(e, traceback.format_exc()), results)
    return ("ok", results)


class _Deferred:
    """Inline execution (workers=0): the chunk starts when the consumer asks for it
    (:meth:`start`), on the consumer thread's :func:`thread_caller`, and is waited for like a
    pool's task, so a call that never returns is reported within ``timeout_s`` as a worker's is.

    Why not in the consumer's own thread: nothing can stop a call there, so a user function that
    never returns hung the run with no report. The consumer thread waits while its serving
    thread computes (one serving thread per consumer thread, whatever the lanes): the chunks of
    a lane still run one at a time, in order, and no result changes."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._fn, self._args = fn, args
        self._inner: cf.Future | None = None
        self._caller: BoundedCaller | None = None

    def start(self) -> None:
        if self._inner is None:
            self._caller = thread_caller()
            self._inner = self._caller.submit(self._fn, *self._args)
            self._fn, self._args = None, ()  # type: ignore[assignment]  # the serving thread holds them now

    def result(self, timeout: float | None = None) -> Any:
        self.start()
        assert self._inner is not None
        return self._inner.result(timeout)

    def done(self) -> bool:
        return self._inner is not None and self._inner.done()

    def cancel(self) -> bool:
        return self._inner is None or self._inner.cancel()

    def report_hung(self) -> str:
        """Its call is past ``timeout_s``: leave the serving thread stuck in it (the consumer
        thread's next chunk gets a fresh one); where it is stuck."""
        if self._caller is None or self.done():
            return ""
        return self._caller.abandon()


class _Raise:
    """An upstream error met while pulling ahead, raised when the item is pulled."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Task:
    """One chunk on its way: ``anchor`` is the upstream state at the start of its chunk and
    ``offset`` the items of that chunk delivered before this task (non-zero only for the first
    task after a restore, which maps the rest of the chunk it was restored into)."""

    __slots__ = ("anchor", "future", "items", "offset", "start")

    def __init__(self, start: int, anchor: dict[str, Any], items: list[Any], future: Any, offset: int = 0) -> None:
        self.start, self.anchor, self.items, self.future = start, anchor, items, future
        self.offset = offset


class OrderedMapper(ZNode[Any]):
    """Apply ``fn`` (per item) or ``batch_fn`` (per list, elementwise) with N workers, in order.

    ``pool`` is a shared :class:`WorkerPool` (not closed by this node); without one, a private
    pool is made from ``workers`` and closed with the node. ``chunk_size`` items go to a worker
    per task; at most ``max_in_flight`` tasks are pending. With ``cost`` and ``cost_ahead``, a
    task ends early once its items cost ``cost_ahead / max_in_flight`` (at least one item): what
    is pulled ahead is bounded by cost, not by items (performance only, like the chunk size).
    """

    node_type = "ordered_map"

    def __init__(
        self,
        source: BaseNode,
        fn: Callable[[Any], Any] | None = None,
        *,
        batch_fn: Callable[[list[Any]], list[Any]] | None = None,
        workers: WorkerConfig | None = None,
        pool: WorkerPool | None = None,
        chunk_size: int = 16,
        max_in_flight: int | None = None,
        name: str = "map",
        lane: int | None = None,
        cost: Callable[[Any], float] | None = None,
        cost_ahead: float | None = None,
    ) -> None:
        super().__init__()
        if (fn is None) == (batch_fn is None):
            raise ValueError("OrderedMapper needs exactly one of fn= (per item) or batch_fn= (per list)")
        if not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be an integer in [1, {MAX_CHUNK_SIZE}], got {chunk_size!r}")
        self.source = source
        self.fn = batch_fn if batch_fn is not None else fn
        self.is_batch = batch_fn is not None
        self.workers = workers or (pool.config if pool is not None else WorkerConfig())
        self._own_pool = pool is None and self.workers.count > 0
        self.pool = pool if pool is not None else (WorkerPool(self.workers) if self.workers.count > 0 else None)
        self.chunk_size = chunk_size
        if max_in_flight is None:
            max_in_flight = 1 if self.pool is None else 2 * self.workers.count
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        if (cost is None) != (cost_ahead is None):
            raise ValueError(
                "OrderedMapper got only one of cost= and cost_ahead=: pass both (a bound on the cost of what is "
                "pulled ahead) or neither"
            )
        if cost_ahead is not None and not cost_ahead > 0:
            raise ValueError(f"cost_ahead must be > 0 (the cost pulled ahead of the consumer), got {cost_ahead!r}")
        self.cost = cost
        #: the cost at which a task ends (inf: tasks end at the chunk's end or the ramp's size)
        self.task_cost = cost_ahead / max_in_flight if cost_ahead is not None else math.inf
        if self.pool is not None:
            self.pool.note_in_flight(max_in_flight)  # the pool's result arenas are sized from it
        self.name = name
        self.lane = lane
        self._tasks: collections.deque[_Task] = collections.deque()
        self._current: _Task | None = None
        self._results: list[Any] = []
        self._pos = 0  # position within the current task's results
        self._pulled = 0  # items pulled from upstream
        self._exhausted = False
        self._error: BaseException | None = None
        self._wait = 0.0  # seconds the consumer waited for workers
        # (anchor, since) restored from a state and not yet turned into a task
        self._resume: tuple[dict[str, Any], int] | None = None
        # the chunk being cut into ramp tasks: (its anchor, the offset of its next task, its end)
        self._open: tuple[dict[str, Any], int, int] | None = None
        self._ramp = self.FIRST_TASK  # the next task's size while ramping up (up to chunk_size)
        self._peeked: list[Any] = []  # an item pulled ahead by get_state (see _ended_in_chunk)

    def _repr_args(self):
        yield self.name
        yield f"workers={self.workers.count} {self.workers.backend}"
        yield f"chunk={self.chunk_size}"
        if self.lane is not None:
            yield f"lane={self.lane}"

    # -- contract ---------------------------------------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._cancel_pending()
        self._current, self._results, self._pos = None, [], 0
        self._exhausted = False
        self._error = None
        self._resume, self._open, self._ramp, self._peeked = None, None, self.FIRST_TASK, []
        if initial_state is None:
            self.source.reset(None)
            self._pulled = 0
            return
        check_state_keys(self, initial_state, (ANCHOR, SINCE))
        # the state points into one chunk: fewer of its items were delivered than any chunk holds
        # (the chunk size may differ from the one the state was written with: it is not data)
        since = state_int(self, SINCE, initial_state[SINCE], 0, MAX_CHUNK_SIZE - 1)
        anchor = state_node(self, ANCHOR, initial_state[ANCHOR])
        self.source.reset(anchor)
        self._pulled = 0
        for i in range(since):  # skip what was delivered, without mapping it
            try:
                next(self.source)
            except StopIteration:
                raise StateError(
                    f"{self!r}: the upstream ended after {i} of the {since} items to skip on restore; "
                    "the data changed since the checkpoint was written"
                ) from None
        self._pulled = since
        self._resume = (anchor, since)

    def get_state(self) -> dict[str, Any]:
        if self._current is not None and self._pos < len(self._current.items):
            anchor, since = self._current.anchor, self._current.offset + self._pos
        elif self._tasks:
            anchor, since = self._tasks[0].anchor, self._tasks[0].offset
        elif self._open is not None and not self._ended_in_chunk():  # between two ramp tasks of a chunk
            anchor, since = self._open[0], self._open[1]
        elif self._resume is not None:  # restored, nothing pulled yet: the state it was given
            anchor, since = self._resume
        else:
            anchor, since = self.source.state_dict(), 0
        return self._tagged({ANCHOR: anchor, SINCE: since})

    def next(self) -> Any:
        while self._current is None or self._pos >= len(self._results):
            if self._error is not None:
                raise self._error
            self._fill()
            if not self._tasks:
                self._current = None
                raise StopIteration
            self._current = self._tasks.popleft()
            self._results = self._collect(self._current)
            self._pos = 0
            if self.pool is not None:  # workers compute the next chunks meanwhile; inline, nothing
                self._fill()  # would: its items are pulled when it is computed (no state changes)
        out = self._results[self._pos]
        self._results[self._pos] = None  # free memory early
        self._pos += 1
        return out

    def prime(self) -> None:
        """Submit the first chunks without waiting for them (a router primes every lane before
        its first pull, so the shared pool has every lane's work from the start). Changes
        nothing but timing: the state still describes what was delivered."""
        if self.pool is not None and self._current is None and not self._tasks and self._error is None:
            self._fill()

    # -- internals --------------------------------------------------------------------------
    FIRST_TASK = 1  # items in the first task after a reset (doubling up to chunk_size)

    def _chunk(self) -> tuple[dict[str, Any], int, int]:
        """The chunk the next task maps: (anchor, offset of the task in it, end of the chunk)."""
        if self._open is not None:
            return self._open
        if self._resume is None:
            return self.source.state_dict(), 0, self.chunk_size
        # the rest of the chunk the state points into, under that chunk's anchor (with another
        # chunk size than the state's, one chunk; `since` stays below the maximum)
        anchor, offset = self._resume
        self._resume = None
        if offset < self.chunk_size:
            return anchor, offset, self.chunk_size
        return anchor, offset, offset + min(self.chunk_size, MAX_CHUNK_SIZE - offset)

    def _ended_in_chunk(self) -> bool:
        """Whether the upstream ends before the rest of the open chunk (found by pulling its next
        item ahead, unmapped). A whole chunk would have met the end when it was pulled, and its
        state after the last item is the upstream's at its end: so is this one's."""
        if self._peeked:
            return False
        try:
            self._peeked.append(next(self.source))
        except StopIteration:
            self._exhausted, self._open = True, None
            return True
        except Exception as e:  # raised where a whole chunk's pull would have: by the next pull
            self._peeked.append(_Raise(e))
        return False

    def _pull(self) -> Any:
        """The upstream's next item (the one pulled ahead first; its error, if it raised)."""
        if not self._peeked:
            return next(self.source)
        item = self._peeked.pop()
        if isinstance(item, _Raise):
            raise item.error
        return item

    def _fill(self) -> None:
        while not self._exhausted and len(self._tasks) < self.max_in_flight:
            anchor, offset, end = self._chunk()
            size = min(end - offset, self._ramp)
            items: list[Any] = []
            spent, cost = 0.0, self.cost
            try:
                while len(items) < size and spent < self.task_cost:
                    items.append(self._pull())
                    if cost is not None:
                        spent += cost(items[-1])
            except StopIteration:
                self._exhausted = True
            self._ramp = min(2 * self._ramp, self.chunk_size)
            done = self._exhausted or offset + len(items) >= end
            self._open = None if done else (anchor, offset + len(items), end)
            if not items:
                break
            if self.pool is None:
                fut: Any = _Deferred(_run_chunk, self.fn, self.is_batch, items)
            else:
                try:
                    fut = self.pool.submit(_run_chunk, self.fn, self.is_batch, items)
                except BrokenProcessPool as e:
                    raise self._died(items[0]) from e
            self._tasks.append(_Task(self._pulled, anchor, items, fut, offset))
            self._pulled += len(items)

    def _died(self, item: Any) -> WorkerError:
        return WorkerError(
            f"{self._where()}: a worker process died (killed by a signal, or out of memory) while "
            f"mapping the chunk starting at {describe_item(item)}. All workers of this pool were "
            "stopped. Check the system log for the OOM killer; a script that starts process workers "
            'must guard its entry point with `if __name__ == "__main__":`; or run with '
            'workers.backend = "thread" to debug.'
        )

    def _hung(self, task: _Task) -> WorkerError:
        """The error for a task with no result within ``timeout_s``: it names the function, the
        records and, for a thread worker, the line the call is stuck at (the worker is left to
        end with the process: see :meth:`WorkerPool.close`)."""
        n, first = len(task.items), describe_item(task.items[0])
        what = f"the record {first}" if n == 1 else f"the {n} records from {first} to {describe_item(task.items[-1])}"
        fut = task.future
        stuck = self.pool.report_hung(fut) if self.pool is not None else fut.report_hung()
        at = f"; the call is stuck at {stuck}" if stuck else ""
        return WorkerError(
            f"{self._where()}: no result within {self.workers.timeout_s:g} s from {_function_name(self.fn)} on "
            f"{what} (source position {task.start}){at}; a worker seems hung in the user function or a read "
            "it makes. Fix the function (or the storage), or raise workers.timeout_s if the work is legitimately "
            "that slow."
        )

    def _where(self) -> str:
        lane = f"lane {self.lane}, " if self.lane is not None else ""
        return f"{self.name} ({lane}{self.workers.count} {self.workers.backend} workers)"

    def extra_metrics(self) -> dict[str, Any]:
        """Chunks pending, the in-flight bound, and how long the consumer waited for workers."""
        return {
            "pending_tasks": len(self._tasks),
            "max_in_flight": self.max_in_flight,
            "wait_workers_s": round(self._wait, 6),
            "workers": f"{self.workers.count} {self.workers.backend}",
        }

    def _await(self, task: _Task) -> Any:
        """The task's result within ``timeout_s``; raises BrokenProcessPool as soon as one of the
        pool's process workers is found gone (checked every second while waiting), whether or
        not the executor has noticed yet."""
        deadline = time.monotonic() + self.workers.timeout_s
        while True:
            try:
                return task.future.result(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except cf.TimeoutError:
                self.check_cancelled()  # closed meanwhile (another thread): stop waiting
                lost = self.pool.lost_workers() if self.pool is not None else []
                if lost and not task.future.done():
                    raise BrokenProcessPool(f"worker process {lost[0]} is gone") from None
                if time.monotonic() >= deadline:
                    raise

    def _collect(self, task: _Task) -> list[Any]:
        t0 = time.perf_counter()
        if self.pool is not None:
            self.pool.demand(task.future)  # the consumer waits for it: run it next
        else:
            task.future.start()  # inline: computed now, on this thread's serving thread
        try:
            res = self._await(task)
            self._wait += time.perf_counter() - t0
        except cf.TimeoutError:
            raise self._hung(task) from None
        except BrokenProcessPool as e:
            raise self._died(task.items[0]) from e
        except cf.CancelledError:
            raise PipelineError(f"{self._where()}: the worker pool was shut down while a task was pending") from None
        if res[0] == "ok":
            return res[1]
        _, idx, failure, partial = res
        item = task.items[idx]
        self._exhausted, self._open = True, None
        self._cancel_pending()
        self._error = failure.exception(
            self._where(), f"while mapping {describe_item(item)} (source position {task.start + idx} of this lane)"
        )
        return list(partial)  # the records before the failing one are still delivered, in order

    def _cancel_pending(self) -> None:
        for t in self._tasks:
            t.future.cancel()
        self._tasks.clear()

    def _close_own(self) -> None:
        self._cancel_pending()
        if self.pool is None:
            release_thread_caller()  # the serving thread of inline chunks, when idle
        if self.pool is not None:
            self.pool.note_in_flight(-self.max_in_flight)
            if self._own_pool:
                self.pool.close()
