"""Tests for zephon.tools.synth: determinism, document statistics, writers, the demo corpus."""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from zephon.data import BUNDLED_TOKENIZER
from zephon.tools import synth
from zephon.tools.synth import (
    generate_documents,
    make_demo_corpus,
    write_jsonl,
    write_parquet,
    write_text_files,
    write_text_lines,
)

BUNDLED = os.path.join(BUNDLED_TOKENIZER, "tokenizer.json")

# Pinned outputs: an accidental change to the generator fails here. If the change is on
# purpose, bump synth.text._GEN_VERSION and re-pin.
PINNED = {
    ("web", 50): "0a64f9068ca223304623f9f16bdebe81e093d845aac0082c23cc249f2d6d457f",
    ("code", 20): "c8e4009568a47361d6eb7a1aae1fa984e3cfd9125f5c66ad978c2dc15f86256c",
    ("books", 20): "9387c8e43577261dab01ddd5e9d2469cb12a6c42782d2464063ab77785f36e93",
}


def _sha(docs: list[str]) -> str:
    return hashlib.sha256("\x00".join(docs).encode("utf-8")).hexdigest()


@pytest.mark.parametrize("style,n", sorted(PINNED))
def test_pinned_and_repeatable(style, n):
    a = generate_documents(style, n, seed=0)
    b = generate_documents(style, n, seed=0)
    assert _sha(a) == _sha(b)
    assert _sha(a) == PINNED[(style, n)]


def test_same_in_a_fresh_interpreter():
    """No hidden dependence on process state (hash seed, caches, import order)."""
    code = (
        "import hashlib; from zephon.tools.synth import generate_documents as g; "
        "print(hashlib.sha256('\\x00'.join(g('web', 50, 0)).encode()).hexdigest())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == PINNED[("web", 50)]


def test_prefix_stable_and_seeds_differ():
    assert generate_documents("web", 30, 3) == generate_documents("web", 60, 3)[:30]
    assert generate_documents("code", 10, 3) == generate_documents("code", 20, 3)[:10]
    assert generate_documents("web", 10, 1) != generate_documents("web", 10, 2)
    assert generate_documents("web", 0, 0) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown style"):
        generate_documents("poetry", 3, 0)
    with pytest.raises(ValueError):
        generate_documents("web", -1, 0)


def test_web_statistics():
    docs = generate_documents("web", 1000, seed=7)
    words = np.array([len(d.split()) for d in docs])
    assert 110 <= np.median(words) <= 200
    assert (words > 2000).sum() >= 5  # some long documents of several thousand words
    assert words.max() > 3000
    assert all(d and d == d.strip() for d in docs)
    assert any("\n\n" in d for d in docs)  # paragraphs


def test_books_and_code_statistics():
    books = generate_documents("books", 150, seed=7)
    assert 600 <= np.median([len(d.split()) for d in books]) <= 1000
    code = generate_documents("code", 200, seed=7)
    joined = "\n".join(code)
    for needle in ("def ", "    return ", "class ", "import ", " = ", "):"):
        assert needle in joined

    def symbols(text: str) -> float:
        return sum(c in "()[]{}:=,._" for c in text) / len(text)

    web = "\n".join(generate_documents("web", 100, seed=7))
    assert symbols(joined) > 3 * symbols(web)


def test_styles_differ_in_tokens_per_byte():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(BUNDLED)
    tpb = {}
    for style in synth.STYLES:
        docs = generate_documents(style, 150, seed=11)
        n_tok = sum(len(e) for e in tok.encode_batch(docs, add_special_tokens=False))
        tpb[style] = n_tok / sum(len(d.encode("utf-8")) for d in docs)
    assert tpb["code"] > 1.08 * tpb["web"], tpb
    assert tpb["books"] < 0.99 * tpb["web"], tpb


def test_generation_speed():
    import time

    t = time.perf_counter()
    generate_documents("web", 2000, seed=5)
    assert time.perf_counter() - t < 3.0  # ~0.35 s here; generous for slow CI


# ----------------------------------------------------------------------------- writers
DOCS = ["first doc\nwith a newline", "second \u00e9t\u00e9 \U0001f600", "", "x" * 1000, "a\r\nb\rc"]


@pytest.mark.parametrize("compression", [None, "gz", "zst"])
def test_write_jsonl(tmp_path, compression):
    p = tmp_path / f"d.jsonl{'' if compression is None else '.' + compression}"
    write_jsonl(p, DOCS, text_field="body", compression=compression)
    raw = p.read_bytes()
    if compression == "gz":
        data = gzip.decompress(raw)
    elif compression == "zst":
        import zstandard

        data = zstandard.ZstdDecompressor().stream_reader(raw).read()
    else:
        data = raw
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines()]
    assert [r["body"] for r in rows] == DOCS
    assert [r["id"] for r in rows] == list(range(len(DOCS)))
    # reproducible bytes (gzip header has mtime 0 and no file name)
    p2 = tmp_path / "again"
    write_jsonl(p2, DOCS, text_field="body", compression=compression)
    assert p2.read_bytes() == raw


def test_write_jsonl_bad_compression(tmp_path):
    with pytest.raises(ValueError, match="compression"):
        write_jsonl(tmp_path / "x", DOCS, compression="bz2")


def test_write_parquet_row_groups(tmp_path):
    import pyarrow.parquet as pq

    docs = generate_documents("code", 25, seed=1)
    p = tmp_path / "c.parquet"
    write_parquet(p, docs, text_field="content", row_group_size=10)
    f = pq.ParquetFile(p)
    assert f.num_row_groups == 3
    assert [f.metadata.row_group(i).num_rows for i in range(3)] == [10, 10, 5]
    assert f.read().column("content").to_pylist() == docs


def test_write_text_lines(tmp_path):
    p = tmp_path / "t.txt"
    write_text_lines(p, DOCS)
    lines = p.read_bytes().decode("utf-8").split("\n")
    assert lines[-1] == ""
    lines = lines[:-1]
    assert len(lines) == len(DOCS)
    assert lines[0] == "first doc with a newline"
    assert lines[4] == "a b c"
    assert all("\r" not in line for line in lines)


def test_write_text_files(tmp_path):
    paths = write_text_files(tmp_path / "docs", DOCS)
    assert len(paths) == len(DOCS)
    assert [open(p, encoding="utf-8", newline="").read() for p in paths] == DOCS
    assert sorted(paths) == paths


# ----------------------------------------------------------------------------- demo corpus
def test_make_demo_corpus_small_and_idempotent(tmp_path):
    import pyarrow.parquet as pq

    root = tmp_path / "demo"
    pats = make_demo_corpus(str(root), seed=0, scale=0.05)
    assert set(pats) == {"web", "code", "books"}
    files = {k: sorted(glob.glob(v)) for k, v in pats.items()}
    assert len(files["web"]) >= 2 and len(files["code"]) >= 2 and len(files["books"]) >= 2
    for f in files["web"]:
        with open(f, encoding="utf-8") as fh:
            assert all(json.loads(line)["text"] for line in fh)
    for f in files["code"]:
        assert pq.ParquetFile(f).num_row_groups >= 2
    n_books = sum(len(open(f, encoding="utf-8").read().splitlines()) for f in files["books"])
    assert n_books == synth.corpora._demo_plan(0, 0.05)["books"]["docs"]

    stamp = {f: os.stat(f).st_mtime_ns for fs in files.values() for f in fs}
    assert make_demo_corpus(str(root), seed=0, scale=0.05) == pats
    assert {f: os.stat(f).st_mtime_ns for f in stamp} == stamp  # nothing rewritten

    # other parameters: rewritten, old files replaced, content changes
    before = open(files["web"][0], "rb").read()
    make_demo_corpus(str(root), seed=1, scale=0.05)
    assert open(files["web"][0], "rb").read() != before
    # a deleted shard is noticed and rewritten
    os.remove(files["code"][0])
    make_demo_corpus(str(root), seed=1, scale=0.05)
    assert os.path.exists(files["code"][0])


def test_make_demo_corpus_full_scale(tmp_path):
    pats = make_demo_corpus(str(tmp_path), seed=0)
    total = sum(os.path.getsize(f) for pat in pats.values() for f in glob.glob(pat))
    assert 5e6 <= total <= 10e6, total


def test_head_words_ship_as_package_data():
    """The word list is data (``head_words.txt``), shipped with the package: a wheel without it
    would build a different vocabulary, so pyproject must list the subpackage and the file."""
    from importlib import resources

    import tomllib

    words = resources.files("zephon.tools.synth").joinpath("head_words.txt").read_text(encoding="utf-8").split()
    assert words[:3] == ["the", "of", "and"] and len(words) == 269
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    assert "zephon.tools.synth" in setup["packages"]
    assert "*.txt" in setup["package-data"]["zephon.tools.synth"]
