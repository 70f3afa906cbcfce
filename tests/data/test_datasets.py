"""Tests for zephon.datasets: indexing, metadata cache, random-access reads, errors."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.data.datasets import BadRecord, DataError, DatasetIndex, ShardMeta, index_dataset
from zephon.data.datasets._scan import LineScanner, line_number
from zephon.nodes import skip_hint

SKIP_TAIL = "To skip bad records instead, set on_error = \"skip\" for dataset '{}' in the recipe."


# ---------------------------------------------------------------------------------------------
# helpers


def make_docs(n: int, seed: int = 0, tag: str = "") -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "γάμμα", "δέλτα", "emoji 🎉", 'quote"s', "back\\slash", "tab\tbed", "日本語"]
    return [
        f"{tag}doc {i}: "
        + " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        + ("\nsecond line" if i % 7 == 0 else "")
        for i in range(n)
    ]


def jsonl_bytes(docs: list[str], blank_every: int = 0, crlf: bool = False, extra: bool = True) -> bytes:
    nl = "\r\n" if crlf else "\n"
    out = []
    for i, d in enumerate(docs):
        if blank_every and i % blank_every == 0:
            out.append("")  # blank line (skipped)
            out.append("   \t")  # whitespace-only line (skipped)
        obj = {"id": i, "text": d, "meta": {"src": "test"}} if extra else {"text": d}
        out.append(json.dumps(obj, ensure_ascii=(i % 2 == 0)))
    return (nl.join(out) + nl).encode("utf-8")


def write(path, data: bytes, compression: str | None = None) -> str:
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def write_parquet(path, docs, row_group_size=7, column="text") -> str:
    pq.write_table(pa.table({"id": list(range(len(docs))), column: docs}), str(path), row_group_size=row_group_size)
    return str(path)


def write_save_to_disk(folder, shards: list[list[str]], large: bool = False) -> str:
    """Mimic `datasets.Dataset.save_to_disk`: Arrow IPC *stream* files + state.json + dataset_info.json."""
    folder.mkdir()
    names = []
    for k, docs in enumerate(shards):
        name = f"data-{k:05d}-of-{len(shards):05d}.arrow"
        typ = pa.large_string() if large else pa.string()
        table = pa.table({"text": pa.array(docs, type=typ), "id": list(range(len(docs)))})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table, max_chunksize=5)  # several record batches per file
        names.append(name)
    state = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "abc123",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string", "_type": "Value"}}}))
    return str(folder)


def read_all(idx: DatasetIndex) -> list:
    out = []
    for s, m in enumerate(idx.shards):
        out.extend(idx.read(s, range(m.num_records)))
    return out


def bump_mtime(path: str, seconds: float = 10.0) -> None:
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + int(seconds * 1e9)))


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


# ---------------------------------------------------------------------------------------------
# formats


@pytest.mark.parametrize(
    "compression,ext", [(None, ".jsonl"), ("gzip", ".jsonl.gz"), ("zstd", ".jsonl.zst"), ("zstd", ".json.zstd")]
)
def test_jsonl_roundtrip(tmp_path, cache, compression, ext):
    docs = make_docs(200)
    raw = jsonl_bytes(docs, blank_every=17)
    p = write(tmp_path / f"shard{ext}", raw, compression)
    idx = index_dataset("web", p, cache_dir=cache)
    assert idx.format == "jsonl"
    assert idx.num_records == 200 and idx.shards[0].num_records == 200
    assert idx.shards[0] == ShardMeta(p, 200, os.path.getsize(p), str(os.stat(p).st_mtime_ns))
    assert idx.shard_offsets().tolist() == [0, 200]
    order = list(range(200))
    random.Random(1).shuffle(order)
    assert idx.read(0, order) == [docs[i] for i in order]
    assert idx.read(0, [3, 3, 0]) == [docs[3], docs[3], docs[0]]
    assert idx.read(0, []) == []
    assert idx.read(0, np.array([199, 5])) == [docs[199], docs[5]]
    # record_bytes: byte length of each JSON line (terminator excluded)
    lines = [ln for ln in raw.split(b"\n") if ln.strip()]
    rb = idx.record_bytes(0)
    assert rb.dtype == np.int64 and rb.tolist() == [len(ln) for ln in lines]


def test_jsonl_crlf_bom_and_no_trailing_newline(tmp_path, cache):
    docs = make_docs(20)
    raw = b"\xef\xbb\xbf" + jsonl_bytes(docs, blank_every=6, crlf=True).rstrip(b"\r\n")
    p = write(tmp_path / "crlf.jsonl", raw)
    idx = index_dataset("w", p, cache_dir=cache)
    assert read_all(idx) == docs
    assert idx.record_bytes(0)[0] == len(json.dumps({"id": 0, "text": docs[0], "meta": {"src": "test"}}).encode())


def test_multiple_shards_sorted_and_globs(tmp_path, cache):
    d = tmp_path / "d"
    d.mkdir()
    all_docs = {}
    for k in (3, 0, 2, 1):
        docs = make_docs(10 + k, seed=k, tag=f"s{k} ")
        all_docs[k] = docs
        write(d / (f"part-{k}.jsonl" + (".gz" if k % 2 else "")), jsonl_bytes(docs), "gzip" if k % 2 else None)
    idx = index_dataset(
        "w", [str(d / "part-*.jsonl"), str(d / "part-*.jsonl.gz"), str(d / "part-0.jsonl")], cache_dir=cache
    )
    paths = [m.path for m in idx.shards]
    assert paths == sorted(paths) and len(paths) == 4  # deduplicated, sorted by path
    assert idx.shard_offsets().tolist() == np.cumsum([0] + [m.num_records for m in idx.shards]).tolist()
    for s, m in enumerate(idx.shards):
        k = int(m.path.split("part-")[1][0])
        assert idx.read(s, range(m.num_records)) == all_docs[k]
    # a directory works too
    idx2 = index_dataset("w", str(d), cache_dir=cache)
    assert idx2.fingerprint == idx.fingerprint and idx2.num_records == idx.num_records


def test_parquet_row_groups(tmp_path, cache):
    docs = make_docs(53)
    p = write_parquet(tmp_path / "a.parquet", docs, row_group_size=7)
    assert pq.ParquetFile(p).metadata.num_row_groups == 8
    idx = index_dataset("pq", p, cache_dir=cache)
    assert idx.format == "parquet" and idx.num_records == 53
    order = list(range(53)) * 2
    random.Random(2).shuffle(order)
    assert idx.read(0, order) == [docs[i] for i in order]
    assert idx.record_bytes(0).tolist() == [len(d.encode()) for d in docs]


def test_parquet_bad_values_and_text_field(tmp_path, cache):
    p = str(tmp_path / "b.parquet")
    pq.write_table(pa.table({"body": ["fine", None, "", "  \n", "ok"]}), p, row_group_size=2)
    idx = index_dataset("pq", p, text_field="body", cache_dir=cache)
    out = idx.read(0, range(5))
    assert out[0] == "fine" and out[4] == "ok"
    assert out[1] == BadRecord("pq", p, "row 1", "field 'body' is null")
    assert out[2] == BadRecord("pq", p, "row 2", "field 'body' is empty")
    assert out[3].reason == "field 'body' is empty (whitespace only)"
    assert idx.record_bytes(0).tolist() == [4, 0, 0, 3, 2]
    # binary column with invalid UTF-8
    p2 = str(tmp_path / "c.parquet")
    pq.write_table(pa.table({"text": pa.array([b"good", b"\xff\xfe bad"], type=pa.binary())}), p2)
    out = index_dataset("pq", p2, cache_dir=cache).read(0, [0, 1])
    assert out[0] == "good" and isinstance(out[1], BadRecord) and "invalid UTF-8" in out[1].reason
    # missing column / non-string column: file-level errors naming the fix
    with pytest.raises(DataError, match=r"column 'text' not found .*'body'.*text_field"):
        index_dataset("pq", p, cache_dir=cache)
    p3 = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), p3)
    with pytest.raises(DataError, match="expected a string column"):
        index_dataset("pq", p3, cache_dir=cache)


def test_text_line_and_file_modes(tmp_path, cache):
    lines = ["first line", "", "second ünïcode line", "   ", "third"]
    raw = "\n".join(lines).encode() + b"\n\xff broken\n"
    p = write(tmp_path / "a.txt", raw)
    idx = index_dataset("t", p, cache_dir=cache)
    assert idx.format == "text" and idx.num_records == 4
    out = idx.read(0, [3, 2, 1, 0])
    assert out[1:] == ["third", "second ünïcode line", "first line"]
    assert out[0] == BadRecord("t", p, "line 6", "invalid UTF-8 (byte 0xff at byte 0 of the line)")
    assert idx.record_bytes(0).tolist() == [10, len("second ünïcode line".encode()), 5, 8]
    # gz text
    pg = write(tmp_path / "b.txt.gz", raw, "gzip")
    assert index_dataset("t", pg, cache_dir=cache).read(0, [0, 2]) == ["first line", "third"]

    # file mode: every file is one document
    d = tmp_path / "files"
    d.mkdir()
    texts = {"a.txt": "doc A\nwith lines\n", "b.txt": "doc B", "c.txt": "", "d.txt": " \n\t"}
    for n, t in texts.items():
        (d / n).write_text(t)
    write(d / "e.txt.zst", b"doc E zstd", "zstd")
    idx = index_dataset("f", str(d / "*"), text_mode="file", cache_dir=cache)
    assert [m.num_records for m in idx.shards] == [1, 1, 0, 1, 1]  # zero-byte file: 0 records
    assert idx.read(0, [0]) == ["doc A\nwith lines\n"]
    assert idx.read(1, [0, 0]) == ["doc B", "doc B"]
    bad = idx.read(3, [0])[0]
    assert isinstance(bad, BadRecord) and bad.locator == "whole file" and "empty" in bad.reason
    assert idx.read(4, [0]) == ["doc E zstd"]
    assert idx.record_bytes(0).tolist() == [len(texts["a.txt"])]


def test_arrow_save_to_disk_folder(tmp_path, cache):
    shards = [make_docs(12, seed=1, tag="a "), make_docs(9, seed=2, tag="b "), []]
    folder = write_save_to_disk(tmp_path / "hf", shards)
    idx = index_dataset("hf", folder, cache_dir=cache)
    assert idx.format == "arrow"
    assert [m.num_records for m in idx.shards] == [12, 9, 0]
    assert idx.read(1, [8, 0, 4]) == [shards[1][8], shards[1][0], shards[1][4]]
    assert read_all(idx) == shards[0] + shards[1]
    assert idx.record_bytes(0).tolist() == [len(d.encode()) for d in shards[0]]
    # large_string column, a glob over folders, and an explicit format all work
    folder2 = write_save_to_disk(tmp_path / "hf2", [["x y", "z"]], large=True)
    assert read_all(index_dataset("hf", str(tmp_path / "hf2"), format="arrow", cache_dir=cache)) == ["x y", "z"]
    assert index_dataset("hf", str(tmp_path / "hf*"), cache_dir=cache).num_records == 23
    # a DatasetDict folder: point at a split
    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DataError, match=r"DatasetDict.*splits \['train', 'test'\].*dd/train"):
        index_dataset("hf", str(dd), cache_dir=cache)
    # a state.json folder with a non-arrow format is refused with the fix
    with pytest.raises(DataError, match='format = "arrow"'):
        index_dataset("hf", folder2, format="jsonl", cache_dir=cache)


def test_memory_fs(cache):
    root = f"memory://zephon-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    docs = [make_docs(15, seed=s, tag=f"m{s} ") for s in range(3)]
    try:
        for s in range(3):
            with fs.open(f"{root}/shard-{s}.jsonl" + (".gz" if s == 2 else ""), "wb") as f:
                f.write(jsonl_bytes(docs[s]) if s < 2 else gzip.compress(jsonl_bytes(docs[s])))
        pq.write_table(pa.table({"text": docs[0]}), f"{root}/pq/x.parquet", row_group_size=4, filesystem=fs)
        idx = index_dataset("mem", f"{root}/shard-*", cache_dir=cache)
        name = root[len("memory://") :]
        assert [m.path for m in idx.shards] == [
            f"memory:///{name}/shard-{s}.jsonl" + (".gz" if s == 2 else "") for s in range(3)
        ]
        assert read_all(idx) == docs[0] + docs[1] + docs[2]
        assert idx.read(1, [14, 2]) == [docs[1][14], docs[1][2]]
        assert all(m.version for m in idx.shards)
        pidx = index_dataset("mem", f"{root}/pq/x.parquet", cache_dir=cache)
        assert pidx.read(0, [10, 1]) == [docs[0][10], docs[0][1]]
        # rewriting a memory file changes its fingerprint
        fp = idx.fingerprint
        time.sleep(0.002)
        with fs.open(f"{root}/shard-0.jsonl", "wb") as f:
            f.write(jsonl_bytes(docs[0][:3]))
        idx2 = index_dataset("mem", f"{root}/shard-*", cache_dir=cache)
        assert idx2.fingerprint != fp and idx2.shards[0].num_records == 3
        with pytest.raises(DataError, match="matched no files"):
            index_dataset("mem", f"{root}/nothing-*.jsonl", cache_dir=cache)
    finally:
        fs.rm(root, recursive=True)


def test_zero_byte_shards(tmp_path, cache):
    p_empty = write(tmp_path / "a.jsonl", b"")
    p_full = write(tmp_path / "b.jsonl", jsonl_bytes(["x", "y"]))
    write(tmp_path / "c.jsonl", b"\n\n  \n")  # only blank lines: 0 records too
    idx = index_dataset("z", str(tmp_path / "*.jsonl"), cache_dir=cache)
    assert [m.num_records for m in idx.shards] == [0, 2, 0]
    assert idx.shard_offsets().tolist() == [0, 0, 2, 2]
    assert idx.read(0, []) == [] and idx.record_bytes(0).size == 0
    assert read_all(idx) == ["x", "y"]
    for ext in ("parquet", "jsonl.gz", "jsonl.zst", "txt"):
        write(tmp_path / f"e.{ext}", b"")
        assert index_dataset("z", str(tmp_path / f"e.{ext}"), cache_dir=cache).num_records == 0
    assert p_empty and p_full


# ---------------------------------------------------------------------------------------------
# bad records & errors


def test_bad_record_reasons(tmp_path, cache):
    rows = [
        b'{"text": "good one"}',
        b"{not json",
        b"[1, 2, 3]",
        b'"just a string"',
        b'{"body": "x", "id": 1}',
        b'{"text": null}',
        b'{"text": 42}',
        b'{"text": ["a"]}',
        b'{"text": ""}',
        b'{"text": "   "}',
        b'{"text": "caf\xe9"}',
        b'{"text": "lone \\ud800 surrogate"}',
        b'{"text": "pair \\ud83c\\udf89 ok"}',
    ]
    p = write(tmp_path / "bad.jsonl", b"\n".join(rows[:3]) + b"\n\n\n" + b"\n".join(rows[3:]) + b"\n")
    idx = index_dataset("dirty", p, cache_dir=cache)
    assert idx.num_records == len(rows)
    out = idx.read(0, range(len(rows)))
    assert out[0] == "good one" and out[-1] == "pair 🎉 ok"
    expect = [
        ("line 2", "invalid JSON"),
        ("line 3", "valid JSON but an array, not an object"),
        ("line 6", "valid JSON but a string, not an object"),
        ("line 7", "missing field 'text' (fields present: 'body', 'id')"),
        ("line 8", "field 'text' is null"),
        ("line 9", "field 'text' is a number, not a string"),
        ("line 10", "field 'text' is an array, not a string"),
        ("line 11", "field 'text' is empty"),
        ("line 12", "field 'text' is empty (whitespace only)"),
        ("line 13", "invalid UTF-8 (byte 0xe9"),
        ("line 14", "unpaired surrogate"),
    ]
    for rec, (loc, reason) in zip(out[1:-1], expect):
        assert isinstance(rec, BadRecord), rec
        assert rec.dataset == "dirty" and rec.file == p and rec.locator == loc, rec
        assert reason in rec.reason, (rec.reason, reason)
    err = out[1].to_error(skip_hint("dirty"))
    assert isinstance(err, DataError)
    msg = str(err)
    assert "dataset 'dirty'" in msg and p in msg and "line 2" in msg and "invalid JSON" in msg
    assert msg.endswith(SKIP_TAIL.format("dirty"))
    err2 = pickle.loads(pickle.dumps(err))
    assert str(err2) == msg and err2.locator == "line 2"


def test_error_missing_file_and_glob(tmp_path, cache):
    with pytest.raises(DataError, match=r"dataset 'x', file '.*nope\.jsonl': file not found\. Check the path"):
        index_dataset("x", str(tmp_path / "nope.jsonl"), cache_dir=cache)
    with pytest.raises(DataError, match=r"pattern '.*nope-\*\.jsonl' matched no files"):
        index_dataset("x", [str(tmp_path / "nope-*.jsonl")], cache_dir=cache)
    with pytest.raises(DataError, match="path list is empty"):
        index_dataset("x", [], cache_dir=cache)


def test_error_format_inference(tmp_path, cache):
    write(tmp_path / "a.jsonl", jsonl_bytes(["a"]))
    write_parquet(tmp_path / "b.parquet", ["b"])
    write(tmp_path / "c.weird", b"xx")
    with pytest.raises(DataError, match=r'ambiguous format.*jsonl.*parquet.*format = "jsonl"'):
        index_dataset("x", str(tmp_path / "[ab].*"), cache_dir=cache)
    with pytest.raises(DataError, match=r"cannot infer the format of '.*c\.weird'.*format = \"jsonl\""):
        index_dataset("x", str(tmp_path / "c.weird"), cache_dir=cache)
    # an explicit format overrides the extension
    assert index_dataset("x", str(tmp_path / "c.weird"), format="text", cache_dir=cache).read(0, [0]) == ["xx"]
    with pytest.raises(DataError, match="unknown format 'csv'"):
        index_dataset("x", str(tmp_path / "a.jsonl"), format="csv", cache_dir=cache)
    with pytest.raises(DataError, match="unknown text_mode"):
        index_dataset("x", str(tmp_path / "a.jsonl"), text_mode="para", cache_dir=cache)


@pytest.mark.parametrize("compression,ext,tool", [("gzip", "gz", "gzip -t"), ("zstd", "zst", "zstd -t")])
def test_error_truncated_compressed(tmp_path, cache, compression, ext, tool):
    raw = jsonl_bytes(make_docs(3000))
    full = tmp_path / f"full.jsonl.{ext}"
    write(full, raw, compression)
    data = full.read_bytes()
    p = write(tmp_path / f"cut.jsonl.{ext}", data[: len(data) // 2])
    with pytest.raises(DataError, match=rf"dataset 'c', file '{p}': {compression} stream is truncated.*{tool}") as ei:
        index_dataset("c", p, cache_dir=cache)
    assert ei.value.file == p and ei.value.fix
    # cut right before the end as well (only the trailer/checksum missing)
    p2 = write(tmp_path / f"cut2.jsonl.{ext}", data[:-3])
    with pytest.raises(DataError, match="truncated"):
        index_dataset("c", p2, cache_dir=cache)
    # corrupt (not a compressed stream at all)
    p3 = write(tmp_path / f"junk.jsonl.{ext}", b"this is not compressed data at all" * 10)
    with pytest.raises(DataError, match="corrupt"):
        index_dataset("c", p3, cache_dir=cache)


def test_multi_member_gzip_and_multi_frame_zstd(tmp_path, cache):
    a, b = jsonl_bytes(["one", "two"]), jsonl_bytes(["three"])
    pg = write(tmp_path / "m.jsonl.gz", gzip.compress(a) + gzip.compress(b))
    pz = write(
        tmp_path / "m.jsonl.zst", zstandard.ZstdCompressor().compress(a) + zstandard.ZstdCompressor().compress(b)
    )
    for p in (pg, pz):
        assert read_all(index_dataset("m", p, cache_dir=cache)) == ["one", "two", "three"]


def test_error_corrupt_parquet(tmp_path, cache):
    good = write_parquet(tmp_path / "good.parquet", make_docs(30))
    data = open(good, "rb").read()
    p = write(tmp_path / "bad.parquet", data[:-20])  # footer gone
    with pytest.raises(DataError, match=r"file '.*bad\.parquet': not a valid Parquet file.*Re-download"):
        index_dataset("pq", p, cache_dir=cache)
    p2 = write(tmp_path / "junk.parquet", b"PAR1" + b"\x00" * 50)
    with pytest.raises(DataError, match="not a valid Parquet file"):
        index_dataset("pq", p2, cache_dir=cache)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_error_permission_denied(tmp_path, cache):
    p = write(tmp_path / "secret.jsonl", jsonl_bytes(["a"]))
    os.chmod(p, 0)
    try:
        with pytest.raises(DataError, match=r"file '.*secret\.jsonl': permission denied.*chmod"):
            index_dataset("x", p, cache_dir=cache)
    finally:
        os.chmod(p, 0o644)


def test_error_permission_denied_simulated(tmp_path, cache, monkeypatch):
    """Runs as root too: simulate an unreadable file at indexing time and EACCES at read time."""
    p = write(tmp_path / "a.jsonl", jsonl_bytes(["a", "b"]))
    real_access = os.access
    with monkeypatch.context() as m:
        m.setattr(os, "access", lambda path, mode, **k: False if str(path) == p else real_access(path, mode, **k))
        with pytest.raises(DataError, match=r"file '.*a\.jsonl': permission denied.*chmod a\+r"):
            index_dataset("x", p, cache_dir=cache)
    idx = index_dataset("x", p, cache_dir=cache)
    real_open = os.open

    def deny(path, *a, **k):
        if str(path) == p:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(DataError, match=r"dataset 'x', file '.*a\.jsonl': permission denied while reading it"):
        idx.read(0, [0])


def test_file_changed_after_indexing_is_detected_on_read(tmp_path, cache):
    p = write(tmp_path / "a.jsonl", jsonl_bytes(["aaa", "bbb"]))
    idx = index_dataset("x", p, cache_dir=cache)
    write(p, jsonl_bytes(["zzzzzz", "bbb"]))
    bump_mtime(p)
    with pytest.raises(DataError, match="changed since it was indexed"):
        idx.read(0, [1])
    os.remove(p)
    with pytest.raises(DataError, match="file not found"):
        idx.read(0, [1])


def test_index_errors_for_bad_indices(tmp_path, cache):
    idx = index_dataset("x", write(tmp_path / "a.jsonl", jsonl_bytes(["a", "b"])), cache_dir=cache)
    with pytest.raises(IndexError, match="out of range"):
        idx.read(0, [0, 2])
    with pytest.raises(IndexError, match="out of range"):
        idx.read(0, [-1])
    with pytest.raises(IndexError, match="shard"):
        idx.read(1, [0])


# ---------------------------------------------------------------------------------------------
# cache, fingerprint, pickling, threads


def test_fingerprint(tmp_path, cache):
    p = write(tmp_path / "a.jsonl", jsonl_bytes(["a", "b"]))
    q = write(tmp_path / "b.jsonl", jsonl_bytes(["c"]))
    f1 = index_dataset("x", str(tmp_path / "*.jsonl"), cache_dir=cache).fingerprint
    assert len(f1) == 64
    assert index_dataset("y", str(tmp_path / "*.jsonl"), cache_dir=cache).fingerprint == f1  # name-independent
    assert index_dataset("x", str(tmp_path / "*.jsonl"), text_field="body", cache_dir=cache).fingerprint != f1
    bump_mtime(q)  # same bytes, new mtime
    f2 = index_dataset("x", str(tmp_path / "*.jsonl"), cache_dir=cache).fingerprint
    assert f2 != f1
    write(p, jsonl_bytes(["a", "b", "c"]))
    assert index_dataset("x", str(tmp_path / "*.jsonl"), cache_dir=cache).fingerprint not in (f1, f2)


def test_cache_hit_and_stale_cache_rebuilt(tmp_path, cache, monkeypatch):
    p = write(tmp_path / "a.jsonl", jsonl_bytes(["old one", "old two"]))
    idx = index_dataset("x", p, cache_dir=cache)
    files = os.listdir(cache)
    assert len(files) == 1 and files[0].endswith(".npz")  # one table per dataset, no temp files left
    with np.load(os.path.join(cache, files[0]), allow_pickle=False) as z:
        header = json.loads(bytes(z["header"]).decode())
        ((url, size, _version, n),) = header["shards"]
        assert n == 2 and size == os.path.getsize(p) and url.endswith(p)
        assert z["a_offsets"].tolist() == idx._arrays[0]["offsets"].tolist()

    # unchanged file: metadata comes from the cache, nothing is rebuilt
    def boom(self, s):
        raise AssertionError("rebuilt although the cache is fresh")

    with monkeypatch.context() as m:
        m.setattr(DatasetIndex, "_build_arrays", boom)
        assert index_dataset("x", p, cache_dir=cache).read(0, [1]) == ["old two"]

    # modified file: the stale cache must not be used
    write(p, jsonl_bytes(["brand new first", "new 2", "new third record"]))
    bump_mtime(p)
    idx2 = index_dataset("x", p, cache_dir=cache)
    assert idx2.num_records == 3
    assert idx2.read(0, [2, 0]) == ["new third record", "brand new first"]
    assert len(os.listdir(cache)) == 1

    # a corrupt cache file is rebuilt, not trusted
    (fname,) = os.listdir(cache)
    with open(os.path.join(cache, fname), "wb") as f:
        f.write(b"garbage")
    assert index_dataset("x", p, cache_dir=cache).read(0, [1]) == ["new 2"]

    # the default cache dir honours $ZEPHON_CACHE_DIR
    env_cache = tmp_path / "envcache"
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(env_cache))
    assert index_dataset("x", p).cache_dir == str(env_cache) and len(os.listdir(env_cache)) == 1


def test_pickle_roundtrip(tmp_path, cache):
    docs = make_docs(500)
    p = write(tmp_path / "a.jsonl", jsonl_bytes(docs))
    pz = write(tmp_path / "b.jsonl.zst", jsonl_bytes(docs[:50]), "zstd")
    pp = write_parquet(tmp_path / "c.parquet", docs[:40])
    for path in (p, pz, pp):
        idx = index_dataset("x", path, cache_dir=cache)
        truth = idx.read(0, range(idx.num_records))  # warms the caches
        blob = pickle.dumps(idx)
        assert len(blob) < 4000  # metadata arrays are not shipped; they reload from the cache
        idx2 = pickle.loads(blob)
        assert idx2.fingerprint == idx.fingerprint and idx2.shards == idx.shards
        assert idx2.read(0, range(idx.num_records)) == truth
        assert idx2.record_bytes(0).tolist() == idx.record_bytes(0).tolist()
        idx.close()
        assert idx.read(0, [1]) == [truth[1]]  # still usable after close()
    # cache deleted behind our back: the unpickled copy rebuilds (the file itself is unchanged)
    idx = index_dataset("x", p, cache_dir=cache)
    for f in os.listdir(cache):
        os.remove(os.path.join(cache, f))
    assert pickle.loads(pickle.dumps(idx)).read(0, [7]) == [docs[7]]
    # ... but if the file changed, it refuses instead of reading garbage
    idx = index_dataset("x", p, cache_dir=cache)
    blob = pickle.dumps(idx)
    write(p, jsonl_bytes(docs[::-1]))
    bump_mtime(p)
    with pytest.raises(DataError, match="changed since it was indexed"):
        pickle.loads(blob).read(0, [0])


def test_pickle_without_writable_cache_ships_arrays(tmp_path):
    p = write(tmp_path / "a.jsonl", jsonl_bytes(["a", "b"]))
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    with pytest.warns(UserWarning, match="cannot create the index cache"):
        idx = index_dataset("x", p, cache_dir=str(blocker / "sub"))
    assert pickle.loads(pickle.dumps(idx)).read(0, [1, 0]) == ["b", "a"]


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "parquet", "arrow"])
def test_concurrent_reads(tmp_path, cache, kind):
    shards = [make_docs(300, seed=s, tag=f"{s}:") for s in range(3)]
    if kind == "arrow":
        path = write_save_to_disk(tmp_path / "hf", shards)
    else:
        for s, docs in enumerate(shards):
            if kind == "parquet":
                write_parquet(tmp_path / f"s{s}.parquet", docs, row_group_size=32)
            else:
                write(
                    tmp_path / f"s{s}.{kind}",
                    jsonl_bytes(docs, blank_every=11),
                    "gzip" if kind.endswith("gz") else None,
                )
        path = str(tmp_path / f"s*.{kind}")
    idx = index_dataset("c", path, cache_dir=cache)
    assert idx.num_records == 900
    idx._blobs.capacity = 1  # force evictions/reloads under contention
    idx._row_groups.capacity = 2
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(40):
                s = rng.randrange(3)
                ids = [rng.randrange(300) for _ in range(64)]
                got = idx.read(s, ids)
                if got != [shards[s][i] for i in ids]:
                    errors.append((s, ids))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]


def test_parallel_indexing_many_shards_and_progress(tmp_path, cache, capsys):
    docs = {s: make_docs(5 + s, seed=s, tag=f"{s}-") for s in range(12)}
    for s, d in docs.items():
        write(tmp_path / f"p{s:02d}.jsonl", jsonl_bytes(d))
    idx = index_dataset("many", str(tmp_path / "p*.jsonl"), cache_dir=cache, progress=True)
    assert "indexing many" in capsys.readouterr().err
    assert [m.num_records for m in idx.shards] == [5 + s for s in range(12)]
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda s: idx.read(s, range(idx.shards[s].num_records)), range(12)))
    assert outs == [docs[s] for s in range(12)]


def test_first_error_is_deterministic(tmp_path, cache):
    for s in range(6):
        write(tmp_path / f"p{s}.jsonl.gz", gzip.compress(jsonl_bytes(["a"] * 2000))[: None if s < 3 else 40])
    for _ in range(3):
        with pytest.raises(DataError, match=r"p3\.jsonl\.gz"):
            index_dataset("x", str(tmp_path / "p*.jsonl.gz"), cache_dir=cache)


# ---------------------------------------------------------------------------------------------
# the chunked line scanner agrees with a naive splitter whatever the chunk boundaries


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.sampled_from(["", " ", "\t \r", "a", "bc d", " lead", "x\r", "\ufeffbom", "ü€"]), max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
    trailing=st.booleans(),
)
def test_line_scanner_matches_naive(lines, cuts, trailing):
    data = ("\n".join(lines) + ("\n" if trailing and lines else "")).encode("utf-8")
    sc = LineScanner()
    pos = 0
    for c in sorted({min(c, len(data)) for c in cuts}) + [len(data)]:
        if c > pos:
            sc.feed(data[pos:c])
            pos = c
    a = sc.finish()
    # naive reference
    expect, line_nos, off = [], [], 0
    for ln_no, ln in enumerate(data.split(b"\n")):
        start, body = off, ln
        off += len(ln) + 1
        if ln_no == 0 and body.startswith(b"\xef\xbb\xbf"):
            start, body = start + 3, body[3:]
        if body.endswith(b"\r"):
            body = body[:-1]
        if body.strip():
            expect.append((start, len(body)))
            line_nos.append(ln_no + 1)
    assert list(zip(a["offsets"].tolist(), a["lengths"].tolist())) == expect
    assert [line_number(a["gap_rec"], a["gap_cum"], i) for i in range(len(expect))] == line_nos
    assert sc.total == len(data)
