"""No silent data loss: a damaged file is an error naming the file and the position, or (on_error =
"skip") counted bad records; never a shorter dataset or an altered record. Paths listed by a
dataset folder stay inside it."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from zephon.data.datasets import BadRecord, DataError, index_dataset, index_multimodal
from zephon.tools.synth import generate_documents, generate_image_text, write_parquet, write_wds


@pytest.fixture(scope="module")
def tar_bytes(tmp_path_factory):
    root = tmp_path_factory.mktemp("tar")
    path = write_wds(os.path.join(root, "good.tar"), generate_image_text(40, seed=3))
    with tarfile.open(path) as tf:
        members = tf.getmembers()
    return open(path, "rb").read(), members


def index_tar(tmp_path, data, on_error="raise", name="shard.tar"):
    p = tmp_path / name
    p.write_bytes(data)
    kw = {} if on_error == "raise" else {"on_error": on_error}  # "raise" is the default
    return index_multimodal("pairs", str(p), format="wds", cache_dir=str(tmp_path / "cache"), **kw)


def test_intact_tar_has_no_damage(tmp_path, tar_bytes):
    ix = index_tar(tmp_path, tar_bytes[0])
    assert ix.num_records == 40 and ix.damaged(0) == []


def test_garbled_header_in_the_middle_is_an_error_naming_the_byte(tmp_path, tar_bytes):
    data, members = tar_bytes
    raw = bytearray(data)
    mid = members[len(members) // 2]
    raw[mid.offset + 148 : mid.offset + 156] = b"garbage!"  # its checksum field: an invalid header
    with pytest.raises(DataError, match=rf"shard\.tar'.*garbled tar header at byte {mid.offset}") as ei:
        index_tar(tmp_path, bytes(raw))
    assert 'on_error = "skip"' in str(ei.value)


def test_garbled_header_under_skip_is_one_counted_bad_record_and_reading_resumes(tmp_path, tar_bytes):
    data, members = tar_bytes
    raw = bytearray(data)
    mid = members[len(members) // 2]
    raw[mid.offset + 148 : mid.offset + 156] = b"garbage!"
    ix = index_tar(tmp_path, bytes(raw), on_error="skip")
    damaged = ix.damaged(0)
    assert len(damaged) == 1 and f"byte {mid.offset}" in damaged[0][1]
    recs = ix.read(0, list(range(ix.num_records)))
    bad = [r for r in recs if isinstance(r, BadRecord)]
    good = [r for r in recs if not isinstance(r, BadRecord)]
    # the damaged member's sample is incomplete (its other half is a bad record too); every sample
    # after the garbled header is read again: nothing after it is silently dropped
    assert len(good) == 39 and len(bad) == 2
    assert any(b.locator == f"byte {mid.offset}" and "garbled tar header" in b.reason for b in bad)


@pytest.mark.parametrize("where", ["at_member", "inside_data", "inside_header"])
def test_truncated_tar_is_an_error(tmp_path, tar_bytes, where):
    data, members = tar_bytes
    m = members[30]
    cut = {"at_member": m.offset, "inside_data": m.offset_data + 10, "inside_header": m.offset + 100}[where]
    with pytest.raises(DataError, match="cut short|end-of-archive marker"):
        index_tar(tmp_path, data[:cut])
    ix = index_tar(tmp_path, data[:cut], on_error="skip", name=f"cut_{where}.tar")
    recs = ix.read(0, list(range(ix.num_records)))
    assert sum(isinstance(r, BadRecord) for r in recs) >= 1  # the loss is a counted bad record
    assert sum(not isinstance(r, BadRecord) for r in recs) == 15


def test_data_after_the_end_of_archive_marker_is_found(tmp_path, tar_bytes):
    data, _ = tar_bytes
    extra = io.BytesIO()
    with tarfile.open(fileobj=extra, mode="w") as tf:  # a second archive appended (e.g. `cat a.tar b.tar`)
        info = tarfile.TarInfo("late.txt")
        info.size = 4
        tf.addfile(info, io.BytesIO(b"late"))
    with pytest.raises(DataError, match="after the tar's end-of-archive marker"):
        index_tar(tmp_path, data + extra.getvalue())


def test_synth_parquet_pages_carry_checksums(tmp_path):
    """zephon's own writer stores page CRCs, so a flipped byte inside a (snappy) page is refused,
    where snappy alone would hand back altered text."""
    docs = [f"document number {i:04d} " + "lorem ipsum dolor sit amet " * 8 for i in range(200)]
    p = write_parquet(str(tmp_path / "t.parquet"), docs, row_group_size=1000)
    col = pq.ParquetFile(p).metadata.row_group(0).column(0)
    start = col.dictionary_page_offset or col.data_page_offset
    raw = bytearray(open(p, "rb").read())
    raw[start + col.total_compressed_size - 40] ^= 0x20  # a byte inside the last page's data
    bad = tmp_path / "bad" / "t.parquet"
    bad.parent.mkdir()
    bad.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"t\.parquet'.*row group 0"):
        ix = index_dataset("code", str(bad), format="parquet", cache_dir=str(tmp_path / "cache"))
        ix.read(0, list(range(ix.num_records)))


def test_parquet_writer_writes_page_checksums(tmp_path):
    docs = [f"doc {i} " + "x" * 50 for i in range(50)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "plain.parquet", compression="none", use_dictionary=False)
    p = tmp_path / "z.parquet"
    pq.write_table(
        pa.table({"text": docs}), p, compression="none", use_dictionary=False, write_page_checksum=True
    )  # what zephon.tools.synth.write_parquet does
    raw = bytearray(p.read_bytes())
    raw[bytes(raw).find(b"doc 7 ") + 4] ^= 0x01
    p.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="CRC|checksum"):
        ix = index_dataset("t", str(p), format="parquet", cache_dir=str(tmp_path / "cache"))
        ix.read(0, list(range(ix.num_records)))
    # a file written without checksums cannot be verified (documented): it still reads
    ix = index_dataset("t", str(tmp_path / "plain.parquet"), format="parquet", cache_dir=str(tmp_path / "cache"))
    assert ix.read(0, [0]) == [docs[0]]


def _arrow_stream(path, table, batches):
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for b in table.to_batches(max_chunksize=len(table) // batches):
            w.write_batch(b)


def test_arrow_stream_cut_at_a_batch_boundary_is_refused(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    table = pa.table({"text": generate_documents("web", 120, seed=8)})
    ap = folder / "data-00000-of-00001.arrow"
    _arrow_stream(ap, table, 4)
    json.dump({"_data_files": [{"filename": ap.name}]}, open(folder / "state.json", "w"))
    assert index_dataset("hf", str(folder), format="arrow", cache_dir=None).num_records == 120
    buf = io.BytesIO()
    with pa.ipc.new_stream(buf, table.schema) as w:
        for b in table.to_batches(max_chunksize=30)[:2]:
            w.write_batch(b)
    ap.write_bytes(buf.getvalue()[:-8])  # two whole batches, no end-of-stream marker
    with pytest.raises(DataError, match="truncated Arrow stream.*end-of-stream marker"):
        index_dataset("hf", str(folder), format="arrow", cache_dir=None)


def _hf_folder(root, filename):
    folder = root / "data" / "hf"
    folder.mkdir(parents=True, exist_ok=True)
    json.dump({"_data_files": [{"filename": filename}]}, open(folder / "state.json", "w"))
    return folder


@pytest.fixture()
def outside(tmp_path):
    out = tmp_path / "outside"
    out.mkdir()
    _arrow_stream(out / "x.arrow", pa.table({"text": ["SECRET from outside the dataset root"] * 4}), 1)
    return out / "x.arrow"


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_save_to_disk_paths_are_confined_to_the_folder(tmp_path, outside, kind):
    if kind == "symlink":
        folder = _hf_folder(tmp_path, "link.arrow")
        os.symlink(outside, folder / "link.arrow")
    else:
        folder = _hf_folder(tmp_path, "../../outside/x.arrow" if kind == "dotdot" else str(outside))
    with pytest.raises(DataError, match="outside the dataset folder"):
        index_dataset("hf", str(folder), format="arrow", cache_dir=None)


def test_save_to_disk_file_inside_the_folder_is_read(tmp_path):
    folder = _hf_folder(tmp_path, "sub/x.arrow")
    (folder / "sub").mkdir()
    _arrow_stream(folder / "sub" / "x.arrow", pa.table({"text": ["inside"] * 2}), 1)
    ix = index_dataset("hf", str(folder), format="arrow", cache_dir=None)
    assert ix.read(0, [0, 1]) == ["inside", "inside"]


def test_demo_and_test_shards_are_intact(tmp_path):
    """Every tar zephon's own writer produces passes the integrity check (no false alarms)."""
    for n in (0, 1, 7):
        p = write_wds(os.path.join(tmp_path, f"s{n}.tar"), generate_image_text(n, seed=n))
        ix = index_multimodal("p", p, format="wds", cache_dir=None)
        assert ix.num_records == n and ix.damaged(0) == []
    assert np.all(ix.record_bytes(0) > 0)
