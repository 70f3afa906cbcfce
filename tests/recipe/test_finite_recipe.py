"""Finite recipes (every dataset ``policy = "stop"``): the end is a global step boundary.

The ``end`` key and its default, the same steps and rows on W = 1, 2, 4 with ``state_dict()``
at the end, every document once with ``end = "pad"``, the per-lane counts cached on disk (keyed
by the fingerprint) and carried in checkpoints, image-text recipes too.
"""

from __future__ import annotations

import collections
import glob
import json
import os

import numpy as np
import pytest
from text_fixtures import write_corpus, write_recipe
from vl_fixtures import vl_config, write_vl_root

import zephon.recipe.build as build_module
from zephon import Recipe, RecipeError, StateError, batch_sha256
from zephon.engine.checkpoint import decode_state, encode_state

STOP = 'policy = "stop"\n'


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("finite")
    write_corpus(str(root))
    return str(root)


def finite(corpus, end=None, **replace):
    path = write_recipe(
        corpus,
        f"finite_{end}.toml",
        buffer=4,
        web_extra=STOP,
        code_extra=STOP,
        books_extra=STOP,
    )
    r = Recipe.from_toml(path)
    if end is not None:
        replace["end"] = end
    return r.replace(**replace) if replace else r


def run_to_end(recipe, W, state=None, prefetch=None):
    kw = {} if prefetch is None else {"prefetch": prefetch}
    with recipe.global_loader(W, **kw) as g:
        if state is not None:
            g.load_state_dict(state)
        batches = []
        while True:
            try:
                batches.append(next(g))
            except StopIteration:
                break
        with pytest.raises(StopIteration):  # and stays ended
            next(g)
        return batches, decode_state(encode_state(g.state_dict())), g.end


def test_end_key_and_default(corpus):
    r = finite(corpus)
    assert r.spec.finite and r.spec.end == "pad" and r.data_definition()["end"] == "pad"
    assert finite(corpus, "drop").spec.end == "drop"
    assert finite(corpus, "drop").fingerprint != r.fingerprint  # the end is part of the data definition
    infinite = Recipe.from_toml(write_recipe(corpus, "repeat.toml", buffer=4))
    assert infinite.spec.end is None and not infinite.spec.finite
    assert "end" not in infinite.data_definition()  # fingerprints of repeating recipes are unchanged
    with pytest.raises(RecipeError, match=r"end = 'pad' applies to a finite recipe .* dataset 'web' has policy"):
        infinite.replace(end="pad")
    with pytest.raises(RecipeError, match="end = 'truncate' is not valid; use one of 'drop', 'pad'"):
        r.replace(end="truncate")


@pytest.mark.parametrize("end", ["pad", "drop"])
def test_the_same_steps_on_every_world_size_with_state_at_the_end(corpus, end):
    r = finite(corpus, end)
    ref, ref_state, lane_end = run_to_end(r, 1)
    counts = list(lane_end.lane_steps)
    assert len(set(counts)) > 1, "the lanes of this corpus have different lengths"
    assert len(ref) == (max(counts) if end == "pad" else min(counts))
    hashes = [batch_sha256(b) for b in ref]
    for W in (2, 4):
        batches, state, _ = run_to_end(r, W, prefetch=2 if W == 2 else 0)
        assert [batch_sha256(b) for b in batches] == hashes, f"W={W}"
        assert state["step"] == len(ref) and state["shared"]["end"] == {"mode": end, "lane_steps": counts}
    # saved at the end, resumed on W=4: stays ended
    batches, state, _ = run_to_end(r, 4, state=ref_state)
    assert batches == [] and state["step"] == len(ref)


def test_pad_delivers_every_document_once_and_drop_fewer(corpus):
    r = finite(corpus, "pad")
    r = r.replace(pack={**vars(r.spec.pack), "labels": "row"})  # a row's last token is read from its last label
    p = r.prepare()
    expected = collections.Counter()
    for ix in p.indexes:
        for s in range(len(ix.shards)):
            for toks in p.tokenizer.encode_batch(ix.read(s, list(range(ix.shards[s].num_records)))):
                expected.update(toks.tolist())

    def delivered(batches):
        got = collections.Counter()
        for b in batches:
            m = b["document_ids"] >= 0
            got.update(b["input"][m].tolist())
            for i in range(len(b["input"])):  # a full row's last token is only a label
                if m[i, -1] and b["labels"][i, -1] != -100:
                    got[int(b["labels"][i, -1])] += 1
        return got

    batches, _, end = run_to_end(r, 2)
    assert delivered(batches) == expected  # two rows per lane: the last partial micro-batch is padded, not dropped
    pad_rows = sum(int((b["document_ids"] < 0).all(axis=1).sum()) for b in batches)
    assert pad_rows >= end.unused * r.rows_per_lane
    last = batches[-1]  # the shortest lanes are padding rows by then: no labels, no provenance
    assert (last["labels"] == -100).all(axis=1).sum() >= r.rows_per_lane <= last["provenance"].count(())
    dropped, _, _ = run_to_end(finite(corpus, "drop"), 2)
    assert sum(delivered(dropped).values()) < sum(expected.values())


def test_counts_are_cached_by_fingerprint_and_carried_in_checkpoints(corpus, monkeypatch):
    r = finite(corpus, "drop")
    cache = r.spec.cache_dir
    for f in glob.glob(os.path.join(cache, "lane_steps-*")):
        os.remove(f)
    _, state, end = run_to_end(r, 2)
    files = glob.glob(os.path.join(cache, "lane_steps-*.json"))
    assert len(files) == 1
    with open(files[0]) as f:
        record = json.load(f)
    assert record["lane_steps"] == list(end.lane_steps) and record["fingerprint"] == r.fingerprint
    assert record["count_seconds"] >= 0

    def no_counting(*a, **k):
        raise AssertionError("counted again")

    monkeypatch.setattr(build_module, "count_lane_steps", no_counting)
    # a new Recipe object (a new process) reads the cache ...
    again = finite(corpus, "drop")
    assert run_to_end(again, 4)[2] == end
    # ... and with the cache gone, a resume takes the counts from the checkpoint
    os.remove(files[0])
    with again.global_loader(2) as g:
        g.load_state_dict(state)
        assert g.end == end
        with pytest.raises(StopIteration):
            next(g)
    # a corrupt cache file is recounted, not trusted
    with open(files[0], "w") as f:
        f.write('{"lane_steps": [1, 2]}')
    monkeypatch.undo()
    assert run_to_end(finite(corpus, "drop"), 1)[2] == end


def test_a_checkpoint_of_the_other_end_mode_is_refused(corpus):
    _, state, _ = run_to_end(finite(corpus, "pad"), 1)
    with finite(corpus, "drop").global_loader(1) as g, pytest.raises(StateError, match="end = 'pad'"):
        g.load_state_dict(state)


def test_image_text_recipe_ends_on_every_world_size(tmp_path):
    root = write_vl_root(tmp_path, seed=1, text_scale=0.005, n_wds=24, n_parquet=12, n_interleaved=8)
    cfg = vl_config(root)
    for d in cfg["datasets"]:
        d["policy"] = "stop"
    r = Recipe.from_dict(cfg, root)
    ref, _, end = run_to_end(r, 1)
    assert end.mode == "pad" and len(ref) == end.steps
    assert [batch_sha256(b) for b in run_to_end(r, 2)[0]] == [batch_sha256(b) for b in ref]
    # an ended lane's padding micro-batch has the fields and dtypes of a real one
    real = next(iter(r.build_lane(r.lane_context(0))))
    pad = build_module.pad_item(r.prepare(), 0)
    assert sorted(pad) == sorted(real)
    for k, v in real.items():
        if isinstance(v, np.ndarray):
            assert pad[k].dtype == v.dtype and pad[k].shape[1:] == v.shape[1:], k
