"""Shutdown in bounded time (issue 21, class 5): SIGTERM or Ctrl-C while a `zephon hashes` run
indexes 300 remote shards, fills a large shuffle window, or writes its checkpoint ends the
process within seconds, with no process and no temporary file left behind and the previous
checkpoint intact; closing a loader from another thread stops a fill in progress.

Real processes and a real HTTP server. Times are measured to the process's last line ("zephon
hashes: terminated ..."), printed once everything is closed: the interpreter's own teardown
after it (seconds on a loaded machine) is not zephon's."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from storage_server import FaultyServer
from test_shutdown import alive, descendants

from zephon import Recipe, WorkerConfig
from zephon.tools.demo import TOKENIZER_DIR

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

LINES = [para for para in open(json.__file__, encoding="utf-8").read().split("\n\n") if para.strip()]


def recipe_text(paths: list[str], cache: str, buffer: int, lanes: int = 2, seq_len: int = 64) -> str:
    return (
        f'seed = 1\nlanes = {lanes}\nseq_len = {seq_len}\nglobal_batch_size = {lanes}\ncache_dir = "{cache}"\n'
        f'[tokenizer]\npath = "{TOKENIZER_DIR}"\n'
        f'[[datasets]]\nname = "d"\npath = {json.dumps(paths)}\nformat = "jsonl"\n'
        f"[shuffle]\nbuffer = {buffer}\n"
    )


def shard(i: int, n: int = 40) -> bytes:
    return "".join(json.dumps({"text": f"{i} {LINES[(i * n + j) % len(LINES)]}"}) + "\n" for j in range(n)).encode()


class Run:
    """``zephon hashes`` in its own process group; stderr lines collected with their arrival time."""

    def __init__(self, recipe: str, *args: str, env: dict[str, str] | None = None, code: str | None = None) -> None:
        cmd = [sys.executable, "-m", "zephon", "hashes", recipe, "--steps", "1000000", *args]
        if code is not None:  # the same command, after `code` (a slow disk, ...)
            cmd = [sys.executable, "-c", code + "\nfrom zephon.tools.cli import main; sys.exit(main())", *cmd[3:]]
        self.p = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.err: list[tuple[float, str]] = []
        self._t = threading.Thread(target=self._drain, daemon=True)
        self._t.start()
        self.t_signal = 0.0

    def _drain(self) -> None:
        for line in self.p.stderr:
            self.err.append((time.monotonic(), line.rstrip("\n")))

    def signal(self, how: str) -> set[int]:
        tree = descendants(self.p.pid)
        self.t_signal = time.monotonic()
        if how == "ctrl_c":
            os.killpg(self.p.pid, signal.SIGINT)
        else:
            self.p.send_signal(signal.SIGTERM)
        return tree

    def finish(self, tree: set[int], timeout: float = 120) -> tuple[int, float, str]:
        """(exit status, seconds from the signal to the last line, stderr); kills what is left."""
        try:
            self.p.wait(timeout=timeout)
        finally:
            for c in [*tree, self.p.pid]:
                if alive(c):
                    os.kill(c, signal.SIGKILL)
            self.p.wait(timeout=30)
            self._t.join(timeout=10)
        last = self.err[-1][0] if self.err else time.monotonic()
        return self.p.returncode, last - self.t_signal, "\n".join(line for _, line in self.err)

    def wait_for(self, cond, what: str, limit: float = 240) -> None:
        deadline = time.monotonic() + limit
        while not cond():
            assert self.p.poll() is None, f"ended before {what}: " + "\n".join(l for _, l in self.err)
            assert time.monotonic() < deadline, f"no {what} within {limit} s"
            time.sleep(0.05)


@pytest.fixture
def remote_shards():
    with FaultyServer() as srv:
        for i in range(300):
            srv.files[f"/d/s{i:03d}.jsonl"] = shard(i)
        yield srv


def start_indexing(srv: FaultyServer, run: Run, stall_s: float) -> None:
    """Wait until the 300 shards are listed (one HEAD each), then slow the server down to
    ``stall_s`` per request and wait until their indexing (one GET each) is under way."""
    run.wait_for(lambda: srv.requests >= 300, "the listing")
    srv.stall_s = stall_s
    run.wait_for(lambda: srv.requests >= 303, "indexing")
    time.sleep(0.5)


@pytest.mark.parametrize("how", ["sigterm", "ctrl_c"])
def test_a_signal_while_indexing_300_shards_drops_the_queued_ones(remote_shards, tmp_path, how):
    srv = remote_shards
    path = tmp_path / "r.toml"
    path.write_text(recipe_text([srv.url(f"/d/s{i:03d}.jsonl") for i in range(300)], str(tmp_path / "c"), 1))
    run = Run(str(path), "--workers", "0", env={"ZEPHON_STOP_GRACE_S": "60"})
    start_indexing(srv, run, 0.2)  # a slow object store: 300 shards take a minute to index
    tree = run.signal(how)
    rc, took, err = run.finish(tree)
    seen = srv.requests - 300
    assert rc == (143 if how == "sigterm" else 130), err
    assert took < 8 and "Traceback" not in err, (took, err)
    assert seen < 60, f"{seen} requests: the queued shards were indexed before the process stopped"
    assert not [c for c in tree if alive(c)]


def test_a_read_stalled_past_the_grace_period_still_ends_the_process(remote_shards, tmp_path):
    srv = remote_shards
    path = tmp_path / "r.toml"
    path.write_text(recipe_text([srv.url(f"/d/s{i:03d}.jsonl") for i in range(300)], str(tmp_path / "c"), 1))
    run = Run(str(path), "--workers", "0", env={"ZEPHON_STOP_GRACE_S": "2", "ZEPHON_IO_TIMEOUT_S": "600"})
    run.wait_for(lambda: srv.requests >= 300, "the listing")
    srv.stall_s = 300.0  # every read hangs; the read timeout is longer still
    run.wait_for(lambda: srv.requests >= 302, "indexing")
    time.sleep(0.5)
    t0 = time.monotonic()
    rc, _, err = run.finish(run.signal("sigterm"), timeout=120)
    assert rc == 143 and time.monotonic() - t0 < 60, (time.monotonic() - t0, err)


STUCK = """
import sys, threading, time
from zephon.engine.shutdown import stop_on_signals
threading.Thread(target=time.sleep, args=(600,)).start()  # a call nothing interrupts, not a daemon
with stop_on_signals("stuck"):
    print("ready", flush=True)
    time.sleep(600)
"""


def test_the_watchdog_ends_a_process_that_a_stuck_thread_keeps_alive():
    p = subprocess.Popen(
        [sys.executable, "-c", STUCK],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ZEPHON_STOP_GRACE_S": "1"},
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err = p.stderr.read()
    assert p.returncode == 143 and took < 30, (took, err)
    assert "stuck: still running 1 s after SIGTERM; exiting now" in err, err


@pytest.fixture(scope="module")
def local_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("fill")
    for i in range(8):
        (root / f"s{i}.jsonl").write_bytes(shard(i, 400))
    return root


@pytest.mark.parametrize("workers", [["--workers", "0"], ["--workers", "2", "--backend", "process"]])
def test_a_signal_during_the_first_fill_of_a_large_window_ends_within_seconds(local_corpus, tmp_path, workers):
    cache = tmp_path / "c"
    path = tmp_path / "r.toml"
    # a window of 2 x 150,000 rows of 64 tokens: its first fill takes minutes
    path.write_text(recipe_text([str(local_corpus / "*.jsonl")], str(cache), 150_000))
    run = Run(str(path), *workers, env={"ZEPHON_STOP_GRACE_S": "60", "ZEPHON_MEMORY_GB": "64"})
    run.wait_for(lambda: len(glob.glob(str(cache / "*.npz"))) >= 1, "the index")  # one table per dataset
    time.sleep(3.0)  # the fill is under way
    rc, took, err = run.finish(run.signal("sigterm"))
    assert rc == 143 and "Traceback" not in err, err
    assert took < 8, f"{took:.1f} s from SIGTERM to the end"
    assert err.splitlines()[-1].startswith("zephon hashes: terminated"), err


SLOW_DISK = """
import os, sys, time
_fsync = os.fsync
def fsync(fd):  # a checkpoint write on a slow disk: the signal arrives in the middle of it
    if os.environ.get("SLOW_FSYNC_MARK") and not os.path.exists(os.environ["SLOW_FSYNC_MARK"]):
        open(os.environ["SLOW_FSYNC_MARK"], "w").close()
        time.sleep(600)
    _fsync(fd)
os.fsync = fsync
"""


@pytest.mark.parametrize("how", ["sigterm", "ctrl_c"])
def test_a_signal_during_a_save_keeps_the_previous_checkpoint_and_no_temp_file(local_corpus, tmp_path, how):
    path = tmp_path / "r.toml"
    path.write_text(recipe_text([str(local_corpus / "*.jsonl")], str(tmp_path / "c"), 1))
    ck = tmp_path / "ck"
    first = subprocess.run(
        [
            sys.executable,
            "-m",
            "zephon",
            "hashes",
            str(path),
            "--steps",
            "1",
            "--save-at",
            "1",
            "--checkpoint",
            str(ck),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr
    before = (ck / "zephon_state.json").read_bytes()
    mark = tmp_path / "fsync-started"
    run = Run(
        str(path),
        "--save-at",
        "3",
        "--checkpoint",
        str(ck),
        env={"SLOW_FSYNC_MARK": str(mark), "ZEPHON_STOP_GRACE_S": "60"},
        code=SLOW_DISK,
    )
    run.wait_for(mark.exists, "the save")
    rc, took, err = run.finish(run.signal(how))
    assert rc == (143 if how == "sigterm" else 130) and took < 8, (took, err)
    assert sorted(os.listdir(ck)) == ["zephon_state.json"], "a temporary file was left behind"
    assert (ck / "zephon_state.json").read_bytes() == before


@pytest.mark.parametrize("prefetch", [0, 4])
def test_close_from_another_thread_stops_a_fill_in_progress(local_corpus, tmp_path, prefetch):
    path = tmp_path / "r.toml"
    path.write_text(recipe_text([str(local_corpus / "*.jsonl")], str(tmp_path / "c"), 150_000, lanes=1))
    recipe = Recipe.from_toml(path).replace(memory_gb=64)
    recipe.prepare(progress=None)
    router = recipe.router(1, 0, workers=WorkerConfig(0), prefetch=prefetch)
    got: list[BaseException] = []

    def iterate() -> None:
        try:
            next(router)
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=iterate, daemon=True)
    t.start()
    time.sleep(2.0)
    assert t.is_alive(), "the fill ended before the close: make the window larger"
    t0 = time.monotonic()
    router.close()
    t.join(timeout=30)
    took = time.monotonic() - t0
    assert not t.is_alive() and took < 5, f"close() took {took:.1f} s"
    assert got and "closed" in str(got[0]), got
