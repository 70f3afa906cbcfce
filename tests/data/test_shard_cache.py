"""The node-local shard cache (issue 26, item 2) against moto's standalone S3 server: batches are
byte-identical to local files with and without the cache (W = 1 and 2, thread and process
workers); two jobs (two processes) on one cold cache download each object once (the server's
request log); a server killed after the cache is warm does not stop the run; a changed object
is re-fetched under its new version or refused, never read stale; eviction under a small cap
spares an entry another process holds; a folder that cannot be used means direct reads and one
warning; download-ahead fetches the shards the lanes need next without changing batches. The same
for image-text shards (tar and Parquet) and pretokenized files (memory-mapped from the copy)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from storage_server import MotoServer
from text_fixtures import write_corpus, write_recipe
from vl_fixtures import vl_config, write_vl_root

pytest.importorskip("moto", reason="moto[server] is not installed (pip install -e '.[dev]')")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")

from zephon import Recipe, WorkerConfig, batch_sha256  # noqa: E402
from zephon.data import (  # noqa: E402
    BUNDLED_TOKENIZER,
    DataError,
    NodeCache,
    index_dataset,
    index_multimodal,
    index_tokens,
    node_cache,
    write_megatron,
    write_tokens,
)
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


def jobs(path, tmp_path, steps, n=2) -> list[dict]:
    """``n`` jobs of recipe ``path`` at once, each its own process (W = 2): their hashes and cache counters."""
    env = dict(os.environ, PYTHONPATH=SUPPORT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(SUPPORT, "cache_job.py"), path, str(tmp_path / f"ix{j}"), "2", str(steps)]
            + ["0", "-"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for j in range(n)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def two_jobs_download_each_object_once(server, log, path, keys, tmp_path, want, steps) -> None:
    """Two jobs of recipe ``path`` at once on a cold cache give ``want`` and download each object once."""
    outs = jobs(path, tmp_path, steps)
    assert [o["hashes"] for o in outs] == [want, want]
    assert sum(o["stats"]["downloads"] for o in outs) == len(keys), [o["stats"] for o in outs]
    assert [server.gets(log, k) for k in keys] == [1] * len(keys)
    assert len(entries(tmp_path)) == len(keys)


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
    two_jobs_download_each_object_once(server, log, path, keys, tmp_path, local_hashes, steps=6)


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


# -- image-text shards and pretokenized files (issue 31) -------------------------------------------


def put_tree(fs, root, subs, prefix) -> list[str]:
    """Upload the files of ``root/sub`` for each of ``subs`` under ``BUCKET/prefix/``: their keys."""
    keys = []
    for sub in subs:
        for name in sorted(os.listdir(os.path.join(root, sub))):
            fs.put(os.path.join(root, sub, name), f"{BUCKET}/{prefix}/{sub}/{name}")
            keys.append(f"/{BUCKET}/{prefix}/{sub}/{name}")
    return keys


@pytest.fixture(scope="module")
def vl_corpus(tmp_path_factory):
    """A small image-text corpus (tar, Parquet, interleaved Parquet) and the hashes of its local files."""
    root = write_vl_root(tmp_path_factory.mktemp("vl"), seed=0, n_wds=32, n_parquet=32, n_interleaved=16)
    cfg = vl_config(root, cache_dir=str(tmp_path_factory.mktemp("vl-index")))
    want = run_hashes(Recipe.from_dict(cfg, root), world_size=1, steps=4, workers=WorkerConfig(0), out=io.StringIO())
    return root, want


def vl_remote(vl_corpus, fs, tmp_path) -> tuple[str, list[str]]:
    """The image-text shards put on the server and a recipe (JSON) reading them over s3://."""
    root, _ = vl_corpus
    keys = put_tree(fs, root, ("wds", "pairs", "interleaved"), "vl")
    cfg = vl_config(root, tokenizer={"path": os.path.join(root, "tok")})
    for d in cfg["datasets"]:
        d["path"] = (
            f"s3://{BUCKET}/vl/{d['path']}" if d.get("kind", "text") != "text" else os.path.join(root, d["path"])
        )
    path = str(tmp_path / "vl-s3.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path, keys


@pytest.mark.slow  # ~20 s: two jobs in their own processes, then process workers
def test_image_text_shards_through_the_cache_are_those_of_local_files(s3, vl_corpus, tmp_path):
    server, fs, log = s3
    path, keys = vl_remote(vl_corpus, fs, tmp_path)
    two_jobs_download_each_object_once(server, log, path, keys, tmp_path, vl_corpus[1], steps=4)  # tar, Parquet
    with open(path) as f:
        cfg = json.load(f)
    warm = Recipe.from_dict(cfg, vl_corpus[0]).replace(cache_dir=str(tmp_path / "ix0"))
    got = run_hashes(warm, world_size=2, steps=4, workers=WorkerConfig(2, "process"), out=io.StringIO())
    assert got == vl_corpus[1]
    assert [server.gets(log, k) for k in keys] == [1] * len(keys)  # process workers read the copies too


def test_a_corrupt_image_text_copy_is_dropped_and_fetched_again(s3, vl_corpus, tmp_path):
    _, fs, _ = s3
    root, _ = vl_corpus
    put_tree(fs, root, ("wds", "pairs"), "vl")
    for sub in ("wds", "pairs"):  # a flipped disk block in an image (tar), in a page (Parquet)
        ix = index_multimodal(sub, f"s3://{BUCKET}/vl/{sub}/*", cache_dir=str(tmp_path / "ix"))
        local = index_multimodal(sub, os.path.join(root, sub, "*"), cache_dir=str(tmp_path / "ix"))
        want = [r.segments for r in local.read(0, [0, 1, 2])]
        assert [r.segments for r in ix.read(0, [0, 1, 2])] == want
        entry = (
            tmp_path / "node-cache" / "objects" / entry_key(ix._specs[0].url, ix._specs[0].version, ix._specs[0].size)
        )
        data = bytearray(entry.read_bytes())
        img = want[0][0]
        at = bytes(data).find(img) if sub == "wds" else len(data) // 3
        data[at + 100 : at + 110] = b"\xff" * 10 if data[at + 100 : at + 110] != b"\xff" * 10 else b"\0" * 10
        entry.write_bytes(bytes(data))
        node_cache().close()  # as a new process: no copy open
        ix.close()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert [r.segments for r in ix.read(0, [0, 1, 2])] == want
        msgs = [str(w.message) for w in seen if "was corrupt" in str(w.message)]
        assert len(msgs) == (sub == "wds"), msgs  # one warning per process
        assert node_cache().stats["corrupt"] == 1 + (sub == "pairs")
        assert entry.read_bytes() == open(os.path.join(root, sub, os.path.basename(ix._specs[0].fspath)), "rb").read()


@pytest.fixture(scope="module")
def tok_corpus(tmp_path_factory):
    """Pretokenized files (.npy and raw .bin with offsets, Megatron .bin/.idx), a recipe over them
    with a local text dataset, and the hashes of the local files."""
    root = tmp_path_factory.mktemp("pretok")
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 4000, int(n)) for n in rng.integers(5, 300, 90)]
    os.makedirs(root / "tok")
    write_tokens(str(root / "tok" / "a.npy"), docs[:30], dtype="uint16")
    write_tokens(str(root / "tok" / "b.bin"), docs[30:50], dtype="int32")
    for part in range(2):
        write_megatron(str(root / "tok" / f"m{part}"), docs[50 + 20 * part : 70 + 20 * part])
    with open(root / "web.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"plain text document {i} " * 20}) + "\n" for i in range(40))
    datasets = [
        {"name": "npy", "path": ["tok/*.npy", "tok/b*.bin"], "format": "tokens", "dtype": "int32", "weight": 0.4},
        {"name": "mega", "path": "tok/m*.bin", "format": "megatron", "weight": 0.4},
        {"name": "web", "path": "web.jsonl", "weight": 0.2},
    ]
    cfg = dict(seed=7, lanes=4, seq_len=64, global_batch_size=8, shuffle={"buffer": 4}, datasets=datasets)
    cfg["tokenizer"] = {"path": BUNDLED_TOKENIZER}
    local = Recipe.from_dict(dict(cfg, cache_dir=str(root / "ix")), str(root))
    want = run_hashes(local, world_size=1, steps=6, workers=WorkerConfig(0), out=io.StringIO())
    return root, cfg, want


def tok_remote(tok_corpus, fs, tmp_path) -> tuple[str, list[str]]:
    root, cfg, _ = tok_corpus
    keys = put_tree(fs, str(root), ("tok",), "pre")
    cfg = json.loads(json.dumps(cfg))
    cfg["datasets"][0]["path"] = [f"s3://{BUCKET}/pre/tok/*.npy", f"s3://{BUCKET}/pre/tok/b*.bin"]
    cfg["datasets"][1]["path"] = f"s3://{BUCKET}/pre/tok/m*.bin"
    cfg["datasets"][2]["path"] = str(root / "web.jsonl")
    path = str(tmp_path / "pre-s3.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path, keys


def test_remote_pretokenized_files_without_a_cache_are_refused_naming_the_fix(s3, tok_corpus, tmp_path, monkeypatch):
    _, fs, _ = s3
    tok_remote(tok_corpus, fs, tmp_path)
    monkeypatch.setenv("ZEPHON_SHARD_CACHE", "")
    with pytest.raises(DataError) as e:
        index_tokens("mega", f"s3://{BUCKET}/pre/tok/m*.bin", "megatron")
    msg = str(e.value)
    assert "ZEPHON_SHARD_CACHE" in msg and "copy the files to a local disk" in msg and "s3://" in msg, msg
    monkeypatch.setenv("ZEPHON_SHARD_CACHE", str(tmp_path / "node-cache"))
    with pytest.raises(DataError, match="MDS datasets are read from local folders only"):  # not served yet
        index_tokens("mds", f"s3://{BUCKET}/pre/mds", "mds")


def test_pretokenized_files_through_the_cache_are_those_of_local_files(s3, tok_corpus, tmp_path):
    server, fs, log = s3
    path, keys = tok_remote(tok_corpus, fs, tmp_path)
    # the token files and their offsets / index files, each downloaded once
    two_jobs_download_each_object_once(server, log, path, keys, tmp_path, tok_corpus[2], steps=6)
    with open(path) as f:
        r = Recipe.from_dict(json.load(f), str(tmp_path)).replace(cache_dir=str(tmp_path / "ix0"))
    got = run_hashes(r, world_size=2, steps=6, workers=WorkerConfig(2, "process"), out=io.StringIO())
    assert got == tok_corpus[2]
    assert [server.gets(log, k) for k in keys] == [1] * len(keys)


def test_a_changed_token_file_is_a_new_cache_entry(s3, tmp_path):
    _, fs, _ = s3
    local = tmp_path / "t"
    os.makedirs(local)
    write_megatron(str(local / "m"), [np.arange(10), np.arange(5)], dtype="int32")
    put_tree(fs, str(tmp_path), ("t",), "chg")
    old = index_tokens("mega", f"s3://{BUCKET}/chg/t/m.bin", "megatron")
    assert old.read(0, [1])[0].tolist() == [0, 1, 2, 3, 4]
    write_megatron(str(local / "m"), [np.arange(10) + 7, np.arange(5) + 9], dtype="int32")  # same sizes
    fs.put(str(local / "m.bin"), f"{BUCKET}/chg/t/m.bin")
    s3fs.S3FileSystem.clear_instance_cache()
    new = index_tokens("mega", f"s3://{BUCKET}/chg/t/m.bin", "megatron")
    assert new.shards[0].version != old.shards[0].version
    assert new.read(0, [1])[0].tolist() == [9, 10, 11, 12, 13]
    assert old.read(0, [1])[0].tolist() == [0, 1, 2, 3, 4]  # the old job keeps the bytes it indexed
    assert len(entries(tmp_path)) == 3  # the .idx once, the .bin of each version


def test_download_ahead_fetches_image_text_and_pretokenized_files(s3, tok_corpus, vl_corpus, tmp_path):
    server, fs, log = s3
    put_tree(fs, str(tok_corpus[0]), ("tok",), "pre")
    put_tree(fs, vl_corpus[0], ("wds",), "vl")
    os.environ["ZEPHON_SHARD_CACHE"] = ""  # index the tar shards without a cache (it reads them whole)
    wds = index_multimodal("wds", f"s3://{BUCKET}/vl/wds/*.tar", cache_dir=str(tmp_path / "ix"))
    os.environ["ZEPHON_SHARD_CACHE"] = str(tmp_path / "node-cache")
    mega = index_tokens("mega", f"s3://{BUCKET}/pre/tok/m*.bin", "megatron")  # reads the .idx files only
    cache = node_cache()
    assert cache.stats["downloads"] == 2 and cache.stats["ahead"] == 0
    assert mega.prefetch([1, 0, 1]) == 2 and wds.prefetch(range(len(wds.shards))) == len(wds.shards)
    cache.drain()
    assert cache.stats["ahead"] == 2 + len(wds.shards) and cache.stats["downloads"] == 4 + len(wds.shards)
    local = index_tokens("mega", str(tok_corpus[0] / "tok" / "m*.bin"), "megatron")
    assert [d.tolist() for d in mega.read(1, [0, 3])] == [d.tolist() for d in local.read(1, [0, 3])]
    assert wds.read(0, [0])[0].segments[1]
    gets = [server.gets(log, f"/{BUCKET}/pre/tok/m{i}.bin") for i in range(2)]
    assert gets == [1, 1] and cache.stats["downloads"] == 4 + len(wds.shards)  # the reads found the copies
