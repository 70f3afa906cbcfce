"""Nothing changes silently: a symlinked file is read once (data version 2), a dangling link or
a loop is a clear error; bad records that estimation samples are said before the run, and skips
that pull a dataset's realized share below its declared weight are said during it; declared vs
realized shares are reported; the default fields are documented."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from zephon import Recipe, WorkerConfig
from zephon.data import DataError, index_dataset
from zephon.nodes import SkipShareWarning
from zephon.recipe import BadSamplesWarning
from zephon.tools.cli import share_report
from zephon.tools.demo import TOKENIZER_DIR

README = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"  # where the default fields are documented


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def cfg(path, **over):
    return {
        "seed": 1,
        "lanes": 2,
        "seq_len": 32,
        "global_batch_size": 4,
        "tokenizer": {"path": TOKENIZER_DIR},
        "shuffle": {"buffer": 1},
        "datasets": [{"name": "web", "path": path}],
    } | over


# -- (d) symlinks ----------------------------------------------------------------------------
def test_a_symlinked_file_is_read_once_from_version_2(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"text": f"document {i}"} for i in range(5)])
    os.symlink("a.jsonl", tmp_path / "b.jsonl")  # the same file, matched twice by the glob
    glob = str(tmp_path / "*.jsonl")
    v2 = Recipe.from_dict(cfg(glob), str(tmp_path))
    assert v2.spec.datasets[0].same_file == "once"
    assert [sh.path for sh in v2.indexes[0].shards] == [str(tmp_path / "a.jsonl")]  # the first in sorted order
    assert v2.indexes[0].num_records == 5
    v1 = Recipe.from_dict(cfg(glob, data_version=1), str(tmp_path))  # version 1 read each path
    assert v1.indexes[0].num_records == 10
    given = cfg(glob, data_version=1)
    given["datasets"][0]["same_file"] = "once"
    assert Recipe.from_dict(given, str(tmp_path)).indexes[0].num_records == 5
    assert index_dataset("web", glob, cache_dir=None, same_file="once").num_records == 5


def test_a_dangling_symlink_or_a_loop_is_a_clear_error(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    os.symlink("gone.jsonl", tmp_path / "b.jsonl")
    with pytest.raises(DataError, match=r"dangling symlink \(its target 'gone.jsonl' does not exist\)"):
        index_dataset("web", str(tmp_path / "*.jsonl"), cache_dir=None)
    os.remove(tmp_path / "b.jsonl")
    os.symlink("d.jsonl", tmp_path / "c.jsonl")
    os.symlink("c.jsonl", tmp_path / "d.jsonl")
    with pytest.raises(DataError, match="symlink loop"):
        index_dataset("web", str(tmp_path / "*.jsonl"), cache_dir=None)
    with pytest.raises(DataError, match="symlink loop"):
        index_dataset("web", str(tmp_path / "c.jsonl"), cache_dir=None)


# -- (a), (b) bad samples and realized shares ---------------------------------------------------
@pytest.fixture(scope="module")
def half_bad(tmp_path_factory):
    """Two datasets at 0.5 each; half of "caps"'s records lack the field read (the .json
    captions case: a field other than the default)."""
    root = tmp_path_factory.mktemp("halfbad")
    _jsonl(root / "web.jsonl", [{"text": f"web document number {i} " * 3} for i in range(400)])
    rows = [{"text": f"caption {i} " * 3} if i % 2 else {"caption": f"caption {i} " * 3} for i in range(400)]
    _jsonl(root / "caps.jsonl", rows)
    c = cfg(str(root / "web.jsonl"), lanes=1, global_batch_size=2)
    c["datasets"] = [
        {"name": "web", "path": str(root / "web.jsonl"), "weight": 0.5},
        {"name": "caps", "path": str(root / "caps.jsonl"), "weight": 0.5, "on_error": "skip"},
    ]
    return c, str(root)


def test_estimation_warns_before_the_run_with_counts_and_first_examples(half_bad):
    c, root = half_bad
    with pytest.warns(BadSamplesWarning) as got:
        Recipe.from_dict(c, root).prepare()
    msg = str(got[0].message)
    assert "dataset 'caps':" in msg and "records sampled for token estimation are bad" in msg
    assert "missing field 'text'" in msg and "e.g. " in msg and "text_field = 'text'" in msg
    assert "realized share" in msg and "declared weight" in msg
    assert not [w for w in got if "'web'" in str(w.message)]


def test_skips_that_shift_the_mix_are_said_and_shares_reported(half_bad):
    c, root = half_bad
    # data version 4: the skips pull the share down (version 5 plans for them: tests/recipe/test_skip_shares.py)
    recipe = Recipe.from_dict(c, root).replace(data_version=4)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with recipe.global_loader(1, workers=WorkerConfig(0)) as g:
            batches = [next(g) for _ in range(60)]
    said = [str(w.message) for w in got if issubclass(w.category, SkipShareWarning)]
    assert said and "dataset 'caps': lane 0 skipped" in said[0] and "missing field 'text'" in said[0]
    import numpy as np

    ds = np.concatenate([b["dataset"][b["dataset"] >= 0].ravel() for b in batches])
    realized = np.bincount(ds, minlength=2) / ds.size
    lines = share_report(recipe, realized, len(batches))
    assert lines[0].startswith("declared vs realized token shares: web 0.500 -> ")
    assert any("warning: dataset 'caps': realized token share" in line for line in lines), lines


# -- (e) default fields documented --------------------------------------------------------------
def test_readme_documents_every_default_field():
    text = README.read_text()
    for needle in (
        'text_field = "text"',  # text datasets
        '"caption"',  # image_text: the caption column / the .json sidecar's field
        '"texts"',  # interleaved
        "image_field",
        "`.json` sidecar",
        "same_file",
        'empty = "document"',
    ):
        assert needle in text, needle


# -- (c) an empty document is data ----------------------------------------------------------------
def _docs_of(recipe, steps):
    with recipe.global_loader(1, workers=WorkerConfig(0)) as g:
        return [next(g) for _ in range(steps)]


def test_an_empty_document_is_data_from_version_2(tmp_path):
    rows = [{"text": "alpha beta"}, {"text": ""}, {"text": "gamma"}, {"text": "   "}, {"text": "delta"}]
    _jsonl(tmp_path / "a.jsonl", rows)
    c = cfg(str(tmp_path / "a.jsonl"), lanes=1, global_batch_size=1, seq_len=64)
    c["datasets"][0]["policy"] = "stop"
    v2 = Recipe.from_dict(c, str(tmp_path))
    assert v2.spec.datasets[0].empty == "document"
    tok = v2.tokenizer
    batch = _docs_of(v2, 1)[0]
    ids = batch["input"][0].tolist() + [batch["labels"][0][-1]]
    docs = batch["document_ids"][0]
    assert len({int(d) for d in docs if d >= 0}) == 5  # five documents, the empty ones included
    runs = [[ids[i] for i in range(len(docs)) if docs[i] == d] for d in sorted({int(d) for d in docs if d >= 0})]
    assert [tok.bos_id, tok.eos_id] in runs  # the empty text: a document of its BOS and EOS
    # version 1: an empty text is a bad record; with on_error = "raise" the run stops there
    with pytest.raises(Exception, match="field 'text' is empty"):
        _docs_of(Recipe.from_dict(c | {"data_version": 1}, str(tmp_path)), 1)


def test_a_whitespace_only_text_file_is_a_document_from_version_2(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "b.txt").write_text("  \n\n")
    c = cfg(str(tmp_path / "*.txt"), lanes=1, global_batch_size=1, seq_len=64)
    c["datasets"][0] |= {"format": "text", "text_mode": "file", "policy": "stop"}
    batch = _docs_of(Recipe.from_dict(c, str(tmp_path)), 1)[0]
    assert len({int(d) for d in batch["document_ids"][0] if d >= 0}) == 2
    with pytest.raises(Exception, match="the file is empty"):
        _docs_of(Recipe.from_dict(c | {"data_version": 1}, str(tmp_path)), 1)
