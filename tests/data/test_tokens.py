"""Pretokenized readers: numpy .npy / raw .bin with offsets, Megatron .bin/.idx; memory-mapped."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from zephon.data import DataError, TokenIndex, index_dataset, index_tokens, write_mds, write_megatron, write_tokens

DOCS = [np.array([5, 6, 7]), np.array([], dtype=np.int64), np.array([9] * 10), np.array([1])]


@pytest.mark.parametrize(
    "name,dtype", [("a.npy", "uint16"), ("a.bin", "uint16"), ("a.bin", "int32"), ("a.npy", "int64")]
)
def test_numpy_token_files_read_back_their_documents(tmp_path, name, dtype):
    write_tokens(str(tmp_path / name), DOCS, dtype=dtype)
    kw = {"dtype": dtype} if name.endswith(".bin") else {}  # a raw .bin does not say its width
    ix = index_dataset("t", str(tmp_path / "*"), format="tokens", **kw)  # the offsets file is not a shard
    assert isinstance(ix, TokenIndex) and ix.num_records == 4 and len(ix.shards) == 1
    got = ix.read(0, [3, 0, 2, 1])
    assert [g.tolist() for g in got] == [DOCS[i].tolist() for i in (3, 0, 2, 1)]
    assert all(g.dtype == np.dtype(dtype) for g in got)
    assert isinstance(got[0].base, np.memmap), "reads are views of the memory-mapped file"
    assert ix.record_bytes(0).tolist() == [12, 0, 40, 4]
    base = 128 if name.endswith(".npy") else 0  # the .npy header
    at = base + 3 * np.dtype(dtype).itemsize
    assert ix.locate(0, 2) == {"file": str(tmp_path / name), "locator": "document 2", "byte_offset": at, "tokens": 10}
    again = pickle.loads(pickle.dumps(ix))  # process workers get a handle; maps reopen lazily
    assert again.read(0, [2])[0].tolist() == DOCS[2].tolist()


def test_megatron_indexed_dataset(tmp_path):
    """Our writer follows Megatron-LM's _IndexWriter byte for byte (header, version, dtype code,
    counts, int32 lengths, int64 byte pointers, int64 document indices); documents of several
    sequences (--split-sentences) read as their sequences back to back."""
    docs = [[[1, 2], [3]], np.array([4, 5, 6]), [[7], [8], [9, 10]]]
    write_megatron(str(tmp_path / "c"), docs, dtype="uint16")
    raw = (tmp_path / "c.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 6, 4)
    lengths = np.frombuffer(raw, "<i4", 6, 34)
    pointers = np.frombuffer(raw, "<i8", 6, 34 + 24)
    doc_idx = np.frombuffer(raw, "<i8", 4, 34 + 72)
    assert lengths.tolist() == [2, 1, 3, 1, 1, 2] and pointers.tolist() == [0, 4, 6, 12, 14, 16]
    assert doc_idx.tolist() == [0, 2, 3, 6] and len(raw) == 34 + 72 + 32
    ix = index_tokens("m", str(tmp_path / "*.bin"), "megatron")
    assert [d.tolist() for d in ix.read(0, [0, 1, 2])] == [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10]]


def test_bad_files_are_named(tmp_path):
    write_tokens(str(tmp_path / "a.npy"), DOCS)
    (tmp_path / "a.offsets.npy").unlink()
    with pytest.raises(DataError, match=r"a\.offsets\.npy.*offsets file is missing"):
        index_tokens("t", str(tmp_path / "a.npy"), "tokens")
    np.save(tmp_path / "a.offsets.npy", np.array([0, 3, 2, 14]))
    with pytest.raises(DataError, match="never decrease"):
        index_tokens("t", str(tmp_path / "a.npy"), "tokens")
    np.save(tmp_path / "a.offsets.npy", np.array([0, 3, 13]))
    with pytest.raises(DataError, match="the last offset is 13 but the token file holds 14 ids"):
        index_tokens("t", str(tmp_path / "a.npy"), "tokens")
    (tmp_path / "b.bin").write_bytes(b"\0" * 7)
    np.save(tmp_path / "b.offsets.npy", np.array([0, 2]))
    with pytest.raises(DataError, match="7 bytes do not hold the 2 ids"):
        index_tokens("t", str(tmp_path / "b.bin"), "tokens", dtype="uint16")
    write_megatron(str(tmp_path / "m"), [np.array([1, 2])])
    data = bytearray((tmp_path / "m.idx").read_bytes())
    data[0:1] = b"X"
    (tmp_path / "m.idx").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"m\.idx.*not a Megatron index"):
        index_tokens("m", str(tmp_path / "m.bin"), "megatron")
    (tmp_path / "m.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 5, 2))
    with pytest.raises(DataError, match="cut short"):
        index_tokens("m", str(tmp_path / "m.bin"), "megatron")


def test_record_size_limit_is_a_bad_record(tmp_path):
    write_tokens(str(tmp_path / "a.npy"), DOCS)
    ix = index_tokens("t", str(tmp_path / "a.npy"), "tokens", max_record_bytes=16)
    got = ix.read(0, [0, 2])
    assert got[0].tolist() == [5, 6, 7] and "exceed max_record_bytes" in got[1].reason


@pytest.mark.parametrize("encoding", ["ndarray:uint32", "ndarray", "ndarray:int64"])
def test_mds_token_column(tmp_path, encoding):
    """MDS shards as Streaming's MDSWriter lays them out (uint32 count, uint32 offsets, config
    JSON, samples of [variable-column sizes][columns sorted by name]); the ids are read from the
    memory-mapped shard, whatever the column's NDArray encoding."""
    docs = [np.arange(1, 300), np.array([7]), np.array([3, 4])]
    dtype = "int64" if encoding.endswith("int64") else "uint32"
    write_mds(str(tmp_path / "m"), docs, dtype=dtype, encoding=encoding)
    shard = (tmp_path / "m" / "shard.00000.mds").read_bytes()
    n = struct.unpack("<I", shard[:4])[0]
    offsets = np.frombuffer(shard, "<u4", n + 1, 4)
    assert n == 3 and offsets[-1] == len(shard)
    ix = index_dataset("m", str(tmp_path / "m"), format="mds")
    assert [d.tolist() for d in ix.read(0, [0, 1, 2])] == [d.tolist() for d in docs]
    assert ix.dtypes == [np.dtype(dtype)]
    ix = index_tokens("m", str(tmp_path / "*"), "mds", column="tokens")
    assert ix.num_records == 3


def test_mds_refusals(tmp_path):
    write_mds(str(tmp_path / "m"), [np.array([1, 2])], encoding="ndarray:uint16", dtype="uint16")
    with pytest.raises(DataError, match=r"no token column 'ids'; the columns are \['id', 'tokens'\]"):
        index_tokens("m", str(tmp_path / "m"), "mds", column="ids")
    idx = tmp_path / "m" / "index.json"
    idx.write_text(idx.read_text().replace('"compression": null', '"compression": "zstd"'))
    with pytest.raises(DataError, match="compressed"):
        index_tokens("m", str(tmp_path / "m"), "mds")
    with pytest.raises(DataError, match="no index.json"):
        index_tokens("m", str(tmp_path), "mds")
