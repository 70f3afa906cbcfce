"""S3 against a real S3-compatible server (issue 21): moto's standalone server in a subprocess,
the shards put there, and a recipe read over ``s3://`` through fsspec (s3fs). The batches are
byte-identical to the same files on local disk; a server killed mid-run is retried within
``$ZEPHON_IO_RETRY_S`` and then named; a stalled server ends at the request timeout; an object
changed after indexing is refused naming it."""

from __future__ import annotations

import io
import signal
import time

import pytest
from storage_server import moto_bucket
from text_fixtures import write_corpus, write_recipe

pytest.importorskip("moto", reason="moto[server] is not installed (pip install -e '.[dev]')")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")

from zephon import Recipe, WorkerConfig  # noqa: E402
from zephon.data import DataError, index_dataset  # noqa: E402
from zephon.tools.cli import run_hashes  # noqa: E402

BUCKET = "zephon-test"


@pytest.fixture
def s3(monkeypatch):
    """A fresh server, with the environment s3fs reads (credentials, endpoint) pointing at it."""
    with moto_bucket(monkeypatch, BUCKET) as got:
        yield got


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("s3corpus")
    write_corpus(str(root), scale=0.02)
    return root


def test_a_recipe_over_s3_gives_the_batches_of_the_same_local_files(s3, corpus, tmp_path):
    _, fs = s3
    fs.put(str(corpus), f"{BUCKET}/corpus", recursive=True)
    local = Recipe.from_toml(write_recipe(str(corpus), "local.toml", buffer=4)).replace(
        cache_dir=str(tmp_path / "local-cache")
    )
    remote_toml = write_recipe(str(corpus), "s3.toml", buffer=4)
    text = open(remote_toml).read()
    for sub in ("web/", "code/", "books/"):
        text = text.replace(f'path = "{sub}', f'path = "s3://{BUCKET}/corpus/{sub}')
    with open(remote_toml, "w") as f:
        f.write(text)
    remote = Recipe.from_toml(remote_toml).replace(cache_dir=str(tmp_path / "s3-cache"))
    assert all(str(d.path).startswith("s3://") for d in remote.datasets)
    for workers in (WorkerConfig(0), WorkerConfig(2, "thread")):
        want = run_hashes(local, world_size=2, steps=4, workers=workers, out=io.StringIO())
        got = run_hashes(remote, world_size=2, steps=4, workers=workers, out=io.StringIO())
        assert got == want


LINES = b"".join(b'{"text": "document %d about s3"}\n' % i for i in range(400))


def test_a_server_killed_mid_run_is_retried_then_named(s3, tmp_path, monkeypatch):
    server, fs = s3
    fs.pipe(f"{BUCKET}/d/a.jsonl", LINES)
    ix = index_dataset("web", f"s3://{BUCKET}/d/*.jsonl", format="jsonl", cache_dir=str(tmp_path / "c"))
    assert ix.read(0, [3]) == ["document 3 about s3"]
    monkeypatch.setenv("ZEPHON_IO_RETRY_S", "3")
    monkeypatch.setenv("ZEPHON_IO_TIMEOUT_S", "1")
    server.stop()
    t0 = time.monotonic()
    with pytest.raises(DataError) as e:
        ix.read(0, [200])
    took = time.monotonic() - t0
    assert f"s3://{BUCKET}/d/a.jsonl" in str(e.value) and "ZEPHON_IO_RETRY_S" in str(e.value), e.value
    assert "tries" in str(e.value) and took < 30, (took, e.value)


def test_a_stalled_server_ends_at_the_request_timeout(s3, tmp_path, monkeypatch):
    server, fs = s3
    fs.pipe(f"{BUCKET}/d/a.jsonl", LINES)
    ix = index_dataset("web", f"s3://{BUCKET}/d/*.jsonl", format="jsonl", cache_dir=str(tmp_path / "c"))
    monkeypatch.setenv("ZEPHON_IO_RETRY_S", "2")
    monkeypatch.setenv("ZEPHON_IO_TIMEOUT_S", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    ix = index_dataset("web", f"s3://{BUCKET}/d/*.jsonl", format="jsonl", cache_dir=str(tmp_path / "c"))
    server.p.send_signal(signal.SIGSTOP)  # connections are accepted, nothing is ever answered
    try:
        t0 = time.monotonic()
        with pytest.raises(DataError) as e:
            ix.read(0, [100])
        took = time.monotonic() - t0
    finally:
        server.p.send_signal(signal.SIGCONT)
    assert f"s3://{BUCKET}/d/a.jsonl" in str(e.value) and took < 60, (took, e.value)


def test_an_object_changed_after_indexing_is_refused_naming_it(s3, tmp_path):
    _, fs = s3
    fs.pipe(f"{BUCKET}/d/a.jsonl", LINES)
    ix = index_dataset("web", f"s3://{BUCKET}/d/*.jsonl", format="jsonl", cache_dir=str(tmp_path / "c"))
    assert ix.read(0, [7]) == ["document 7 about s3"]
    fs.pipe(f"{BUCKET}/d/a.jsonl", LINES.replace(b"document 9 ", b"DOCUMENT 9 "))  # same size
    with pytest.raises(DataError) as e:
        ix.read(0, [9])
    assert f"s3://{BUCKET}/d/a.jsonl" in str(e.value) and "changed" in str(e.value), e.value
    # a new job on the same cache indexes the new object (its ETag is its version)
    s3fs.S3FileSystem.clear_instance_cache()
    again = index_dataset("web", f"s3://{BUCKET}/d/*.jsonl", format="jsonl", cache_dir=str(tmp_path / "c"))
    assert again.read(0, [9]) == ["DOCUMENT 9 about s3"]
