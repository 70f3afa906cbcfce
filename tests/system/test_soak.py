"""Soak: thousands of steps with a save/restore every 100 steps on rotating world sizes and
worker counts; memory, file descriptors and threads stay flat (bounded, not timed)."""

from __future__ import annotations

import gc
import os
import threading

import pytest
from test_reliability import make_data, recipe

from zephon import WorkerConfig, batch_sha256
from zephon.engine.checkpoint import decode_state, encode_state


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_many_save_restore_cycles_stay_flat(tmp_path):
    root = str(tmp_path)
    make_data(root, n_good=200)
    r = recipe(root).replace(seq_len=16, global_batch_size=4)
    worlds = [1, 2, 4]
    workers = [WorkerConfig(0), WorkerConfig(1, "thread"), WorkerConfig(2, "thread")]
    state, samples = None, []
    ref_tail = None
    for cycle in range(30):
        with r.global_loader(worlds[cycle % 3], workers=workers[cycle % 3 - 1]) as g:
            if state is not None:
                g.load_state_dict(state)
            for _ in range(100):
                last = batch_sha256(next(g))
            state = decode_state(encode_state(g.state_dict()))
        gc.collect()
        samples.append((rss_mb(), fds(), threading.active_count()))
    # the chained run ends where an uninterrupted one does
    with r.global_loader(1) as g:
        for _ in range(3000):
            ref_tail = batch_sha256(next(g))
    assert last == ref_tail
    warm = samples[5]
    print(
        f"soak: RSS {warm[0]:.1f} -> {samples[-1][0]:.1f} MB, fds {warm[1]} -> {samples[-1][1]}, threads {warm[2]} -> {samples[-1][2]}"
    )
    end = samples[-1]
    assert end[1] <= warm[1] + 2, f"file descriptors grew: {warm[1]} -> {end[1]}"
    assert end[2] <= warm[2], f"threads grew: {warm[2]} -> {end[2]}"
    assert end[0] - warm[0] < 64, f"RSS grew by {end[0] - warm[0]:.1f} MB over 2,500 steps: {samples}"
    assert max(len(v) for k, v in encode_state(state).items() if k.startswith("lane_")) < 1024
