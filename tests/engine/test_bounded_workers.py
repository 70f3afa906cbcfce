"""Workers in bounded time (issue 33): a call that never returns is reported within
``timeout_s`` naming the function, the record and the line it is stuck at, and
the run then ends: a stuck thread is not joined, whether it is stuck in user code or in a
stalled storage read. Closing a pool stops its busy process workers all at once, not one by one.
A script without a main guard is refused before any process starts.

Each run is a real process: what is checked is that it ends, and what it printed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from zephon.engine import WorkerConfig, WorkerPool
from zephon.engine.mainguard import guarded
from zephon.engine.procexec import ProcessExecutor
from zephon.engine.workers import CLOSE_GRACE_S

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HUNG = """
import sys, threading
from zephon.engine import OrderedMapper, WorkerConfig
from zephon.engine.testing import RangeSource

def never_returns(x):
    if x == 5:
        threading.Event().wait()  # a call that never returns
    return x

if __name__ == "__main__":
    inline = sys.argv[1] == "inline"  # workers.count = 0: the consumer's own thread asks for each chunk
    workers = WorkerConfig(0 if inline else 2, "thread" if inline else sys.argv[1], timeout_s=2)
    m = OrderedMapper(RangeSource(20), never_returns, workers=workers, chunk_size=1)
    try:
        list(m)
    finally:
        m.close()
"""


def run_script(tmp_path, code: str, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=tmp_path, **kw
    )


@pytest.mark.parametrize("backend", ["thread", "process", "inline"])
def test_a_call_that_never_returns_is_reported_naming_it_and_the_run_ends(tmp_path, backend):
    t0 = time.monotonic()
    # before: a thread worker's run never ended, nor an inline one (the call ran in the main thread)
    r = run_script(tmp_path, HUNG, backend, timeout=90)
    took = time.monotonic() - t0
    errors = [line for line in r.stderr.splitlines() if line.startswith("zephon.engine.mapper.WorkerError")]
    assert r.returncode == 1 and len(errors) == 1, r.stderr
    last = errors[0]
    assert "no result within 2 s from __main__.never_returns on the record 5 (source position 5)" in last, last
    # the line the call is stuck at: a thread's live stack, a process worker's dump on a signal
    assert f"stuck at {tmp_path / 'script.py'}:8 in never_returns" in last, last
    if backend == "inline":
        assert "(0 thread workers)" in last, last
    elif backend == "thread":  # the thread left behind, said once
        assert "left to end with the process" in r.stderr, r.stderr
    else:
        assert "(worker process " in last and last.count("stuck at") == 1, last  # not the idle worker
    assert took < 60, f"{took:.1f} s"


STALLED = """
import sys, time
from zephon import Recipe, WorkerConfig

if __name__ == "__main__":
    recipe = Recipe.from_toml(sys.argv[1])
    recipe.prepare(progress=None)
    print("indexed", flush=True)
    sys.stdin.readline()  # the server stalls from here on
    t0 = time.monotonic()
    try:
        with recipe.global_loader(1, workers=WorkerConfig(2, sys.argv[2], timeout_s=3)) as g:
            for _ in range(1000):
                next(g)
    finally:
        print(f"left the loader after {time.monotonic() - t0:.1f} s", flush=True)
"""


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_stalled_storage_read_ends_the_run_within_timeout_s_with_its_error(tmp_path, backend):
    sys.path.insert(0, os.path.join(TESTS, "support"))
    sys.path.insert(0, os.path.join(TESTS, "system"))
    try:
        from storage_server import FaultyServer
        from test_shutdown_bounded import recipe_text, shard
    finally:
        del sys.path[:2]
    script = tmp_path / "stalled.py"
    script.write_text(STALLED)
    with FaultyServer() as srv:
        for i in range(4):
            srv.files[f"/d/s{i}.jsonl"] = shard(i, 200)
        path = tmp_path / "r.toml"
        path.write_text(recipe_text([srv.url(f"/d/s{i}.jsonl") for i in range(4)], str(tmp_path / "c"), 1))
        p = subprocess.Popen(
            [sys.executable, str(script), str(path), backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "ZEPHON_IO_TIMEOUT_S": "600"},  # the read's own timeout is far away
        )
        try:
            assert p.stdout.readline().strip() == "indexed", p.stderr.read()
            seen = srv.requests
            srv.stall_s = 600.0
            t0 = time.monotonic()
            p.stdin.write("go\n")
            p.stdin.flush()
            out, err = p.communicate(timeout=90)  # before: 600 s with thread workers
            took = time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert srv.requests > seen, "the run read nothing after the stall started"
    assert p.returncode == 1 and "WorkerError" in err and "no result within 3 s from" in err, err
    assert "the call is stuck at" in err and "called from" in err and "zephon" in err, err
    assert "left the loader after" in out and took < 60, (took, out, err)


def _sleep_marked(mark: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # user code that ignores SIGTERM: killed after 2 s
    open(mark, "w").close()
    time.sleep(600)


def test_close_stops_busy_process_workers_all_at_once(tmp_path):
    pool = WorkerPool(WorkerConfig(3, "process", shm_mb=0))
    try:
        futs = [pool.submit(_sleep_marked, str(tmp_path / f"m{i}")) for i in range(3)]
        deadline = time.monotonic() + 120
        while len(os.listdir(tmp_path)) < 3:  # every worker is inside its call
            assert time.monotonic() < deadline, "the workers did not start their calls"
            time.sleep(0.05)
        procs = list(pool.executor._processes.values())
    finally:
        t0 = time.monotonic()
        pool.close()
        took = time.monotonic() - t0
    # before: each worker in turn was waited for 2 s, terminated, waited for 5 s, killed (3 x 7 s)
    assert took < 10, f"close() took {took:.1f} s for 3 busy workers"
    assert not [p for p in procs if p.is_alive()]
    assert all(f.done() for f in futs)


NO_GUARD = """
from zephon.engine import OrderedMapper, WorkerConfig
from zephon.engine.testing import RangeSource

m = OrderedMapper(RangeSource(8), abs, workers=WorkerConfig(2, "process"), chunk_size=1)
print(list(m))
m.close()
"""


def test_a_script_without_a_main_guard_is_refused_in_one_line(tmp_path):
    r = run_script(tmp_path, NO_GUARD, timeout=90)
    (line,) = [line for line in r.stderr.splitlines() if line.startswith("zephon.engine.mainguard.MainGuardError:")]
    assert r.returncode == 1, r.stderr
    assert f"{tmp_path / 'script.py'}:6 starts process workers" in line
    assert 'if __name__ == "__main__":' in line and 'workers.backend = "thread"' in line
    assert "bootstrapping phase" not in r.stderr, r.stderr  # no worker ever started


def test_the_same_script_under_a_guard_or_with_fork_runs(tmp_path):
    guarded = "\n".join(
        ["from zephon.engine import OrderedMapper, WorkerConfig", "from zephon.engine.testing import RangeSource"]
        + ['if __name__ == "__main__":']
        + ["    " + line for line in NO_GUARD.strip().splitlines()[3:]]
    )
    r = run_script(tmp_path, guarded, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == str(list(range(8))), r.stderr
    forked = NO_GUARD.replace('"process")', '"process", start_method="fork")')
    r = run_script(tmp_path, forked, timeout=120)  # fork does not run the script again
    assert r.returncode == 0 and r.stdout.strip() == str(list(range(8))), r.stderr


def test_guarded_reads_the_script(tmp_path):
    p = tmp_path / "s.py"
    p.write_text(
        'import os\nx = 1\nif __name__ == "__main__":\n    run()\n    more()\nif "__main__" == __name__: go()\n'
    )
    assert [guarded(str(p), line) for line in range(1, 7)] == [False, False, True, True, True, True]
    p.write_text("def broken(:\n")
    assert guarded(str(p), 1)  # a script that cannot be read is not refused


def test_a_close_waits_for_a_thread_call_not_reported_hung(capfd):
    pool = WorkerPool(WorkerConfig(1, "thread", timeout_s=60))
    fut = pool.submit(time.sleep, 1.0)
    time.sleep(0.2)  # inside the call
    pool.close()  # a call not reported hung is waited for (up to timeout_s), not left behind
    assert fut.done() and fut.result() is None
    assert "left to end with the process" not in capfd.readouterr().err


START_CUT = """
import signal, sys, time
from zephon.engine import WorkerConfig, WorkerPool

class Stop(SystemExit):
    pass

def stop(*_):
    raise Stop(143)

if __name__ == "__main__":
    signal.signal(signal.SIGALRM, stop)
    pool = WorkerPool(WorkerConfig(int(sys.argv[1]), "process"))
    signal.setitimer(signal.ITIMER_REAL, float(sys.argv[2]))  # while the fork server starts
    try:
        for i in range(8):
            pool.submit(abs, -i)
        time.sleep(30)
    except Stop:
        t0 = time.monotonic()
        pool.close()
        print(f"closed in {time.monotonic() - t0:.2f} s", flush=True)
"""


def test_a_close_during_a_worker_start_does_not_wait_for_the_fork_server(tmp_path, monkeypatch):
    """SIGTERM while the first worker starts: the start waits for the fork server, which imports
    zephon before its first fork (seconds on a busy machine). The close waits for a start at
    most CLOSE_GRACE_S (a forked process is listed within milliseconds), then stops the fork
    server so that a start left behind forks nothing: no half-started worker prints a traceback
    once this process is gone, and nothing is left running."""
    waits = []
    real = ProcessExecutor.wait_for_starts
    monkeypatch.setattr(ProcessExecutor, "wait_for_starts", lambda self, *a: waits.append(a) or real(self, *a))
    pool = WorkerPool(WorkerConfig(1, "process", shm_mb=0))
    assert pool.submit(abs, -3).result(timeout=120) == 3
    pool.close()
    assert waits == [(CLOSE_GRACE_S,)], waits  # before: () (up to 60 s)
    for delay in ("0.05", "0.6"):
        r = run_script(tmp_path, START_CUT, "4", delay, timeout=120)
        assert "Traceback" not in r.stderr and "closed in" in r.stdout, (r.stdout, r.stderr)
