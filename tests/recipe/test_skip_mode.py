"""Skip mode can deliver or fails fast: a dataset whose every sampled record is bad fails before the
run starts (naming the dataset and the reason), max_skipped is a run-wide budget that holds on every
world size, and a long bad record is one skip, read once."""

from __future__ import annotations

import json
import os

import pytest

from zephon import Recipe, RecipeError, WorkerConfig
from zephon.data.datasets import DataError
from zephon.tools.demo import TOKENIZER_DIR
from zephon.tools.synth import generate_documents


def make(root, lines, **ds):
    os.makedirs(os.path.join(root, "web"), exist_ok=True)
    with open(os.path.join(root, "web", "a.jsonl"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    mixing = ds.pop("mixing", {"split_tokens": 0})
    cfg = {
        "seed": 7,
        "lanes": ds.pop("lanes", 8),
        "seq_len": 32,
        "global_batch_size": ds.pop("global_batch_size", 8),
        "cache_dir": os.path.join(root, "cache"),
        "tokenizer": {"path": TOKENIZER_DIR},
        "datasets": [{"name": "web", "path": os.path.join(root, "web", "*.jsonl"), **ds}],
        "shuffle": {"buffer": 1},
        "mixing": mixing,
    }
    return Recipe.from_dict(cfg, root)


def lines_of(docs):
    return [json.dumps({"text": d}) for d in docs]


def to_the_end(recipe, world):
    """Iterate a policy = "stop" run to its end: (skipped in total, error or None)."""
    err = None
    with recipe.global_loader(world, workers=WorkerConfig(0)) as g:
        try:
            for _ in range(10_000):
                next(g)
        except StopIteration:
            pass
        except DataError as e:
            err = e
        skipped = sum(r.summary_metrics().get("SkipCounter", {}).get("skipped", {}).get("web", 0) for r in g.routers)
    return skipped, err


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_dataset_with_no_good_record_fails_before_the_run(tmp_path, on_error):
    r = make(str(tmp_path), lines_of(generate_documents("web", 300, seed=1)), text_field="body", on_error=on_error)
    with pytest.raises(RecipeError, match=r"dataset 'web': all 256 records sampled .* bad.*missing field 'body'"):
        r.prepare()


def owners(recipe):
    """Which lane reads each record in the first epoch."""
    plan = recipe.prepare().plan
    out = {}
    for lane in range(recipe.lanes):
        src = plan.lane(lane)
        src.reset(None)
        for it in src:
            out.setdefault(it.record, lane)
    return out


@pytest.fixture(scope="module")
def corpus():
    return [d[:200] for d in generate_documents("web", 80, seed=4)]


def break_records(root, docs, lanes_wanted, **ds):
    """A recipe whose records read by the first record of each lane in ``lanes_wanted`` are bad."""
    r = make(root, lines_of(docs), on_error="skip", policy="stop", **ds)
    own = owners(r)
    lines = lines_of(docs)
    for lane in lanes_wanted:
        rec = next(k for k, v in own.items() if v == lane)  # the lane's first record (dicts keep order)
        lines[rec] = '{"text": broken json'
    return make(root, lines, on_error="skip", policy="stop", **ds)


@pytest.mark.parametrize("world", [1, 2, 8])
def test_max_skipped_holds_run_wide_on_every_world_size(tmp_path, corpus, world):
    # max_skipped = 2 over 8 lanes: lanes 0 and 1 may skip one record each, the others none
    r = break_records(str(tmp_path), corpus, [1, 7, 2], max_skipped=2)
    skipped, err = to_the_end(r, world)
    assert err is not None and "split exactly over the 8 lanes" in str(err)
    assert skipped <= 2


@pytest.mark.parametrize("world", [1, 8])
def test_skips_within_every_lanes_share_run_to_the_end(tmp_path, corpus, world):
    r = break_records(str(tmp_path), corpus, [0, 1, 2], max_skipped=3)
    assert to_the_end(r, world) == (3, None)


def test_a_long_bad_record_is_one_skip_read_once(tmp_path, monkeypatch):
    docs = [d[:150] for d in generate_documents("web", 30, seed=6)]
    lines = lines_of(docs)
    lines[5] = '{"text": "' + "x" * 60_000  # never closed: invalid JSON, ~60 KB
    r = make(
        str(tmp_path),
        lines,
        on_error="skip",
        policy="stop",
        max_skipped=1,
        lanes=1,
        global_batch_size=1,
        mixing={"split_tokens": 132},
    )
    plan = r.prepare().plan
    # planned as many parts (fewer from data version 5: its ~60 KB weigh no tokens in the estimate)
    assert plan.datasets[0].parts(len(lines[5])) > 5
    index = r.prepare().indexes[0]
    reads = []
    real = type(index).read

    def counting(self, shard, indices):
        reads.extend(indices)
        return real(self, shard, indices)

    monkeypatch.setattr(type(index), "read", counting)
    assert to_the_end(r, 1) == (1, None)
    assert reads.count(5) == 1  # the record was read once, not once per planned part


@pytest.mark.parametrize("world", [1, 2, 8])
def test_a_bad_record_after_a_lanes_last_row_is_counted(tmp_path, corpus, world):
    # every lane's last record is bad: it produces nothing after the lane's last micro-batch, but
    # it is read and counted before the run ends (it was never pulled, so never counted)
    r = make(str(tmp_path), lines_of(corpus), on_error="skip", policy="stop", max_skipped=8)
    own = owners(r)
    lines = lines_of(corpus)
    for lane in range(8):
        lines[[k for k, v in own.items() if v == lane][-1]] = '{"text": broken json'
    r = make(str(tmp_path), lines, on_error="skip", policy="stop", max_skipped=8)
    assert to_the_end(r, world) == (8, None)
