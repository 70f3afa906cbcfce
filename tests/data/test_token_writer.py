"""The token cache's background writer (:mod:`zephon.data.datasets.tokenwriter`): what is queued
within its gathering time is written once per block, in order; what is queued beyond its bound
is refused (the cache counts it as dropped), and flush waits for the rest."""

from __future__ import annotations

import threading

from zephon.data.datasets import tokenwriter


def recorder():
    calls: list[tuple[str, list]] = []
    lock = threading.Lock()

    def write(path, tag, width, items):
        with lock:
            calls.append((path, list(items)))

    return calls, write


def test_writes_queued_together_are_appended_once_per_block_in_order(monkeypatch):
    monkeypatch.setattr(tokenwriter, "GATHER_S", 5.0)  # everything below is queued within one gathering
    calls, write = recorder()
    w = tokenwriter.GatheringWriter(write)
    for i in range(6):
        assert w.put(f"block{i % 2}", b"t" * 8, 2, [(i, "e")], 10)
    assert w.flush(10.0)  # cuts the 5 s gathering short
    assert sorted(calls) == [("block0", [(0, "e"), (2, "e"), (4, "e")]), ("block1", [(1, "e"), (3, "e"), (5, "e")])]


def test_a_writer_too_far_behind_refuses_more_and_flush_writes_the_rest(monkeypatch):
    monkeypatch.setattr(tokenwriter, "QUEUE_BYTES", 25)
    gate = threading.Event()
    calls, record = recorder()

    def write(path, tag, width, items):
        gate.wait(10.0)  # a slow disk
        record(path, tag, width, items)

    w = tokenwriter.GatheringWriter(write)
    assert w.put("a", b"t" * 8, 2, [(0, "e")], 10)
    assert w.put("a", b"t" * 8, 2, [(1, "e")], 10)
    assert not w.put("a", b"t" * 8, 2, [(2, "e")], 10)  # 30 bytes would be waiting: dropped
    assert not w.flush(0.1)
    gate.set()
    assert w.flush(10.0)
    assert [k for _, items in calls for k, _ in items] == [0, 1]
    assert w.put("a", b"t" * 8, 2, [(3, "e")], 10) and w.flush(10.0)  # room again once written
