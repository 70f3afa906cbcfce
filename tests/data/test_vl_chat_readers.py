"""Vision-language chat records (``kind = "chat"``) read back as written in every format: the
conversation's JSON text first, then its images in the order the conversation refers to them;
the indexed sizes are the written ones; records whose images cannot be found or ordered are bad
records naming the member, path or list entry; the synthetic generator is deterministic."""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from storage_server import FaultyServer

from zephon.data.chat import parse_conversation
from zephon.data.datasets import BadRecord, DataError, MMRecord, image_header_size, index_multimodal
from zephon.tools.synth import (
    generate_vl_conversations,
    make_vl_chat_corpus,
    write_vl_chat_jsonl,
    write_vl_chat_parquet,
    write_vl_chat_wds,
)

N = 8


def png(w: int, h: int, shade: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (shade, 80, 160)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_vl_chat_corpus(str(tmp_path_factory.mktemp("vlchat")), seed=0, n_wds=N, n_parquet=N, n_jsonl=N)


def as_parts(conv: list[dict]) -> list[dict]:
    """A conversation as the Parquet struct column stores it: every content a list of parts."""
    return [
        {**m, "content": m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]}
        for m in conv
    ]


def check(ix, shard: int, want: list[tuple[object, list[bytes]]], exact_text: list[str] | None = None) -> list:
    """Every record of ``shard`` reads back as ``want`` ((conversation JSON value, images)), with
    the indexed sizes of what was read."""
    recs = ix.read(shard, list(range(len(want))))
    assert all(isinstance(r, MMRecord) for r in recs), [r for r in recs if not isinstance(r, MMRecord)]
    n_img, ws, hs = (x.tolist() for x in ix.image_sizes(shard))
    assert n_img == [len(imgs) for _, imgs in want]
    all_imgs = [img for _, imgs in want for img in imgs]
    assert list(zip(ws, hs)) == [image_header_size(img) for img in all_imgs]
    assert all(w > 0 for w in ws)
    for rec, (conv, imgs) in zip(recs, want):
        assert isinstance(rec.segments[0], str) and json.loads(rec.segments[0]) == conv
        assert list(rec.segments[1:]) == imgs
    assert ix.record_bytes(shard).tolist() == [len(r.segments[0].encode("utf-8")) for r in recs]
    if exact_text is not None:
        assert [r.segments[0] for r in recs] == exact_text
    return recs


def dumps(v: object) -> str:
    return json.dumps(v, ensure_ascii=False)


def test_tar_chat_records_read_back_in_image_order(corpus, tmp_path):
    msgs = generate_vl_conversations(N, 0)  # one form per dataset: the messages form in both shards
    ix = index_multimodal("w", corpus["chat_wds"], kind="chat", cache_dir=str(tmp_path))
    assert ix.format == "wds" and ix.num_records == N
    for shard, recs in ((0, msgs[: N // 2]), (1, msgs[N // 2 :])):
        want = [(r["conversation"], r["images"]) for r in recs]
        check(ix, shard, want, [dumps(r["conversation"]) for r in recs])
    assert any(len(r["images"]) > 1 for r in msgs)  # the numbered spelling is exercised
    got = ix.read(1, [0])[0]
    assert parse_conversation(got.segments[0], parts=True)["messages"][-1]["role"] == "assistant"
    src = ix.sources(0, 0)
    assert [s["kind"] for s in src] == ["text"] + ["image"] * len(msgs[0]["images"])
    assert src[0]["member"] == "00000000.json" and src[1]["member"].startswith("00000000.0.")
    # from the metadata cache, and through a pickled handle
    again = pickle.loads(pickle.dumps(index_multimodal("w", corpus["chat_wds"], kind="chat", cache_dir=str(tmp_path))))
    check(again, 0, [(r["conversation"], r["images"]) for r in msgs[: N // 2]])


def test_parquet_chat_records_struct_and_json_columns(corpus, tmp_path):
    recs = generate_vl_conversations(N, 1)
    ix = index_multimodal("p", corpus["chat_parquet"], kind="chat", cache_dir=str(tmp_path))
    assert ix.format == "parquet" and ix.num_records == N
    # shard 0: list<struct> conversations (absent fields filled with None by Arrow, dropped on read)
    check(ix, 0, [(as_parts(r["conversation"]), r["images"]) for r in recs[: N // 2]])
    # shard 1: JSON text conversations kept byte for byte, Hugging Face image structs
    check(
        ix,
        1,
        [(r["conversation"], r["images"]) for r in recs[N // 2 :]],
        [dumps(r["conversation"]) for r in recs[N // 2 :]],
    )
    rec = ix.read(0, [0])[0]  # None-valued struct fields are dropped: an image part is {"type": "image"}
    user = next(m for m in json.loads(rec.segments[0]) if m["role"] == "user")
    assert user["content"][0] == {"type": "image"}
    src = ix.sources(1, 0)
    assert src[0] == {
        "kind": "text",
        "column": "messages",
        "row": 0,
        "list_index": None,
        "field": None,
        "file_bytes": None,
    }
    assert [(s["list_index"], s["field"]) for s in src[1:]] == [
        (j, "bytes") for j in range(len(recs[N // 2]["images"]))
    ]


def test_jsonl_chat_records_image_list_inline_parts_and_llava(corpus, tmp_path):
    recs = generate_vl_conversations(N, 2)
    ix = index_multimodal("j", corpus["chat_jsonl"], kind="chat", cache_dir=str(tmp_path))
    assert ix.format == "jsonl" and ix.num_records == N
    folder = os.path.dirname(corpus["chat_jsonl"])
    for shard, part in ((0, recs[: N // 2]), (1, recs[N // 2 :])):
        with open(os.path.join(folder, f"vl-000{shard}.jsonl"), encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
        got = check(ix, shard, [(line, r["images"]) for line, r in zip(lines, part)])
        for rec, r in zip(got, part):
            assert [m["role"] for m in json.loads(rec.segments[0])["messages"]] == [
                m["role"] for m in r["conversation"]
            ]
    assert ix.locate(0, 2)["locator"] == "line 3"
    src = ix.sources(0, 0)
    assert src[0]["kind"] == "text" and src[1]["ref"].startswith("images/") and os.path.isfile(src[1]["path"])

    llava = generate_vl_conversations(N, 3, form="sharegpt")
    lx = index_multimodal("l", corpus["chat_llava"], kind="chat", image_field="image", cache_dir=str(tmp_path))
    with open(corpus["chat_llava"].replace("*", "llava"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    got = check(lx, 0, [(line, r["images"]) for line, r in zip(lines, llava)])
    assert parse_conversation(got[0].segments[0], "sharegpt")["messages"][-1]["role"] == "assistant"


def tar_of(tmp_path, members: list[tuple[str, bytes]]) -> str:
    p = str(tmp_path / "bad.tar")
    with tarfile.open(p, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return p


def test_tar_records_whose_images_cannot_be_ordered_are_bad_records_naming_the_members(tmp_path):
    conv = json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]).encode()
    img = png(20, 10)
    p = tar_of(
        tmp_path,
        [
            ("ok.json", conv), ("ok.0.png", img), ("ok.1.png", png(30, 12)), ("ok.10.png", png(8, 8)),
            ("ok.2.png", img), ("ok.3.png", img), ("ok.4.png", img), ("ok.5.png", img), ("ok.6.png", img),
            ("ok.7.png", img), ("ok.8.png", img), ("ok.9.png", img), ("ok.txt", b"ignored"),
            ("mixed.json", conv), ("mixed.png", img), ("mixed.1.png", img),
            ("gap.json", conv), ("gap.0.png", img), ("gap.2.png", img),
            ("dup.json", conv), ("dup.0.png", img), ("dup.1.png", img), ("dup.1.jpg", img),
            ("noconv.0.png", img),
            ("notjson.json", b"{nope"), ("notjson.png", img),
            ("plain.json", conv),
        ],
    )  # fmt: skip
    ix = index_multimodal("bad", p, kind="chat", cache_dir=str(tmp_path / "c"))
    recs = ix.read(0, range(ix.num_records))
    by_key = {r.locator: r for r in recs}
    ok = by_key["key 'ok'"]
    assert isinstance(ok, MMRecord) and len(ok.segments) == 12  # natural order: 10 after 9
    assert ok.segments[2] == png(30, 12) and ok.segments[11] == png(8, 8)
    assert ix.image_sizes(0)[0].tolist()[0] == 11 and ix.image_sizes(0)[1].tolist()[:2] == [20, 30]
    assert isinstance(by_key["key 'plain'"], MMRecord) and by_key["key 'plain'"].segments == (conv.decode(),)
    reasons = {k: r.reason for k, r in by_key.items() if isinstance(r, BadRecord)}
    assert set(reasons) == {"key 'mixed'", "key 'gap'", "key 'dup'", "key 'noconv'", "key 'notjson'"}
    assert "mixes numbered and unnumbered" in reasons["key 'mixed'"] and "mixed.png" in reasons["key 'mixed'"]
    assert "no image 1" in reasons["key 'gap'"] and "gap.2.png" in reasons["key 'gap'"]
    assert "dup.1.jpg" in reasons["key 'dup'"] and "dup.1.png" in reasons["key 'dup'"]
    assert "no conversation member" in reasons["key 'noconv'"] and "noconv.0.png" in reasons["key 'noconv'"]
    assert "notjson.json" in reasons["key 'notjson'"] and "not JSON" in reasons["key 'notjson'"]


def test_a_chat_tar_rewritten_in_place_is_refused_naming_the_record(tmp_path):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    recs = [{"conversation": conv, "images": [png(16, 16, k), png(16, 16, k + 1)]} for k in range(3)]
    p = write_vl_chat_wds(str(tmp_path / "a.tar"), recs)
    ix = index_multimodal("w", p, kind="chat", cache_dir=str(tmp_path / "c"))
    st = os.stat(p)
    forged = recs[:1] + [{"conversation": conv, "images": [png(16, 16, 9), png(16, 16, 2)]}] + recs[2:]
    data = open(write_vl_chat_wds(str(tmp_path / "b.tar"), forged), "rb").read()
    assert len(data) == st.st_size
    with open(p, "r+b") as f:
        f.write(data)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ix.read(0, [0])[0].segments[1] == recs[0]["images"][0]
    with pytest.raises(DataError) as e:
        ix.read(0, [1])
    assert p in str(e.value) and "key '00000001'" in str(e.value) and "changed" in str(e.value)


def write_lines(folder, objs: list[object]) -> str:
    os.makedirs(folder, exist_ok=True)
    p = os.path.join(folder, "d.jsonl")
    with open(p, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(o) + "\n" for o in objs)
    return p


def test_jsonl_records_with_unreadable_images_are_bad_records_naming_the_path(tmp_path):
    d = tmp_path / "data"
    os.makedirs(d / "img")
    (d / "img" / "a.png").write_bytes(png(12, 34))
    (tmp_path / "outside.png").write_bytes(png(5, 5))
    conv = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": "a"},
    ]
    p = write_lines(
        str(d),
        [
            {"messages": conv, "images": ["img/a.png", "img/missing.png"]},
            {"messages": conv, "images": ["../outside.png"]},
            {"messages": conv, "images": "img/a.png"},
            {"messages": conv, "images": ["s3://bucket/a.png"]},
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            {"messages": conv, "images": [str(d / "img" / "a.png")]},
            {"messages": conv, "images": None},
        ],
    )
    with open(p, "ab") as f:
        f.write(b"{not json\n")
    ix = index_multimodal("j", str(d / "*.jsonl"), kind="chat", cache_dir=str(tmp_path / "c"))
    recs = ix.read(0, range(8))
    n_img, ws, hs = (x.tolist() for x in ix.image_sizes(0))
    assert n_img == [2, 0, 1, 0, 0, 1, 0, 0] and ws == [12, 0, 12, 12] and hs == [34, 0, 34, 34]
    assert [type(r).__name__ for r in recs] == [
        "BadRecord",
        "BadRecord",
        "MMRecord",
        "BadRecord",
        "BadRecord",
        "MMRecord",
        "MMRecord",
        "BadRecord",
    ]
    assert "img/missing.png" in recs[0].reason and str(d / "img" / "missing.png") in recs[0].reason
    assert recs[0].locator == "line 1" and recs[0].file == p
    assert "../outside.png" in recs[1].reason and "leaves the dataset folder" in recs[1].reason
    assert "URL" in recs[3].reason and "without a path" in recs[4].reason and "not JSON" in recs[7].reason
    assert recs[2].segments[1] == png(12, 34) and recs[6].segments[1:] == ()
    # an image rewritten after indexing: refused naming it and the line
    (d / "img" / "a.png").write_bytes(png(12, 34, 200))
    with pytest.raises(DataError) as e:
        ix.read(0, [2])
    assert str(d / "img" / "a.png") in str(e.value) and "line 3" in str(e.value) and "changed" in str(e.value)


def test_jsonl_is_for_chat_only_and_compressed_jsonl_is_refused(tmp_path):
    p = write_lines(str(tmp_path), [{"messages": [], "images": []}])
    with pytest.raises(DataError, match="only chat records"):
        index_multimodal("j", p, kind="image_text", cache_dir=str(tmp_path / "c"))
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(b"")
    with pytest.raises(DataError, match="may not be compressed"):
        index_multimodal("j", str(gz), kind="chat", format="jsonl", cache_dir=str(tmp_path / "c"))


def test_parquet_rows_with_null_images_are_bad_records_naming_the_entry(tmp_path):
    conv = json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    img = png(7, 9)
    table = pa.table(
        {
            "messages": pa.array([conv, conv, None, conv, conv, "[1"], pa.string()),
            "images": pa.array([[img, img], [img, None], [img], None, [], [img]], pa.list_(pa.binary())),
        }
    )
    pq.write_table(table, str(tmp_path / "a.parquet"), row_group_size=4)
    ix = index_multimodal("p", str(tmp_path / "a.parquet"), kind="chat", cache_dir=str(tmp_path / "c"))
    recs = ix.read(0, range(6))
    assert [type(r).__name__ for r in recs] == [
        "MMRecord",
        "BadRecord",
        "BadRecord",
        "MMRecord",
        "MMRecord",
        "BadRecord",
    ]
    assert recs[0].segments == (conv, img, img) and recs[3].segments == (conv,) == recs[4].segments
    assert "image 1 of 'images' is null" in recs[1].reason and recs[1].locator == "row 1"
    assert "conversation is null" in recs[2].reason and "not JSON" in recs[5].reason
    assert ix.image_sizes(0)[0].tolist() == [2, 0, 0, 0, 0, 0]
    # a single image (not a list), and Hugging Face structs with a path only
    item = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    one = pa.table(
        {
            "messages": [conv, conv],
            "images": pa.array([{"bytes": img, "path": None}, {"bytes": None, "path": "x.png"}], item),
        }
    )
    pq.write_table(one, str(tmp_path / "b.parquet"))
    ix = index_multimodal("p", str(tmp_path / "b.parquet"), kind="chat", cache_dir=str(tmp_path / "c"))
    a, b = ix.read(0, [0, 1])
    assert a.segments == (conv, img) and "only the path 'x.png'" in b.reason


def test_a_chat_index_and_an_image_text_index_of_the_same_files_share_no_cache(tmp_path):
    recs = [{"conversation": [{"role": "user", "content": "hi"}], "images": [png(10, 10)]}] * 3
    p = write_vl_chat_wds(str(tmp_path / "a.tar"), recs)
    cache = tmp_path / "c"
    chat = index_multimodal("w", p, kind="chat", cache_dir=str(cache))
    pairs = index_multimodal("w", p, kind="image_text", text_field="text", cache_dir=str(cache))
    assert len([f for f in os.listdir(cache) if f.endswith(".npz")]) == 2 and chat.fingerprint != pairs.fingerprint
    assert isinstance(chat.read(0, [0])[0].segments[0], str) and isinstance(pairs.read(0, [0])[0], BadRecord)
    again = index_multimodal("w", p, kind="chat", cache_dir=str(cache))
    assert again.read(0, [1])[0].segments == chat.read(0, [1])[0].segments


def test_remote_jsonl_chat_records_read_their_images_by_url(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEPHON_IO_RETRY_S", "3")
    monkeypatch.setenv("ZEPHON_IO_TIMEOUT_S", "0.5")
    recs = generate_vl_conversations(4, 5)
    p = write_vl_chat_jsonl(str(tmp_path / "d"), recs)
    with FaultyServer() as srv:
        for root, _, files in os.walk(tmp_path / "d"):
            for name in files:
                full = os.path.join(root, name)
                srv.files["/d/" + os.path.relpath(full, tmp_path / "d")] = open(full, "rb").read()
        ix = index_multimodal("r", srv.url("/d/chat.jsonl"), kind="chat", format="jsonl", cache_dir=str(tmp_path / "c"))
        lines = [json.loads(line) for line in open(p, encoding="utf-8")]
        srv.fail_next = 2  # transient faults are retried
        check(ix, 0, [(line, r["images"]) for line, r in zip(lines, recs)])


def test_the_generator_and_writers_are_deterministic(tmp_path):
    a, b = generate_vl_conversations(12, 7), generate_vl_conversations(12, 7)
    assert a == b and generate_vl_conversations(5, 7) == a[:5] and generate_vl_conversations(12, 8) != a
    assert {len(r["images"]) for r in generate_vl_conversations(64, 0)} >= {0, 1, 2}
    later = [
        r
        for r in generate_vl_conversations(64, 0)
        if any(
            isinstance(p, dict) and p.get("type") == "image"
            for m in r["conversation"][2:]
            for p in m["content"]
            if isinstance(m["content"], list)
        )
    ]
    assert later  # an image in a later user turn
    sg = generate_vl_conversations(12, 7, form="sharegpt")
    for r in sg:
        assert sum(m["value"].count("<image>") for m in r["conversation"]) == len(r["images"])
    w1 = open(write_vl_chat_wds(str(tmp_path / "1.tar"), a), "rb").read()
    w2 = open(write_vl_chat_wds(str(tmp_path / "2.tar"), b), "rb").read()
    assert w1 == w2
    with pytest.raises(ValueError, match="form"):
        generate_vl_conversations(1, 0, form="llava")
    write_vl_chat_parquet(str(tmp_path / "x.parquet"), a, row_group_size=4, hf_struct=True)
    assert pq.ParquetFile(str(tmp_path / "x.parquet")).metadata.num_row_groups == 3
