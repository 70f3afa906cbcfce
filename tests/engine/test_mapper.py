"""The ordered-parallel mapper: order, worker-independence, errors, dead workers, hangs."""

import gc
import multiprocessing.queues
import os
import signal
import struct
import threading
import time

import pytest

from zephon import PipelineError, WorkerConfig, WorkerError
from zephon.data import DataError
from zephon.engine import OrderedMapper
from zephon.engine.mapper import WorkerTraceback
from zephon.engine.testing import RangeSource, _threads, assert_no_leaks, check_node, json_roundtrip


def slow_square(x):
    # uneven work so that completion order differs from input order
    time.sleep(0.002 * ((x * 7) % 5))
    return x * x


def squares_batch(xs):
    return [x * x for x in xs]


def fail_on_13(x):
    if x == 13:
        raise ValueError("thirteen is unlucky")
    return x


def kill_self_on_9(x):
    if x == 9:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def die_mid_result_on_9(x):
    """Die the way a worker killed while sending its result does: half a message written to the
    executor's result pipe (shared by all workers), then SIGKILL."""
    if x == 9:
        results = [o for o in gc.get_objects() if isinstance(o, multiprocessing.queues.SimpleQueue)]
        for q in results:  # the worker holds one: the executor's result queue
            os.write(q._writer.fileno(), struct.pack("!i", 1 << 20) + b"half a result")
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def hang_on_5(x):
    if x == 5:
        time.sleep(60)
    return x


CONFIGS = (
    [WorkerConfig(0)] + [WorkerConfig(n, "thread") for n in (1, 2, 4)] + [WorkerConfig(n, "process") for n in (1, 2, 4)]
)


@pytest.mark.parametrize("workers", CONFIGS, ids=lambda c: f"{c.backend}{c.count}")
def test_output_identical_for_any_worker_count(workers):
    m = OrderedMapper(RangeSource(200), slow_square, workers=workers, chunk_size=3)
    try:
        assert list(m) == [x * x for x in range(200)]
    finally:
        m.close()


@pytest.mark.parametrize("workers", [WorkerConfig(0), WorkerConfig(3, "thread")], ids=["inline", "thread3"])
def test_batch_fn_and_restore_every_step(workers):
    check_node(lambda: OrderedMapper(RangeSource(60), batch_fn=squares_batch, workers=workers, chunk_size=7))


def test_restore_with_process_workers():
    check_node(
        lambda: OrderedMapper(RangeSource(25), slow_square, workers=WorkerConfig(2, "process"), chunk_size=4), every=8
    )


def test_bounded_in_flight():
    src = RangeSource(None)
    m = OrderedMapper(src, slow_square, workers=WorkerConfig(2, "thread"), chunk_size=5, max_in_flight=3)
    try:
        for _ in range(10):
            next(m)
        # consumer has taken 10 items; the mapper may hold at most max_in_flight chunks ahead
        assert src.reads <= 10 + 5 + 3 * 5
    finally:
        m.close()


ERROR_CONFIGS = [
    WorkerConfig(0),
    WorkerConfig(2, "thread"),
    WorkerConfig(2, "process"),
    WorkerConfig(2, "process", shm_mb=0),
]
ERROR_IDS = ["inline", "thread", "process", "process-pickled"]


def data_error_on_13(x):
    if x == 13:  # what a reader raises when a file was rewritten during the run
        raise DataError("the file changed during the run", dataset="web", file="a.jsonl", fix="Restart the run.")
    return x


class NoPickleError(Exception):
    """An exception that cannot be pickled (it holds a lock)."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


class NoRebuildError(Exception):
    """An exception whose pickle does not rebuild it (a keyword-only __init__, no __reduce__)."""

    def __init__(self, *, reason):
        super().__init__(f"no rebuild: {reason}")


def raise_unpicklable_on_5(x):
    if x == 5:
        raise NoPickleError("cannot travel")
    return x


def raise_unrebuildable_on_5(x):
    if x == 5:
        raise NoRebuildError(reason="keyword-only")
    return x


def _run_until_error(fn, workers, **kw):
    m = OrderedMapper(RangeSource(40), fn, workers=workers, chunk_size=4, lane=3, name="decode", **kw)
    got = []
    try:
        with pytest.raises(BaseException) as ei:
            for x in m:
                got.append(x)
        with pytest.raises(type(ei.value)):  # and it keeps raising, never hangs
            next(m)
    finally:
        m.close()
    return ei.value, got


@pytest.mark.parametrize("workers", ERROR_CONFIGS, ids=ERROR_IDS)
def test_user_exception_keeps_its_type(workers):
    """torchdata's ParallelMapper re-raises a function's exception as its own type; so does the
    mapper, with the worker traceback as the cause and a note naming the lane and record."""
    e, got = _run_until_error(fail_on_13, workers)
    assert type(e) is ValueError and str(e) == "thirteen is unlucky"
    note = "\n".join(e.__notes__)
    assert "lane 3" in note and "source position 13" in note and "decode" in note
    assert isinstance(e.__cause__, WorkerTraceback) and "fail_on_13" in str(e.__cause__)
    assert "fail_on_13" in e.worker_traceback
    assert got == list(range(13))  # everything before the bad record was delivered, in order


@pytest.mark.parametrize("workers", ERROR_CONFIGS, ids=ERROR_IDS)
def test_data_error_keeps_its_type(workers):
    e, got = _run_until_error(data_error_on_13, workers)
    assert type(e) is DataError and e.file == "a.jsonl" and e.dataset == "web"
    assert "Traceback" not in str(e) and "Restart the run" in str(e)  # a message, not a crash
    assert "DataError" in e.worker_traceback and "source position 13" in e.__notes__[-1]
    assert got == list(range(13))


@pytest.mark.parametrize("workers", ERROR_CONFIGS, ids=ERROR_IDS)
def test_batch_function_error_keeps_its_type(workers):
    m = OrderedMapper(RangeSource(40), batch_fn=_batch_fail_on_13, workers=workers, chunk_size=4)
    with pytest.raises(ValueError, match="thirteen") as ei:
        list(m)
    m.close()
    assert "source position 13" in ei.value.__notes__[-1]


def _batch_fail_on_13(xs):
    return [fail_on_13(x) for x in xs]


@pytest.mark.parametrize(
    "fn,name", [(raise_unpicklable_on_5, "NoPickleError"), (raise_unrebuildable_on_5, "NoRebuildError")]
)
def test_exception_that_cannot_travel_surfaces_as_worker_error(fn, name):
    """A process worker cannot send back an exception that does not pickle or rebuild: it comes
    as a WorkerError naming its type and message (never a broken pool, never a hang)."""
    for workers in (WorkerConfig(2, "process"), WorkerConfig(2, "process", shm_mb=0)):
        e, got = _run_until_error(fn, workers)
        assert type(e) is WorkerError, e
        msg = str(e)
        assert name in msg and "source position 5" in msg and "lane 3" in msg and 'backend = "thread"' in msg
        assert name in e.worker_traceback
        assert got == list(range(5))
    e, _ = _run_until_error(fn, WorkerConfig(2, "thread"))  # threads hand it over as itself
    assert type(e).__name__ == name


def test_killed_worker_process_surfaces_quickly():
    before = _threads()
    m = OrderedMapper(RangeSource(100), kill_self_on_9, workers=WorkerConfig(2, "process"), chunk_size=2)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="worker process died"):  # a WorkerError: a worker died
        list(m)
    assert time.monotonic() - t0 < 30
    m.close()
    assert_no_leaks(before)


def test_worker_killed_while_sending_its_result_surfaces_and_closes():
    # the executor never notices this death (its management thread waits for the rest of the
    # message); the mapper's own check finds the lost worker, and close() ends that thread
    before = _threads()
    m = OrderedMapper(RangeSource(100), die_mid_result_on_9, workers=WorkerConfig(1, "process", shm_mb=0), chunk_size=1)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="worker process died"):  # a WorkerError: a worker died
        list(m)
    assert time.monotonic() - t0 < 30
    managers = [t for t in threading.enumerate() if type(t).__name__ == "_ExecutorManagerThread"]
    m.close()
    assert not [t for t in managers if t.is_alive()], "the executor's management thread outlived close()"
    assert_no_leaks(before)


def test_hung_worker_times_out():
    before = _threads()
    m = OrderedMapper(RangeSource(20), hang_on_5, workers=WorkerConfig(2, "process", timeout_s=1.5), chunk_size=1)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="hung"):
        list(m)
    assert time.monotonic() - t0 < 20
    m.close()
    assert_no_leaks(before)


def test_close_is_idempotent_and_final():
    m = OrderedMapper(RangeSource(10), slow_square, workers=WorkerConfig(2, "thread"))
    next(m)
    m.close()
    m.close()
    with pytest.raises(PipelineError, match="closed"):
        m.reset()


def test_needs_one_function():
    with pytest.raises(ValueError, match="exactly one"):
        OrderedMapper(RangeSource(3))
    assert "workers=2 thread" in repr(OrderedMapper(RangeSource(3), slow_square, workers=WorkerConfig(2)))


def test_lane_in_flight_budget():
    """The pulled lane may keep every worker busy (2 chunks per worker); the rank's lanes together
    stay near ``per_worker`` chunks per worker; never below 2 per lane (1 with at least 4 lanes per
    worker: the pool runs the awaited chunk first), 1 when inline."""
    from zephon.engine.lanes import LaneContext

    def mif(count, lanes, per_worker=16):
        return LaneContext(
            seed=0, lane=0, lanes=lanes, workers=WorkerConfig(count, "thread"), lanes_on_rank=lanes
        ).max_in_flight(per_worker=per_worker)

    assert mif(0, 8) == 1
    assert mif(2, 8) == 4  # was 2: workers idled while one lane refilled its shuffle window
    assert mif(1, 8) == 2
    assert mif(16, 4) == 32 and mif(16, 4, per_worker=8) == 32 and mif(16, 8, per_worker=8) == 16
    assert mif(2, 4, per_worker=8) == 4
    assert mif(2, 256) == 1 and mif(16, 256, per_worker=8) == 1 and mif(16, 32) == 8 and mif(2, 4) == 4
    for count in (1, 2, 4, 16):
        for lanes in (1, 4, 8, 64, 256, 1024):
            floor = 1 if lanes >= 4 * count else 2
            for pw in (8, 16):
                assert floor <= mif(count, lanes, pw) <= max(2, 2 * count)
                assert lanes * mif(count, lanes, pw) <= max(floor * lanes, pw * count + lanes)


@pytest.mark.parametrize("workers", [WorkerConfig(0), WorkerConfig(2, "thread")], ids=["inline", "thread"])
def test_restored_mapper_reports_the_state_it_was_given(workers):
    """Restored from {anchor c, since 1} it reports {c, 1} (was {c+1, 0}), primed or not, and
    then writes the uninterrupted run's states; with another chunk size it still resumes."""
    ref = OrderedMapper(RangeSource(30), slow_square, workers=workers, chunk_size=4)
    states = []
    for _ in range(11):
        next(ref)
        states.append(ref.state_dict())
    ref.close()
    s = states[4]  # one item into the second chunk
    assert s["since"] == 1 and s["anchor"]["cursor"] == 4
    for prime in (False, True):
        m = OrderedMapper(RangeSource(30), slow_square, workers=workers, chunk_size=4)
        m.reset(s)
        if prime:
            m.prime()
        assert m.state_dict() == s
        for want in states[5:]:
            next(m)
            assert m.state_dict() == want
        m.close()
    m = OrderedMapper(RangeSource(30), slow_square, workers=workers, chunk_size=3)
    m.reset(s)
    assert m.state_dict() == s and list(m) == [x * x for x in range(5, 30)]
    m.close()


def test_process_workers_see_the_environment_of_their_pools_start(monkeypatch):
    """A forkserver child inherits the server's environment, fixed when the first pool of the
    interpreter started it: a setting made later (storage credentials, ZEPHON_SHARD_CACHE) must
    still reach the workers of a pool started after it."""
    from zephon.engine.workers import WorkerPool

    first = WorkerPool(WorkerConfig(1, backend="process"))
    try:
        assert first.submit(os.getpid).result(timeout=120) != os.getpid()  # the forkserver is up
    finally:
        first.close()
    monkeypatch.setenv("ZEPHON_TEST_LATE_SETTING", "set after the forkserver started")
    pool = WorkerPool(WorkerConfig(1, backend="process"))
    try:
        got = pool.submit(os.getenv, "ZEPHON_TEST_LATE_SETTING").result(timeout=120)
    finally:
        pool.close()
    assert got == "set after the forkserver started"


def test_an_inline_mapper_pulls_only_the_chunk_it_maps():
    """Inline (workers = 0) nothing computes the next chunk ahead, so its items are pulled when
    it is mapped: a cold start of 4,096 lanes pulled (and located) two chunks per lane for one."""
    src = RangeSource(100)
    m = OrderedMapper(src, abs, workers=WorkerConfig(0), chunk_size=4)
    try:
        assert next(m) == 0 and src.reads == 1, src.reads  # the first task maps one item (before: 4, then 8)
        state = m.state_dict()  # pulls one item ahead, unmapped: does the source end in this chunk?
        assert src.reads == 2
        assert [next(m) for _ in range(4)] == [1, 2, 3, 4] and src.reads == 8
        m.reset(state)
        assert [next(m) for _ in range(4)] == [1, 2, 3, 4]
    finally:
        m.close()


class CountingSquare:
    """``squares_batch`` counting the items it maps."""

    def __init__(self) -> None:
        self.mapped = 0

    def __call__(self, xs):
        self.mapped += len(xs)
        return squares_batch(xs)


@pytest.mark.parametrize("n", [37, 40, 100])
@pytest.mark.parametrize("workers", [WorkerConfig(0), WorkerConfig(2, "thread")], ids=["inline", "thread2"])
def test_tasks_ramp_up_and_every_state_is_the_whole_chunks_one(workers, n):
    """After a reset the first chunk is mapped in tasks of 1, 2, 4, ... items (a lane needs its
    first micro-batch's records, not a chunk's: 4,096 lanes over 3,000 records mapped 32 records
    a lane where about 1 was used), and the state after every item is the one whole chunks give:
    (the upstream's state at the chunk's start, items delivered in it), the upstream's state at
    its end once it has ended: checkpoints written before restore, and are written the same."""
    fn = CountingSquare()
    m = OrderedMapper(RangeSource(n), batch_fn=fn, workers=workers, chunk_size=8)
    try:
        assert next(m) == 0
        if workers.count == 0:
            assert fn.mapped == 1, fn.mapped  # a whole chunk: 8
        got = [json_roundtrip(m.state_dict())]
        got += [json_roundtrip(m.state_dict()) for _ in m]
        want = [(8 * (i // 8), i % 8) for i in range(1, n + 1)]
        if n % 8:
            want[-1] = (n, 0)
        assert [(s["anchor"]["cursor"], s["since"]) for s in got] == want
        assert fn.mapped == n
    finally:
        m.close()


def test_a_restored_mapper_ramps_up_within_the_chunk_it_was_restored_into():
    """A restore maps the rest of its chunk in ramp tasks too, under the chunk's anchor."""
    fn = CountingSquare()
    src = RangeSource(100)
    m = OrderedMapper(src, batch_fn=fn, workers=WorkerConfig(0), chunk_size=16)
    try:
        for _ in range(19):
            next(m)
        state = m.state_dict()
        assert (state["anchor"]["cursor"], state["since"]) == (16, 3)
        m.reset(state)
        fn.mapped = 0
        assert next(m) == 19 * 19 and fn.mapped == 1
        assert [json_roundtrip(m.state_dict())["since"] for _ in range(3)] == [4, 4, 4]  # no item delivered
        assert [next(m) for _ in range(13)] == [x * x for x in range(20, 33)]
        assert json_roundtrip(m.state_dict()) == {**state, "anchor": {**state["anchor"], "cursor": 32}, "since": 1}
    finally:
        m.close()


class FailsAt(RangeSource):
    """A RangeSource raising a DataError on its item ``at``."""

    def __init__(self, n, at):
        super().__init__(n)
        self.at = at

    def next(self):
        if self.cursor == self.at:
            raise DataError(f"bad item {self.at}")
        return super().next()


def test_an_upstream_error_met_pulling_ahead_is_raised_by_the_pull_of_its_item():
    """``state_dict`` between two ramp tasks pulls one item ahead (does the upstream end inside
    the chunk?): an error there is raised by ``next``, where the whole chunk's pull raised it."""
    m = OrderedMapper(FailsAt(100, 1), abs, workers=WorkerConfig(0), chunk_size=8)
    try:
        assert next(m) == 0
        state = m.state_dict()
        assert (state["anchor"]["cursor"], state["since"]) == (0, 1)
        with pytest.raises(DataError, match="bad item 1"):
            next(m)
    finally:
        m.close()


@pytest.mark.parametrize("workers", [WorkerConfig(0), WorkerConfig(2, "thread")], ids=["inline", "thread2"])
def test_tasks_sized_by_cost_pull_little_ahead_and_keep_the_whole_chunks_states(workers):
    """With ``cost`` and ``cost_ahead`` a task ends once its items cost ``cost_ahead /
    max_in_flight``: chunks of 32 items read 2 chunks ahead pulled 64 items past the consumer,
    now about ``cost_ahead``. Every state is still the one whole chunks give, and a state
    written without a cost bound (or with another chunk size) restores to the same items."""
    n = 150
    fn = CountingSquare()
    m = OrderedMapper(
        RangeSource(n), batch_fn=fn, workers=workers, chunk_size=32, max_in_flight=2, cost=lambda x: 2, cost_ahead=16
    )
    try:
        got, ahead = [], []
        for i in range(n):
            assert next(m) == i * i
            ahead.append(fn.mapped - (i + 1))
            got.append(json_roundtrip(m.state_dict()))
        # tasks of 4 items (cost 8): the current task's rest and two tasks pending, at most
        assert max(ahead) <= 3 + 2 * 4, max(ahead)
        want = [(32 * (i // 32), i % 32) for i in range(1, n + 1)]
        want[-1] = (n, 0)
        assert [(s["anchor"]["cursor"], s["since"]) for s in got] == want
        assert fn.mapped == n
        for at in (0, 5, 40, 100):  # a state of whole chunks of 8 restores here, and vice versa
            whole = OrderedMapper(RangeSource(n), batch_fn=squares_batch, workers=WorkerConfig(0), chunk_size=8)
            try:
                for _ in range(at + 1):
                    next(whole)
                m.reset(whole.state_dict())
                assert next(m) == (at + 1) ** 2
                m.reset(got[at])
                whole.reset(got[at])
                assert next(whole) == next(m) == (at + 1) ** 2
            finally:
                whole.close()
    finally:
        m.close()


def test_a_cost_bound_needs_both_settings():
    with pytest.raises(ValueError, match="only one of cost= and cost_ahead="):
        OrderedMapper(RangeSource(3), abs, cost=lambda x: 1)
    with pytest.raises(ValueError, match="cost_ahead must be > 0"):
        OrderedMapper(RangeSource(3), abs, cost=lambda x: 1, cost_ahead=0)
