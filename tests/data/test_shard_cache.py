"""The node-local shard cache (issue 26, item 2) against moto's standalone S3 server: batches are
byte-identical to local files with and without the cache (W = 1 and 2, thread and process
workers); two jobs (two processes) on one cold cache download each object once (the server's
request log); a server killed after the cache is warm does not stop the run; a changed object
is re-fetched under its new version or refused, never read stale; eviction under a small cap
spares an entry another process holds; a folder that cannot be used means direct reads and one
warning; download-ahead fetches the shards the lanes need next without changing batches."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import warnings

import pytest
from storage_server import MotoServer
from text_fixtures import write_corpus, write_recipe

pytest.importorskip("moto", reason="moto[server] is not installed (pip install -e '.[dev]')")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")

from zephon import Recipe, WorkerConfig, batch_sha256  # noqa: E402
from zephon.data import DataError, NodeCache, index_dataset, node_cache  # noqa: E402
from zephon.data.datasets.nodecache import entry_key  # noqa: E402
from zephon.recipe.runtime import RankBatches  # noqa: E402
from zephon.tools.cli import run_hashes  # noqa: E402

BUCKET = "zephon-cache"
SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


@pytest.fixture
def s3(monkeypatch, tmp_path):
    """A fresh server logging its requests, the S3 environment pointing at it, and a node cache
    folder set in the environment."""
    log = str(tmp_path / "moto.log")
    server = MotoServer(log=log)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    monkeypatch.setenv("ZEPHON_SHARD_CACHE", str(tmp_path / "node-cache"))
    monkeypatch.delenv("ZEPHON_SHARD_CACHE_GB", raising=False)
    monkeypatch.delenv("ZEPHON_SHARD_AHEAD", raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir(BUCKET)
    try:
        yield server, fs, log
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("cachecorpus")
    write_corpus(str(root), scale=0.02)
    return root


def remote_recipe(corpus, fs) -> tuple[str, list[str]]:
    """The corpus put on the server and a recipe reading it over s3:// (path, object keys)."""
    keys = []
    for sub in ("web", "code", "books"):
        for name in sorted(os.listdir(corpus / sub)):
            fs.put(str(corpus / sub / name), f"{BUCKET}/corpus/{sub}/{name}")
            keys.append(f"/{BUCKET}/corpus/{sub}/{name}")
    path = write_recipe(str(corpus), "cache-s3.toml", buffer=4)
    text = open(path).read()
    for sub in ("web/", "code/", "books/"):
        text = text.replace(f'path = "{sub}', f'path = "s3://{BUCKET}/corpus/{sub}')
    with open(path, "w") as f:
        f.write(text)
    return path, keys


@pytest.fixture(scope="module")
def local_hashes(corpus, tmp_path_factory):
    """The batches of the same files on local disk (any W and worker count gives these)."""
    r = Recipe.from_toml(write_recipe(str(corpus), "cache-local.toml", buffer=4))
    r = r.replace(cache_dir=str(tmp_path_factory.mktemp("local-index")))
    return run_hashes(r, world_size=1, steps=6, workers=WorkerConfig(0), out=io.StringIO())


def entries(tmp_path) -> list[str]:
    return [n for n in os.listdir(tmp_path / "node-cache" / "objects") if not n.startswith(".")]


def test_batches_through_the_cache_are_those_of_local_files(s3, corpus, local_hashes, tmp_path):
    server, fs, log = s3
    path, keys = remote_recipe(corpus, fs)
    remote = Recipe.from_toml(path)
    runs = [(1, WorkerConfig(2, "thread")), (2, WorkerConfig(2, "process")), (2, WorkerConfig(0))]
    for i, (world, workers) in enumerate(runs):  # the first run on a cold cache, the others warm
        r = remote.replace(cache_dir=str(tmp_path / f"index-{i}"))  # each run indexes again
        got = run_hashes(r, world_size=world, steps=6, workers=workers, out=io.StringIO())
        assert got == local_hashes, (world, workers)
    assert len(entries(tmp_path)) == len(keys)
    assert [server.gets(log, k) for k in keys] == [1] * len(keys)  # one download per object, ever


def test_two_jobs_on_a_cold_cache_download_each_object_once(s3, corpus, local_hashes, tmp_path):
    server, fs, log = s3
    path, keys = remote_recipe(corpus, fs)
    env = dict(os.environ, PYTHONPATH=SUPPORT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    jobs = [
        subprocess.Popen(
            [sys.executable, os.path.join(SUPPORT, "cache_job.py"), path, str(tmp_path / f"ix{j}"), "2", "6", "0", "-"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for j in range(2)
    ]
    outs = []
    for p in jobs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert [o["hashes"] for o in outs] == [local_hashes, local_hashes]
    assert sum(o["stats"]["downloads"] for o in outs) == len(keys), [o["stats"] for o in outs]
    assert [server.gets(log, k) for k in keys] == [1] * len(keys)
    assert len(entries(tmp_path)) == len(keys)


def test_a_server_killed_after_the_cache_is_warm_does_not_stop_the_run(s3, corpus, local_hashes, tmp_path, monkeypatch):
    server, fs, _ = s3
    path, _keys = remote_recipe(corpus, fs)
    monkeypatch.setenv("ZEPHON_IO_RETRY_S", "1")
    monkeypatch.setenv("ZEPHON_IO_TIMEOUT_S", "1")
    r = Recipe.from_toml(path).replace(cache_dir=str(tmp_path / "index"))
    got = []
    with RankBatches(r, 2, None, workers=WorkerConfig(2, "thread")) as g:  # indexing warms the cache
        got.append(batch_sha256(g.next_step()))
        server.stop()
        got += [batch_sha256(g.next_step()) for _ in range(5)]
    assert got == local_hashes


LINES = b"".join(b'{"text": "document %d in the cache"}\n' % i for i in range(300))


def test_a_changed_object_is_fetched_again_by_version_never_read_stale(s3, tmp_path):
    _, fs, _ = s3
    url = f"s3://{BUCKET}/d/*.jsonl"
    fs.pipe(f"{BUCKET}/d/a.jsonl", LINES)
    old = index_dataset("web", url, format="jsonl", cache_dir=str(tmp_path / "ix"))
    assert old.read(0, [9]) == ["document 9 in the cache"]
    fs.pipe(f"{BUCKET}/d/a.jsonl", LINES.replace(b"document 9 ", b"DOCUMENT 9 "))  # same size
    s3fs.S3FileSystem.clear_instance_cache()
    new = index_dataset("web", url, format="jsonl", cache_dir=str(tmp_path / "ix"))
    assert new.read(0, [9]) == ["DOCUMENT 9 in the cache"]  # the new version, fetched under its own key
    assert old.read(0, [9]) == ["document 9 in the cache"]  # the old job keeps the bytes it indexed
    assert len(entries(tmp_path)) == 2
    # a job that indexed the old version, on a cold cache: the download is refused, naming the object
    node_cache().drain()
    node_cache().close()  # as a new process: no copy open
    for n in entries(tmp_path):
        os.unlink(tmp_path / "node-cache" / "objects" / n)
    old._caches.clear()
    with pytest.raises(DataError) as e:
        old.read(0, [9])
    assert f"s3://{BUCKET}/d/a.jsonl" in str(e.value) and "changed" in str(e.value), e.value
    assert entries(tmp_path) == []  # nothing kept under the old version's key


HOLDER = """
import sys, time
from zephon.data import NodeCache
c = NodeCache(sys.argv[1], 10**9)
with c.hold(sys.argv[2], 0, lambda sink: None) as p:
    print(p, flush=True)
    sys.stdin.readline()
"""


def test_eviction_under_a_small_cap_spares_an_entry_another_process_reads(s3, tmp_path, monkeypatch):
    _, fs, _ = s3
    for name in ("a", "b", "c"):
        fs.pipe(f"{BUCKET}/e/{name}.jsonl", LINES.replace(b"document", name.encode() * 8))
    size = len(LINES.replace(b"document", b"a" * 8))
    monkeypatch.setenv("ZEPHON_SHARD_CACHE_GB", str(2.5 * size / 1e9))  # room for two shards
    ix = index_dataset("web", f"s3://{BUCKET}/e/*.jsonl", format="jsonl", cache_dir=str(tmp_path / "ix"))
    cache = node_cache()
    assert cache is not None and cache.limit < 3 * size
    assert cache.stats["downloads"] == 3 and cache.stats["evictions"] == 1  # indexing a, b, c: one evicted
    key = [entry_key(s.url, s.version, s.size) for s in ix._specs]
    objects = tmp_path / "node-cache" / "objects"
    (gone,) = [s for s in range(3) if key[s] not in entries(tmp_path)]
    held, other = [s for s in range(3) if s != gone]
    holder = subprocess.Popen(  # another process reads `held`, holding its entry
        [sys.executable, "-c", HOLDER, str(tmp_path / "node-cache"), key[held]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip().endswith(key[held])
        os.utime(objects / key[held], (1000, 1000))  # the least recently used entry: evicted first, if not held
        os.utime(objects / key[other], (2000, 2000))
        name = "abc"[gone]
        assert ix.read(gone, [5]) == [f"{name * 8} 5 in the cache"]  # `other` is evicted, `held` is spared
        assert sorted(entries(tmp_path)) == sorted([key[held], key[gone]])
        os.utime(objects / key[gone], (3000, 3000))
        name = "abc"[other]
        assert ix.read(other, [7]) == [f"{name * 8} 7 in the cache"]  # again the held one is spared
        assert sorted(entries(tmp_path)) == sorted([key[held], key[other]])
    finally:
        holder.communicate("\n", timeout=30)
    assert cache.stats["fallbacks"] == 0


def test_a_folder_that_cannot_be_used_means_direct_reads_and_one_warning(s3, tmp_path, monkeypatch):
    _, fs, _ = s3
    fs.pipe(f"{BUCKET}/d/a.jsonl", LINES)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("ZEPHON_SHARD_CACHE", str(blocker))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ix = index_dataset("web", f"s3://{BUCKET}/d/*.jsonl", format="jsonl", cache_dir=str(tmp_path / "ix"))
        assert ix.read(0, [3, 250]) == ["document 3 in the cache", "document 250 in the cache"]
    msgs = [str(w.message) for w in seen if "shard cache" in str(w.message)]
    assert len(msgs) == 1 and str(blocker) in msgs[0] and "directly" in msgs[0], msgs


def test_a_cap_smaller_than_a_shard_means_direct_reads(s3, tmp_path, monkeypatch):
    _, fs, _ = s3
    fs.pipe(f"{BUCKET}/d/a.jsonl", LINES)
    monkeypatch.setenv("ZEPHON_SHARD_CACHE_GB", "0.000001")  # 1 kB
    ix = index_dataset("web", f"s3://{BUCKET}/d/*.jsonl", format="jsonl", cache_dir=str(tmp_path / "ix"))
    assert ix.read(0, [299]) == ["document 299 in the cache"]
    assert node_cache().stats["downloads"] == 0 and entries(tmp_path) == []


def test_download_ahead_fetches_the_next_shards_without_changing_batches(s3, corpus, local_hashes, tmp_path):
    _, fs, _ = s3
    path, keys = remote_recipe(corpus, fs)
    r = Recipe.from_toml(path).replace(cache_dir=str(tmp_path / "index"))
    # index on the server with no cache (the index does not read shards into it), then run with one
    os.environ["ZEPHON_SHARD_CACHE"] = ""
    with RankBatches(r, 1, None, workers=WorkerConfig(0)):
        pass
    os.environ["ZEPHON_SHARD_CACHE"] = str(tmp_path / "node-cache")
    cache = node_cache()
    got = run_hashes(r, world_size=2, steps=6, workers=WorkerConfig(0), out=io.StringIO())
    assert got == local_hashes
    cache.drain()
    assert cache.stats["ahead"] > 0, cache.stats
    assert len(entries(tmp_path)) == cache.stats["downloads"] <= len(keys)


def test_the_cache_in_isolation_keys_by_version_and_writes_atomically(tmp_path):
    c = NodeCache(str(tmp_path / "c"), 10**6, ahead=0)

    def fetch(sink):
        sink.write(b"x" * 10)
        raise DataError("the storage failed midway", file="s3://b/k")

    with pytest.raises(DataError), c.hold(entry_key("s3://b/k", "ETag:1", 10), 10, fetch):
        pass
    assert os.listdir(tmp_path / "c" / "objects") == []  # no partial entry, no temporary file
    with c.hold(entry_key("s3://b/k", "ETag:1", 3), 3, lambda sink: sink.write(b"abc")) as p:
        assert open(p, "rb").read() == b"abc"
    with c.hold(entry_key("s3://b/k", "ETag:1", 3), 3, lambda sink: pytest.fail("downloaded twice")) as p:
        assert open(p, "rb").read() == b"abc"
    assert c.stats["downloads"] == 1 and c.stats["hits"] == 2


def test_a_corrupt_cache_entry_is_dropped_and_fetched_again_with_one_warning(s3, tmp_path):
    _, fs, _ = s3
    url = f"s3://{BUCKET}/d/*.jsonl"
    fs.pipe(f"{BUCKET}/d/a.jsonl", LINES)
    ix = index_dataset("web", url, format="jsonl", cache_dir=str(tmp_path / "ix"))
    assert ix.read(0, [9]) == ["document 9 in the cache"]
    (name,) = entries(tmp_path)
    entry = tmp_path / "node-cache" / "objects" / name
    entry.write_bytes(entry.read_bytes().replace(b"document 9 ", b"dOcUmEnT 9 "))  # a flipped disk block
    node_cache().close()  # as a new process: no copy open
    with pytest.warns(RuntimeWarning, match=r"the copy of s3://.*a\.jsonl was corrupt.*dropped and fetched again"):
        assert ix.read(0, [9, 8]) == ["document 9 in the cache", "document 8 in the cache"]
    assert node_cache().stats["corrupt"] == 1 and entries(tmp_path) == [name]
    assert entry.read_bytes() == LINES  # the copy is the object's again
