"""No orphans: a `zephon hashes` run with process workers that is preempted (SIGTERM), killed
(SIGKILL) or interrupted (Ctrl-C to its process group) leaves no process and no shared-memory file
behind; SIGTERM and Ctrl-C end it within seconds with one line and no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from text_fixtures import write_corpus, write_recipe

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc: workers, fork server, resource tracker)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parent[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo.extend(kids)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def shm_files(pids: set[int]) -> set[str]:
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                out.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line)
        except (OSError, IndexError):
            continue
    return {p.replace(" (deleted)", "") for p in out if not p.endswith("(deleted)")}


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("shutdown")
    write_corpus(str(root), scale=0.02)
    extra = '[workers]\ncount = 2\nbackend = "process"\nchunk_size = 4\n'
    return write_recipe(str(root), buffer=1, extra=extra)


def start(recipe_path):
    p = subprocess.Popen(
        [sys.executable, "-m", "zephon", "hashes", recipe_path, "--steps", "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as under a scheduler or a terminal
    )
    for _ in range(3):  # running, workers started
        assert p.stdout.readline().startswith("step "), p.stderr.read()
    # drain its output, so that it never blocks on a full pipe
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
    tree = descendants(p.pid)
    assert len(tree) >= 3, "expected a fork server and two workers"
    return p, tree, shm_files(tree | {p.pid})


@pytest.mark.parametrize("how", ["sigterm", "sigkill", "ctrl_c"])
def test_nothing_is_left_behind(recipe_path, how):
    p, tree, shm = start(recipe_path)
    left: list[int] = []
    err, took = "", 0.0
    try:
        t0 = time.monotonic()
        if how == "ctrl_c":
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        p.wait(timeout=30)
        took = time.monotonic() - t0
        deadline = time.monotonic() + 20
        while any(alive(c) for c in tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [c for c in tree if alive(c)]
    finally:  # leave nothing behind, even when the test fails (orphans hold our pipes open)
        for c in [*tree, p.pid]:
            if alive(c):
                os.kill(c, signal.SIGKILL)
        p.wait(timeout=30)
        if left:
            for f in shm:  # their resource tracker is gone too: nobody else removes these
                if os.path.exists(f):
                    os.unlink(f)
    err = p.stderr.read()
    assert not left, f"{len(left)} of {len(tree)} processes outlived the run ({how})"
    assert not [f for f in shm if os.path.exists(f)], "shared-memory files left behind"
    if how != "sigkill":
        assert p.returncode == (143 if how == "sigterm" else 130), err
        assert "Traceback" not in err and took < 15, (took, err)
        assert err.strip().splitlines()[-1].startswith("zephon hashes: "), err
