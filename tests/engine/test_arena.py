"""Process workers' results through shared memory: same bytes with the arenas on and off, views
that free their space when the last one dies, a full arena that falls back to pickling, and
nothing left behind after close, an error or a SIGKILL. Also the pool's demand-first backlog and
its composable worker-start steps."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from zephon import WorkerConfig
from zephon.engine import OrderedMapper, WorkerPool, arena
from zephon.engine.arena import ArenaSet, arena_available, arena_worker_start, run_packed
from zephon.engine.testing import AddOffset, RangeSource, _threads, assert_no_leaks

pytestmark = pytest.mark.skipif(not arena_available(), reason="no memfd_create on this platform")


def arrays_of(x):
    """Arrays of many kinds: large and small, C and Fortran order, a strided view, objects."""
    rng = np.random.default_rng(x)
    big = rng.standard_normal((64, 257)).astype(np.float32)
    return {
        "x": x,
        "big": big,
        "fortran": np.asfortranarray(rng.integers(0, 9, (40, 30))),
        "strided": big[:, ::3],  # not contiguous: pickled in band
        "small": np.arange(x % 7, dtype=np.int16),
        "tokens": np.arange(x * 300, dtype=np.int32),
        "objects": np.array(["a", None, x], dtype=object),
        "nested": [(np.full(600, x, np.int64), "t")],
    }


def big_result(x):
    return np.full(300_000, x, dtype=np.float64)  # 2.4 MB


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.flags.writeable == b.flags.writeable
            and (a.tobytes() == b.tobytes() if a.dtype != object else list(a) == list(b))
        )
    return a == b


def run_mapper(workers, fn=arrays_of, n=40, chunk=3):
    m = OrderedMapper(RangeSource(n), fn, workers=workers, chunk_size=chunk)
    try:
        out = list(m)
        return out, m.pool.metrics() if m.pool is not None else {}
    finally:
        m.close()


# -- the same bytes, on and off -----------------------------------------------------------------
def test_results_identical_with_arenas_on_and_off():
    ref, _ = run_mapper(WorkerConfig(0))
    on, on_metrics = run_mapper(WorkerConfig(2, "process"))
    off, off_metrics = run_mapper(WorkerConfig(2, "process", shm_mb=0))
    assert same(ref, on) and same(ref, off)
    assert on_metrics["shm"] == "on" and on_metrics["shm_results"] > 0 and on_metrics["inband_results"] == 0
    assert off_metrics["shm"].startswith("off") and "shm_results" not in off_metrics
    # arrays from the arena are views of it, writable like unpickled ones
    assert all(r["big"].flags.writeable and not r["big"].flags.owndata for r in on)


def test_full_arena_falls_back_to_pickling_and_never_blocks():
    # a 1 MiB budget cannot hold one 2.4 MB result: every result travels pickled, none waits
    out, metrics = run_mapper(WorkerConfig(2, "process", shm_mb=1), fn=big_result, n=12, chunk=1)
    assert [float(a[0]) for a in out] == list(range(12))
    assert metrics["shm_results"] == 0 and metrics["inband_results"] == 12 and metrics["full_fallbacks"] == 12
    # a 4 MiB budget holds one at a time; results held by the consumer push later ones in band
    out, metrics = run_mapper(WorkerConfig(1, "process", shm_mb=4), fn=big_result, n=12, chunk=1)
    assert [float(a[0]) for a in out] == list(range(12))
    assert metrics["shm_results"] >= 1 and metrics["inband_results"] >= 1


# -- views and their space ------------------------------------------------------------------------
@pytest.fixture
def local_arena():
    arenas = ArenaSet(1, reserve=64 << 20)
    arena_worker_start(*arenas.initargs(local=True))  # this process is the "worker" too
    yield arenas
    arenas.close()
    arena._reset_worker_arena()


def test_derived_arrays_keep_the_space_until_the_last_one_dies(local_arena):
    import torch

    out = local_arena.unpack(run_packed(arrays_of, 5))
    assert local_arena.metrics()["live_bytes"] > 0
    keep = [out["big"].reshape(-1)[10:20], torch.from_numpy(out["tokens"][5:]), out["nested"][0][0].view(np.uint8)]
    del out
    gc.collect()
    assert local_arena.metrics()["live_bytes"] > 0  # views of views still hold it
    assert keep[1][0].item() == 5 and int(keep[2][0]) == 5
    keep.pop()
    keep.pop()
    gc.collect()
    assert local_arena.metrics()["live_bytes"] > 0
    keep.clear()
    gc.collect()
    assert local_arena.metrics()["live_bytes"] == 0


def test_space_is_reused_and_idle_pages_go_back(local_arena):
    local_arena.set_in_flight(8)  # the automatic budget: 2 x 8 x the largest result (8 MB)
    first = local_arena.unpack(run_packed(np.zeros, 8 << 20, np.uint8))  # 8 MB at offset 0
    del first
    again = local_arena.unpack(run_packed(np.ones, 8 << 20, np.uint8))
    assert arena._ARENA is not None and arena._ARENA.offs == [0]  # the freed space was reused
    del again
    held = [local_arena.unpack(run_packed(np.ones, 8 << 20, np.uint8)) for _ in range(6)]  # 48 MB touched
    del held[1:]  # the highest live allocation is now the first one
    local_arena.unpack(run_packed(np.ones, 1024, np.uint8))  # the next allocation hands idle pages back
    m = local_arena.metrics()
    assert m["released_bytes"] >= 32 << 20 and m["touched_bytes"] <= 10 << 20


def test_a_worker_that_cannot_set_up_an_arena_pickles(capfd):
    arena._reset_worker_arena()
    r, w = os.pipe()
    os.close(w)
    bogus = arena._Fd(r)  # a pipe, not a memfd: the private re-open works, mmap fails
    arena_worker_start([bogus], [arena._Fd(os.dup(r))], 1 << 20)  # must not raise
    assert arena._ARENA is None
    assert "pickled" in capfd.readouterr().err
    assert run_packed(pow, 2, 10) == 1024  # no arena: the result as is


# -- lifetime --------------------------------------------------------------------------------
def _arena_mappers(tag: str) -> list[int]:
    """Pids of processes that map an arena whose name holds ``tag``."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                if f"zephon-arena-{tag}" in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from zephon import WorkerConfig
    from zephon.engine import OrderedMapper
    from zephon.engine.testing import RangeSource
    sys.path.insert(0, {here!r})
    from test_arena import big_result
    m = OrderedMapper(RangeSource(None), big_result, workers=WorkerConfig(2, "process"), chunk_size=1)
    held = [next(m) for _ in range(6)]
    print(json.dumps([p.pid for p in __import__("multiprocessing").active_children()]), flush=True)
    sys.stdin.readline()
    if {mode!r} == "raise":
        raise RuntimeError("boom in the consumer")
    if {mode!r} == "close":
        m.close()
        print("closed", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("mode", ["close", "raise", "kill"])
def test_nothing_left_behind(mode):
    shm_before = set(os.listdir("/dev/shm"))
    code = CHILD.format(here=os.path.dirname(__file__), mode=mode)
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        workers = json.loads(p.stdout.readline())
        tag = str(p.pid)
        deadline = time.monotonic() + 60  # a worker maps its arena when it has started
        while len(_arena_mappers(tag)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(workers) == 2 and sorted(_arena_mappers(tag)) == sorted([p.pid, *workers])
        p.stdin.write("go\n")
        p.stdin.flush()
        if mode == "close":
            assert p.stdout.readline().strip() == "closed"
            assert _arena_mappers(tag) == [p.pid]  # workers gone; the consumer holds its results
            p.kill()
        elif mode == "kill":
            p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        if mode == "kill":
            # ending orphaned workers is the pool's parent-death watch's job (a worker-start
            # step); here we end them, and check that nothing else holds an arena
            time.sleep(0.5)
            for w in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while _arena_mappers(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _arena_mappers(tag) == []
        assert not [f for f in set(os.listdir("/dev/shm")) - shm_before if "zephon" in f]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_cancelled_and_abandoned_results_give_their_space_back():
    before = _threads()
    m = OrderedMapper(RangeSource(None), big_result, workers=WorkerConfig(2, "process"), chunk_size=1)
    pool = m.pool
    for _ in range(3):
        next(m)
    state = m.state_dict()
    m.reset(None)  # cancels pending chunks; running ones finish and are dropped
    next(m)
    m.reset(state)
    assert float(next(m)[0]) == 3.0
    deadline = time.monotonic() + 20
    while pool.metrics()["inside"] and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()
    # only the chunks the mapper holds in flight now (max_in_flight) are live
    assert pool.metrics()["live_bytes"] <= m.max_in_flight * big_result(0).nbytes
    m.close()
    gc.collect()
    assert pool.arenas is not None and pool.arenas.closed
    assert_no_leaks(before)


# -- the pool: demand-first backlog, worker-start steps ---------------------------------------------
def test_demand_moves_a_task_to_the_front():
    gate = threading.Event()
    order = []

    def task(i):
        gate.wait(10)
        order.append(i)
        return i

    pool = WorkerPool(WorkerConfig(1, "thread"))
    try:
        futs = [pool.submit(task, i) for i in range(8)]
        assert pool.metrics()["inside"] == 2 and pool.metrics()["backlog"] == 6
        assert futs[3].cancel() and futs[3].cancelled()  # waiting in the backlog: cancellable
        pool.demand(futs[7])
        gate.set()
        assert [f.result(10) for f in futs if f is not futs[3]] == [0, 1, 2, 4, 5, 6, 7]
        assert order == [0, 1, 7, 2, 4, 5, 6]
    finally:
        pool.close()


def mark_worker(path):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


def test_worker_start_steps_compose_with_the_arena(tmp_path):
    marks = tmp_path / "marks"
    pool = WorkerPool(WorkerConfig(2, "process"))
    pool.add_worker_start(mark_worker, str(marks))
    try:
        assert [pool.submit(big_result, i).result(60)[0] for i in range(4)] == [0, 1, 2, 3]
        assert pool.metrics()["shm_results"] == 4  # the arena step ran after ours
        with pytest.raises(RuntimeError, match="has started"):
            pool.add_worker_start(mark_worker, str(marks))
    finally:
        pool.close()
    assert 1 <= len(marks.read_text().split()) <= 2


class CountsPickles:
    pickled = 0

    def __reduce__(self):
        CountsPickles.pickled += 1
        return (CountsPickles, ())


def test_process_local_state_is_pickled_once():
    fn = AddOffset(3)
    fn.payload = CountsPickles()
    blobs = [pickle.dumps(fn) for _ in range(5)]
    assert CountsPickles.pickled == 1 and len(set(blobs)) == 1
