"""Bounded memory and time on hostile input: line scanning holds no more than a chunk whatever the
line length, and a record above the per-record size limit is a bad record naming its file and line,
never read."""

from __future__ import annotations

import gzip
import json
import random
import tracemalloc

import numpy as np
import pytest

from zephon.data.datasets import BadRecord, index_dataset
from zephon.data.datasets._scan import CHUNK, LineScanner


def scan(data: bytes, chunks: list[int], carry_limit: int) -> dict:
    sc = LineScanner(carry_limit=carry_limit)
    i = 0
    for n in chunks:
        sc.feed(data[i : i + n])
        i += n
    sc.feed(data[i:])
    return sc.finish()


def test_long_lines_are_followed_by_metadata_only():
    """A line without a newline is not copied chunk after chunk (the old scanner re-joined and
    re-searched the whole line on every chunk: quadratic); the scanner holds no bytes of it."""
    sc = LineScanner(carry_limit=1 << 20)
    chunk = b"a" * (1 << 20)
    for _ in range(64):
        sc.feed(chunk)
        assert len(sc._carry) <= 1 << 20
    sc.feed(b"\n" + b"b" * 10 + b"\n")
    out = sc.finish()
    assert out["offsets"].tolist() == [0, 64 << 20 | 1] and out["lengths"].tolist() == [64 << 20, 10]


@pytest.mark.parametrize("seed", range(20))
def test_scanning_is_the_same_for_any_chunking_and_carry_limit(seed):
    rng = random.Random(seed)
    pieces = [b"\n", b"\r\n", b"  ", b"\t\n", b"abc", b"\r", b" \r\n", b"\xef\xbb\xbf"]
    data = b"".join(rng.choice(pieces) + b"x" * rng.randint(0, 30) for _ in range(rng.randint(0, 60)))
    if seed % 3 == 0:
        data = b"\xef\xbb\xbf" + data
    want = scan(data, [], 1 << 40)
    for limit in (0, 1, 5, 64):
        chunks = [rng.randint(1, 9) for _ in range(len(data) // 4)]
        got = scan(data, chunks, limit)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k}, limit {limit}")


def test_a_gzip_bomb_line_is_indexed_in_bounded_memory_and_never_read(tmp_path):
    path = tmp_path / "b.jsonl.gz"
    with gzip.GzipFile(path, "wb", mtime=0, compresslevel=9) as g:
        g.write(json.dumps({"text": "a short first document"}).encode() + b"\n")
        g.write(b'{"text": "')
        block = b"a" * (8 << 20)
        for _ in range(12):  # 96 MiB in one line (a ~100 KB file)
            g.write(block)
        g.write(b'"}\n')
    tracemalloc.start()
    try:
        ix = index_dataset("web", str(path), cache_dir=str(tmp_path / "cache"), max_record_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 6 * CHUNK, f"indexing held {peak >> 20} MiB"  # a few chunks; the old scanner held the line
    assert ix.record_bytes(0).tolist()[1] > 96 << 20

    def no_read(*a, **kw):
        raise AssertionError("the oversized record's bytes were read")

    ix._blob = no_read  # the decompressed shard is never needed for it
    (bad,) = ix.read(0, [1])
    assert isinstance(bad, BadRecord) and bad.locator == "line 2" and bad.file.endswith("b.jsonl.gz")
    assert "more than max_record_bytes = 1048576 (the per-record size limit)" in bad.reason


@pytest.mark.parametrize("fmt", ["jsonl", "text", "parquet"])
def test_the_size_limit_applies_to_every_format(tmp_path, fmt):
    docs = ["small one", "y" * 5000, "small two"]
    if fmt == "parquet":
        from zephon.tools.synth import write_parquet

        p = write_parquet(str(tmp_path / "d.parquet"), docs)
        loc = "row 1"
    else:
        p = str(tmp_path / f"d.{'jsonl' if fmt == 'jsonl' else 'txt'}")
        with open(p, "w") as f:
            f.write("\n".join(json.dumps({"text": d}) if fmt == "jsonl" else d for d in docs) + "\n")
        loc = "line 2"
    ix = index_dataset("d", p, format=fmt, cache_dir=str(tmp_path / "cache"), max_record_bytes=1000)
    a, b, c = ix.read(0, [0, 1, 2])
    assert (a, c) == ("small one", "small two")
    assert isinstance(b, BadRecord) and b.locator == loc and "max_record_bytes = 1000" in b.reason
