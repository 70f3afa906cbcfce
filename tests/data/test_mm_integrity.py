"""Image-text reads are verified and retried like text reads (issue 21): a tar or Parquet shard
rewritten with its size and modification time kept is refused naming the file and the sample,
and remote tar reads retry transient faults (a real HTTP server on 127.0.0.1) within the retry
budget, then fail naming the URL."""

from __future__ import annotations

import io
import os
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from storage_server import FaultyServer

from zephon.data import DataError
from zephon.data.datasets.multimodal import index_multimodal


def png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (24, 16), (i * 30 % 256, 80, 160)).save(buf, "PNG")
    return buf.getvalue()


def tar_bytes(captions: list[str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for i, cap in enumerate(captions):
            for name, data in ((f"k{i}.png", png(i)), (f"k{i}.txt", cap.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def rewrite_keeping_size_and_mtime(path: str, data: bytes) -> None:
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


CAPTIONS = [f"caption number {i}" for i in range(6)]


def test_a_tar_rewritten_with_size_and_mtime_kept_is_refused_naming_the_sample(tmp_path):
    p = tmp_path / "a.tar"
    p.write_bytes(tar_bytes(CAPTIONS))
    ix = index_multimodal("pairs", str(p), format="wds", cache_dir=str(tmp_path / "cache"))
    assert [r.segments[1] for r in ix.read(0, range(6))] == CAPTIONS
    forged = CAPTIONS.copy()
    forged[3] = "caption NUMBER 3"  # same length: the tar keeps its size and layout
    rewrite_keeping_size_and_mtime(str(p), tar_bytes(forged))
    # a fresh index over the same cache (a restarted job): the stale cache is caught on read
    again = index_multimodal("pairs", str(p), format="wds", cache_dir=str(tmp_path / "cache"))
    for got in (ix, again):
        assert [r.segments[1] for r in got.read(0, [0, 1, 2])] == CAPTIONS[:3]
        with pytest.raises(DataError) as e:
            got.read(0, [3])
        assert str(p) in str(e.value) and "key 'k3'" in str(e.value) and "changed" in str(e.value)


def parquet_bytes(images: list[bytes], captions: list[str]) -> bytes:
    buf = io.BytesIO()
    table = pa.table({"image": pa.array(images, pa.binary()), "caption": captions})
    pq.write_table(table, buf, compression="none", row_group_size=3, use_dictionary=False, write_statistics=False)
    return buf.getvalue()


def test_an_image_text_parquet_rewritten_in_place_is_refused_naming_the_row_group(tmp_path):
    images = [png(i) for i in range(6)]
    p = tmp_path / "a.parquet"
    p.write_bytes(parquet_bytes(images, CAPTIONS))
    ix = index_multimodal("pairs", str(p), cache_dir=str(tmp_path / "cache"))
    assert ix.read(0, [4])[0].segments[0] == images[4]
    forged = images.copy()
    b = bytearray(forged[4])
    b[-20] ^= 0xFF  # one image byte: same size, another picture
    forged[4] = bytes(b)
    rewrite_keeping_size_and_mtime(str(p), parquet_bytes(forged, CAPTIONS))
    again = index_multimodal("pairs", str(p), cache_dir=str(tmp_path / "cache"))
    assert again.read(0, [0])[0].segments[0] == images[0]  # row group 0 is unchanged
    with pytest.raises(DataError) as e:
        again.read(0, [4])
    assert str(p) in str(e.value) and "row group 1" in str(e.value) and "changed" in str(e.value)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("ZEPHON_IO_RETRY_S", "3")
    monkeypatch.setenv("ZEPHON_IO_TIMEOUT_S", "0.5")
    with FaultyServer() as srv:
        srv.files["/d/a.tar"] = tar_bytes(CAPTIONS)
        yield srv


def test_remote_tar_reads_retry_transient_faults(server, tmp_path):
    ix = index_multimodal("pairs", server.url("/d/a.tar"), format="wds", cache_dir=str(tmp_path / "c"))
    server.fail_next = 3  # the next three requests answer 500
    assert [r.segments[1] for r in ix.read(0, range(6))] == CAPTIONS
    server.drop_next = 2  # two answers cut off half-way
    assert [r.segments[1] for r in ix.read(0, [5, 0])] == [CAPTIONS[5], CAPTIONS[0]]


def test_a_remote_tar_that_keeps_failing_is_a_data_error_naming_the_url(server, tmp_path):
    ix = index_multimodal("pairs", server.url("/d/a.tar"), format="wds", cache_dir=str(tmp_path / "c"))
    server.fail_always = True
    with pytest.raises(DataError) as e:
        ix.read(0, [2])
    assert server.url("/d/a.tar") in str(e.value) and "500" in str(e.value) and "ZEPHON_IO_RETRY_S" in str(e.value)


def test_a_remote_tar_replaced_after_indexing_is_refused(server, tmp_path):
    ix = index_multimodal("pairs", server.url("/d/a.tar"), format="wds", cache_dir=str(tmp_path / "c"))
    forged = CAPTIONS.copy()
    forged[1] = "caption NUMBER 1"
    server.versions = False  # a server without ETag / Last-Modified
    server.files["/d/a.tar"] = tar_bytes(forged)
    assert ix.read(0, [0])[0].segments[1] == CAPTIONS[0]
    with pytest.raises(DataError) as e:
        ix.read(0, [1])
    assert server.url("/d/a.tar") in str(e.value) and "key 'k1'" in str(e.value)
