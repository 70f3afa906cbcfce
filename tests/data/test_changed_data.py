"""Changed data is always detected (issue 21 class 2): size and modification time are not
identity, so every read unit's CRC-32 is kept in the index and checked on every read. A remote
file replaced during a run, a file changed on a server without ETag/Last-Modified, a stale index
cache of the same size, a local shard rewritten with its size and mtime kept: each is refused
naming the file, never read with old offsets."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
from storage_server import FaultyServer

from zephon.data import DataError, index_dataset


def lines(tag: str, n: int = 200) -> bytes:
    # the same byte lengths for every tag: a rewrite keeps the file's size
    return ("\n".join(json.dumps({"text": f"{tag}{i:05d} " + "y" * (i % 13)}) for i in range(n)) + "\n").encode()


def rewrite_keeping_size_and_mtime(path: str, data: bytes) -> None:
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("ZEPHON_IO_RETRY_S", "2")
    monkeypatch.setenv("ZEPHON_IO_TIMEOUT_S", "2")
    with FaultyServer() as srv:
        srv.files["/d/a.jsonl"] = lines("old")
        yield srv


def test_a_remote_file_replaced_during_a_run_is_refused(server, tmp_path):
    ix = index_dataset("web", server.url("/d/a.jsonl"), format="jsonl", cache_dir=str(tmp_path))
    assert ix.read(0, [3]) == ["old00003 yyy"]
    server.files["/d/a.jsonl"] = lines("new")
    with pytest.raises(DataError, match="not the ones indexed") as e:
        ix.read(0, [3, 4])
    assert server.url("/d/a.jsonl") in str(e.value) and "line 4" in str(e.value)


def test_a_change_on_a_server_without_versions_changes_the_fingerprint(server, tmp_path):
    server.versions = False  # no ETag, no Last-Modified: size is all the server tells
    cache = str(tmp_path / "cache")
    before = index_dataset("web", server.url("/d/a.jsonl"), format="jsonl", cache_dir=cache)
    server.files["/d/a.jsonl"] = lines("new")
    after = index_dataset("web", server.url("/d/a.jsonl"), format="jsonl", cache_dir=cache)
    # a checkpoint saved on the old content is refused on the new (the fingerprint differs), and
    # the new index reads the new content (the cache entry was not trusted)
    assert after.fingerprint != before.fingerprint
    assert after.read(0, [3]) == ["new00003 yyy"]
    with pytest.raises(DataError, match="not the ones indexed"):
        before.read(0, [3])


def test_a_stale_index_cache_of_the_same_size_and_mtime_is_refused(tmp_path):
    path = str(tmp_path / "a.jsonl")
    with open(path, "wb") as f:
        f.write(lines("old"))
    cache = str(tmp_path / "cache")
    index_dataset("web", path, cache_dir=cache)
    # the same size, the same mtime, other records at other offsets
    data = b"\n" + lines("new")[:-1]
    rewrite_keeping_size_and_mtime(path, data)
    ix = index_dataset("web", path, cache_dir=cache)  # the cache entry looks fresh
    with pytest.raises(DataError, match="not the ones indexed") as e:
        ix.read(0, list(range(ix.shards[0].num_records)))
    assert path in str(e.value) and cache in str(e.value)  # names the file and the cache entry to delete
    for f in glob.glob(os.path.join(cache, "*.npz")):
        os.remove(f)
    again = index_dataset("web", path, cache_dir=cache)
    assert again.read(0, [0]) == ["new00000 "]


@pytest.mark.parametrize("kind", ["jsonl", "text-file", "jsonl.gz"])
def test_a_local_shard_rewritten_with_size_and_mtime_kept_is_refused(tmp_path, kind):
    import gzip

    name = {"jsonl": "a.jsonl", "text-file": "a.txt", "jsonl.gz": "a.jsonl.gz"}[kind]
    path = str(tmp_path / name)
    old, new = lines("old"), lines("new")
    if kind == "jsonl.gz":  # stored (level 0): a rewrite of the same size
        old, new = gzip.compress(old, 0, mtime=0), gzip.compress(new, 0, mtime=0)
    with open(path, "wb") as f:
        f.write(old)
    kw = {"format": "text", "text_mode": "file"} if kind == "text-file" else {}
    ix = index_dataset("web", path, cache_dir=str(tmp_path / "cache"), **kw)
    rewrite_keeping_size_and_mtime(path, new)
    ix.close()  # drop the decompressed copy in memory: read the file again
    with pytest.raises(DataError, match="not the ones indexed") as e:
        ix.read(0, [0])
    assert path in str(e.value)


def test_a_parquet_row_group_rewritten_with_size_and_mtime_kept_is_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "a.parquet")

    def write(tag: str) -> None:
        texts = [f"{tag}{i:05d}" for i in range(100)]
        pq.write_table(pa.table({"text": texts}), path, compression="none", row_group_size=50, write_statistics=False)

    write("old")
    ix = index_dataset("web", path, cache_dir=str(tmp_path / "cache"))
    st = os.stat(path)
    write("new")
    assert os.stat(path).st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DataError, match="not the one indexed") as e:
        ix.read(0, [60])
    assert path in str(e.value) and "row group 1" in str(e.value)


def test_reads_of_unchanged_files_are_checked_and_pass(tmp_path):
    path = str(tmp_path / "a.jsonl")
    with open(path, "wb") as f:
        f.write(lines("old", 1000))
    ix = index_dataset("web", path, cache_dir=str(tmp_path / "cache"))
    crcs = ix._shard(0)["crcs"]
    assert crcs.dtype == np.uint32 and len(crcs) == 1000
    got = ix.read(0, list(range(999, -1, -7)))
    assert got == [f"old{i:05d} " + "y" * (i % 13) for i in range(999, -1, -7)]


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b""])
def test_long_lines_are_checked_whole(tmp_path, ending):
    # lines longer than the scanner's carry limit (1 MiB) are followed by metadata only: their
    # CRC-32 is chained over the chunks, the final \r left out
    long_text = "z" * (3 << 20) + "é"
    data = b"\r\n".join(json.dumps({"text": t}).encode() for t in ("a", long_text, "b", long_text)) + ending
    path = str(tmp_path / "long.jsonl")
    with open(path, "wb") as f:
        f.write(data)
    ix = index_dataset("web", path, cache_dir=str(tmp_path / "cache"))
    assert ix.read(0, [3, 1, 0, 2]) == [long_text, long_text, "a", "b"]
