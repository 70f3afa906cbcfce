"""Every index kind satisfies the index contract (``ShardIndex``), and every reader module
round-trips what it is given: written records read back identical, from a fresh index, from the
metadata cache and through a pickled handle."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from PIL import Image

from zephon.data import ImageTextShardIndex as PublicImageTextShardIndex
from zephon.data import ShardIndex as PublicShardIndex
from zephon.data.datasets import (
    BadRecord,
    DatasetIndex,
    ImageTextShardIndex,
    MMRecord,
    MultimodalIndex,
    ShardIndex,
    index_dataset,
    index_multimodal,
)
from zephon.data.datasets.arrow import ArrowReader
from zephon.data.datasets.jsonl import JsonlReader
from zephon.data.datasets.mm_parquet import MMParquetReader
from zephon.data.datasets.parquet import ParquetReader
from zephon.data.datasets.text import LineReader, TextFileReader
from zephon.data.datasets.wds import IMAGE_EXTS, TEXT_EXTS, WdsReader, tar_member_role

DOCS = ["first doc", "second, with ünïcödé", "third\tone", "x" * 3000, "last"]


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (w % 255, h % 255, 7)).save(buf, "PNG")
    return buf.getvalue()


def _compress(data: bytes, comp: str | None) -> bytes:
    if comp == "gz":
        return gzip.compress(data)
    if comp == "zst":
        return zstandard.ZstdCompressor().compress(data)
    return data


def _text_shards(tmp_path, fmt: str, comp: str | None) -> tuple[str, dict, list[str]]:
    """Two shards of ``DOCS`` in ``fmt``: (glob, index_dataset kwargs, expected records in order)."""
    root = tmp_path / "data"
    root.mkdir()
    halves = [DOCS[:3], DOCS[3:]]
    ext = {"jsonl": "jsonl", "text": "txt", "parquet": "parquet", "arrow": "arrow", "file": "txt"}[fmt]
    suffix = f".{comp}" if comp else ""
    for k, docs in enumerate(halves):
        p = root / f"s{k}.{ext}{suffix}"
        if fmt == "jsonl":
            p.write_bytes(
                _compress(b"".join(json.dumps({"text": d, "id": i}).encode() + b"\n" for i, d in enumerate(docs)), comp)
            )
        elif fmt == "text":
            p.write_bytes(_compress(("\n\n".join(docs) + "\n").encode(), comp))
        elif fmt == "file":
            p.write_bytes(_compress("\n".join(docs).encode(), comp))
        elif fmt == "parquet":
            pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), p, row_group_size=2)
        else:
            table = pa.table({"text": docs})
            with pa.ipc.new_stream(str(p), table.schema) as w:
                w.write_table(table, max_chunksize=2)
    kwargs = {"text_mode": "file"} if fmt == "file" else {}
    expected = ["\n".join(h) for h in halves] if fmt == "file" else DOCS
    return str(root / f"s*.{ext}{suffix}"), kwargs, expected


def _wds_shard(tmp_path) -> tuple[str, list[tuple[bytes, str]]]:
    root = tmp_path / "wds"
    root.mkdir()
    samples = [(_png(16 + i, 8 + i), f"caption {i}") for i in range(4)]
    with tarfile.open(root / "s0.tar", "w") as tar:
        for i, (img, cap) in enumerate(samples):
            # one caption as .txt, one as .json with the caption under text_field
            cap_name, cap_data = (
                (f"k{i}.json", json.dumps({"caption": cap}).encode()) if i % 2 else (f"k{i}.txt", cap.encode())
            )
            for name, data in ((f"k{i}.png", img), (cap_name, cap_data), (f"k{i}.cls", b"3")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(root / "*.tar"), samples


def _all_reads(ix) -> list:
    return [r for s in range(len(ix.shards)) for r in ix.read(s, list(range(ix.shards[s].num_records)))]


def _round_trips(ix, expected, make) -> None:
    """``ix`` reads ``expected``; so does an index built again (from the cache) and a pickled copy;
    reads in any order and with duplicates follow the indices asked."""
    assert _all_reads(ix) == expected
    again = make()
    assert again.fingerprint == ix.fingerprint and again.num_records == ix.num_records
    assert _all_reads(again) == expected
    copy = pickle.loads(pickle.dumps(ix))
    assert _all_reads(copy) == expected
    assert [copy.record_bytes(s).tolist() for s in range(len(ix.shards))] == [
        ix.record_bytes(s).tolist() for s in range(len(ix.shards))
    ]
    n0 = ix.shards[0].num_records
    order = [n0 - 1, 0, n0 - 1]
    assert ix.read(0, order) == [expected[i] for i in order]
    off = ix.shard_offsets()
    assert off.tolist()[0] == 0 and off.tolist()[-1] == ix.num_records == len(expected)
    for s in range(len(ix.shards)):
        loc = ix.locate(s, 0)
        assert loc["file"] == ix.shards[s].path and loc["locator"]
    ix.close()
    assert _all_reads(ix) == expected  # reads reopen what close() released


@pytest.mark.parametrize(
    "fmt,comp,reader",
    [
        ("jsonl", None, JsonlReader),
        ("jsonl", "zst", JsonlReader),
        ("text", None, LineReader),
        ("text", "gz", LineReader),
        ("file", None, TextFileReader),
        ("file", "zst", TextFileReader),
        ("parquet", None, ParquetReader),
        ("arrow", None, ArrowReader),
    ],
)
def test_each_text_reader_round_trips_and_the_index_is_a_shard_index(tmp_path, fmt, comp, reader):
    path, kwargs, expected = _text_shards(tmp_path, fmt, comp)
    cache = str(tmp_path / "cache")

    def make() -> DatasetIndex:
        return index_dataset("d", path, cache_dir=cache, **kwargs)

    ix = make()
    assert type(ix._reader) is reader
    assert isinstance(ix, ShardIndex) and not isinstance(ix, ImageTextShardIndex)
    _round_trips(ix, expected, make)


def test_each_image_text_reader_round_trips_and_the_index_is_an_image_text_shard_index(tmp_path):
    path, samples = _wds_shard(tmp_path)
    cache = str(tmp_path / "cache")
    expected = [
        MMRecord((img, cap), path.replace("*.tar", "s0.tar"), f"key 'k{i}'") for i, (img, cap) in enumerate(samples)
    ]

    def make_wds() -> MultimodalIndex:
        return index_multimodal("w", path, cache_dir=cache)

    ix = make_wds()
    assert type(ix._reader) is WdsReader
    assert isinstance(ix, ShardIndex) and isinstance(ix, ImageTextShardIndex)
    _round_trips(ix, expected, make_wds)
    assert ix.image_sizes(0)[1].tolist() == [16, 17, 18, 19]
    assert [s["member"] for s in ix.sources(0, 1)] == ["k1.png", "k1.json"]

    # image-text Parquet, and interleaved documents (a list of texts and a list of images)
    root = tmp_path / "pq"
    root.mkdir()
    pq.write_table(
        pa.table({"image": [img for img, _ in samples], "caption": [c for _, c in samples]}),
        root / "pairs.parquet",
        row_group_size=3,
    )
    img = _png(10, 12)
    docs = [(["intro", None, "outro"], [None, img, None]), ([None, "only text"], [img, None])]
    pq.write_table(pa.table({"texts": [t for t, _ in docs], "images": [i for _, i in docs]}), root / "docs.parquet")
    pairs = str(root / "pairs.parquet")
    inter = str(root / "docs.parquet")
    for kind, p, want in (
        ("image_text", pairs, [MMRecord((im, c), pairs, f"row {i}") for i, (im, c) in enumerate(samples)]),
        (
            "interleaved",
            inter,
            [MMRecord(("intro", img, "outro"), inter, "row 0"), MMRecord((img, "only text"), inter, "row 1")],
        ),
    ):

        def make(kind=kind, p=p) -> MultimodalIndex:
            return index_multimodal(kind, p, kind=kind, cache_dir=cache)

        ix = make()
        assert type(ix._reader) is MMParquetReader
        assert isinstance(ix, ImageTextShardIndex)
        _round_trips(ix, want, make)


def test_the_public_protocols_are_the_layer_s():
    assert PublicShardIndex is ShardIndex and PublicImageTextShardIndex is ImageTextShardIndex
    assert not isinstance(object(), ShardIndex)


def test_tar_member_roles_follow_the_extension_lists():
    for ext in IMAGE_EXTS:
        assert tar_member_role(f"a/b.{ext.upper()}") == ("a/b", "image", ext)
    for ext in TEXT_EXTS:
        assert tar_member_role(f"b.{ext}") == ("b", "text", ext)
    assert tar_member_role(".hidden.png") is None and tar_member_role("noext") is None
    assert tar_member_role("k.cls") is None


def test_a_caption_without_an_image_names_the_image_extensions(tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    with tarfile.open(root / "s.tar", "w") as tar:
        info = tarfile.TarInfo("k.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"cap"))
    (bad,) = index_multimodal("w", str(root / "*.tar"), cache_dir=str(tmp_path / "c")).read(0, [0])
    assert isinstance(bad, BadRecord)
    assert bad.reason.startswith("the sample has a caption but no image (a member Pillow can open: ")
    assert ".gif" in bad.reason or ".bmp" in bad.reason


def test_metadata_arrays_are_read_only(tmp_path):
    path, kwargs, _ = _text_shards(tmp_path, "jsonl", None)
    ix = index_dataset("d", path, cache_dir=str(tmp_path / "cache"), **kwargs)
    with pytest.raises(ValueError):
        ix.record_bytes(0)[0] = 1
    assert os.listdir(tmp_path / "cache") and np.all(ix.record_bytes(0) > 0)
