"""Storage faults over ``http://`` (a real server on 127.0.0.1): 500s and dropped connections
are retried with backoff and then fail with a DataError naming the URL inside the retry budget;
a stall ends at the request timeout instead of hanging; a server that ignores Range is named as
such (not reported as a changed file)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from storage_server import FaultyServer

from zephon.data import DataError, index_dataset

LINES = [json.dumps({"text": f"document number {i} " + "x" * (i % 17)}) for i in range(300)]
DATA = ("\n".join(LINES) + "\n").encode()
TEXTS = [json.loads(x)["text"] for x in LINES]


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("ZEPHON_IO_RETRY_S", "3")
    monkeypatch.setenv("ZEPHON_IO_TIMEOUT_S", "0.5")
    with FaultyServer() as srv:
        srv.files["/d/a.jsonl"] = DATA
        yield srv


def bounded(fn, limit_s: float = 20.0):
    """fn()'s result or exception, failing the test if it takes longer than limit_s (a hang)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"still running after {limit_s} s (hung)"
    out["seconds"] = time.monotonic() - t0
    return out


def index(srv, tmp_path):
    return index_dataset("web", srv.url("/d/a.jsonl"), format="jsonl", cache_dir=str(tmp_path / "cache"))


def test_transient_500s_while_indexing_and_reading_are_retried(server, tmp_path):
    server.fail_next = 3
    ix = index(server, tmp_path)
    assert ix.num_records == len(LINES)
    server.fail_next = 2
    assert ix.read(0, [0, 150, 299]) == [TEXTS[0], TEXTS[150], TEXTS[299]]


def test_a_server_that_keeps_failing_is_a_data_error_naming_the_url(server, tmp_path):
    server.fail_always = True
    got = bounded(lambda: index(server, tmp_path))
    e = got.get("error")
    assert isinstance(e, DataError), e
    assert server.url("/d/a.jsonl") in str(e) and "500" in str(e) and "ZEPHON_IO_RETRY_S" in str(e)
    assert got["seconds"] < 15


def test_a_failing_read_is_a_data_error_naming_the_url(server, tmp_path):
    ix = index(server, tmp_path)
    server.fail_always = True
    e = bounded(lambda: ix.read(0, [5])).get("error")
    assert isinstance(e, DataError) and server.url("/d/a.jsonl") in str(e) and "500" in str(e), e


def test_dropped_connections_are_retried(server, tmp_path):
    server.drop_next = 2
    ix = index(server, tmp_path)
    assert ix.num_records == len(LINES)
    server.drop_next = 2
    assert ix.read(0, [7, 8]) == TEXTS[7:9]


def test_a_stall_while_indexing_ends_within_the_timeout(server, tmp_path):
    server.stall_s = 30
    got = bounded(lambda: index(server, tmp_path))
    e = got.get("error")
    assert isinstance(e, DataError) and server.url("/d/a.jsonl") in str(e) and "timeout" in str(e), e
    assert got["seconds"] < 15


def test_a_stall_on_a_read_ends_within_the_timeout(server, tmp_path):
    ix = index(server, tmp_path)
    server.stall_s = 30
    got = bounded(lambda: ix.read(0, [1]))
    e = got.get("error")
    assert isinstance(e, DataError) and server.url("/d/a.jsonl") in str(e), e
    assert got["seconds"] < 15


def test_a_server_that_ignores_range_is_named(server, tmp_path):
    server.ignore_range = True
    ix = index(server, tmp_path)  # indexing streams the file: no Range needed
    assert ix.num_records == len(LINES)
    e = bounded(lambda: ix.read(0, [10])).get("error")
    assert isinstance(e, DataError) and "Range" in str(e) and "changed" not in str(e), e
    assert server.url("/d/a.jsonl") in str(e)


def test_a_missing_file_is_not_retried(server, tmp_path):
    got = bounded(lambda: index_dataset("web", server.url("/d/none.jsonl"), format="jsonl", cache_dir=None))
    assert isinstance(got.get("error"), DataError) and "not found" in str(got["error"])
    assert got["seconds"] < 2


def _read_in_worker(ix, shard, rows):
    return ix.read(shard, rows)


def test_a_stall_on_a_process_workers_read_ends_within_the_timeout(server, tmp_path):
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ix = index(server, tmp_path)
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        assert pool.submit(_read_in_worker, ix, 0, [2]).result(timeout=60) == [TEXTS[2]]  # the index travels
        server.stall_s = 30
        t0 = time.monotonic()
        with pytest.raises(DataError, match="timeout") as e:
            pool.submit(_read_in_worker, ix, 0, [3]).result(timeout=30)
        assert time.monotonic() - t0 < 20 and server.url("/d/a.jsonl") in str(e.value)
        server.stall_s = 0


def test_a_short_or_long_body_is_retried_then_refused_naming_the_url(server, tmp_path):
    server.short_next = 2  # two short answers, then the whole object: retried, the same index
    ix = index(server, tmp_path / "a")
    assert ix.num_records == len(LINES) and ix.read(0, [299]) == [TEXTS[299]]
    for short_by in (300, -40):
        server.short_next, server.short_by = 10**6, short_by
        e = bounded(lambda d=tmp_path / f"b{short_by}": index(server, d)).get("error")
        assert isinstance(e, DataError), e
        assert server.url("/d/a.jsonl") in str(e) and f"not the object's {len(DATA)}" in str(e), e


def test_a_short_body_into_the_node_cache_is_retried_then_refused(server, tmp_path, monkeypatch):
    ix = index(server, tmp_path / "a")  # indexed directly; then the reads download into the cache
    monkeypatch.setenv("ZEPHON_SHARD_CACHE", str(tmp_path / "node-cache"))
    monkeypatch.setenv("ZEPHON_SHARD_AHEAD", "0")
    server.short_next = 2  # the download: two short answers, then the whole object
    assert ix.read(0, [0, 299]) == [TEXTS[0], TEXTS[299]]
    assert server.short_next == 0 and len(os.listdir(tmp_path / "node-cache" / "objects")) == 1
    monkeypatch.setenv("ZEPHON_SHARD_CACHE", str(tmp_path / "other-cache"))
    server.short_next = 10**6
    e = bounded(lambda: ix.read(0, [5])).get("error")
    assert isinstance(e, DataError) and server.url("/d/a.jsonl") in str(e) and "not the object's" in str(e), e
