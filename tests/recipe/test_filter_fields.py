"""[[filters]] of kind "field" (a record's metadata against a threshold or a set) and "stateful"
(a user class keeping state across its lane): elastic, resumable, counted, fingerprinted."""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import sysconfig
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.data import BUNDLED_TOKENIZER
from zephon.data.datasets import read_fields
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.engine.testing import ListSource, check_node
from zephon.nodes import Carried, FilterCounter, FilteredDoc, FilterRule, TokDoc, WorkItem
from zephon.recipe import RecipeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LANGS = ("en", "de", "fr")


def _records(n: int = 240) -> list[dict]:
    """Chunks of the standard library's sources (real text), each with a score and a language."""
    out: list[dict] = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:40]:
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
        stem = os.path.basename(path)[:-3]
        for lo in range(0, min(len(lines), 120), 12):
            text = f"{stem} " + "\n".join(lines[lo : lo + 12])
            if not text.strip():
                continue
            crc = zlib.crc32(text.encode())
            out.append({"text": text, "score": (crc % 100) / 100, "lang": LANGS[crc % 3], "id": len(out)})
            if len(out) == n:
                return out
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    recs = _records()
    os.makedirs(root / "web")
    for i in range(2):
        with open(root / "web" / f"{i}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs[i::2])
    os.makedirs(root / "code")
    part = recs[::3]
    table = pa.table({"text": [r["text"] for r in part], "score": [r["score"] for r in part]})
    pq.write_table(table, root / "code" / "0.parquet", row_group_size=16)
    return root


def recipe_dict(root, filters=(), **web):
    return {
        "seed": 5,
        "lanes": 4,
        "seq_len": 64,
        "global_batch_size": 8,
        "cache_dir": str(root / "cache"),
        "tokenizer": {"path": BUNDLED_TOKENIZER},
        "datasets": [
            {"name": "web", "path": "web/*.jsonl", "format": "jsonl", "weight": 0.6, **web},
            {"name": "code", "path": "code/*.parquet", "format": "parquet", "weight": 0.4},
        ],
        "pack": {"flush_every": 16},
        "shuffle": {"buffer": 4},
        "filters": list(filters),
    }


FIELD = [
    {"name": "good", "kind": "field", "field": "score", "min": 0.3},
    {"name": "lang", "kind": "field", "field": "lang", "in": ["en", "de"], "datasets": ["web"]},
]
STATEFUL = [{"name": "per-source", "kind": "stateful", "function": "user_filters:AtMostPerSource", "params": {"n": 1}}]


def make(root, filters=(), **web):
    return Recipe.from_dict(recipe_dict(root, filters, **web), str(root))


def run(recipe, world, steps, workers=WorkerConfig(0), state=None, docs=None, metrics=None):
    with recipe.global_loader(world, workers=workers, prefetch=0) as g:
        if state is not None:
            g.load_state_dict(state)
        out = []
        for _ in range(steps):
            b = next(g)
            out.append(batch_sha256(b))
            if docs is not None:
                docs.update(tuple(seg[:3]) for row in b["provenance"] for seg in row if seg[0] >= 0)
        if metrics is not None:
            for r in g.routers:
                for k, n in r.summary_metrics()["FilterCounter"]["filtered"].items():
                    metrics[k] = metrics.get(k, 0) + n
        return out, decode_state(encode_state(g.state_dict()))


def test_read_fields_jsonl_and_parquet(root):
    r = make(root)
    web, code = r.indexes
    got = read_fields(web, 0, [2, 0], ("score", "lang", "nope"))
    assert set(got[0]) == {"score", "lang"} and got[0]["lang"] in LANGS
    assert read_fields(code, 0, [17, 1], ("score",))[0]["score"] == pytest.approx(_records()[::3][17]["score"])


def test_field_filters_keep_only_matching_records_elastic_and_resumable(root):
    base, f = make(root), make(root, FIELD)
    ref, _ = run(f, 1, 10)
    assert ref != run(base, 1, 10)[0]
    assert run(f, 4, 10, WorkerConfig(2, "thread"))[0] == ref
    assert run(f, 2, 10, WorkerConfig(2, "process"))[0] == ref
    head, state = run(f, 2, 4)
    assert head + run(f, 4, 6, WorkerConfig(1, "thread"), state=state)[0] == ref
    docs: set = set()
    counted: dict = {}
    run(f, 2, 10, docs=docs, metrics=counted)
    for d, s, rec in docs:  # every delivered document satisfies the rules
        fields = read_fields(f.indexes[d], s, [rec], ("score", "lang"))[0]
        assert fields["score"] >= 0.3 and (d == 1 or fields["lang"] in ("en", "de"))
    assert counted["good/web"] > 0 and counted["good/code"] > 0 and counted["lang/web"] > 0
    assert counted["lang/code"] == 0


def test_field_filter_lane_check_node(root):
    f = make(root, FIELD)
    ctx = f.lane_context(1, WorkerConfig(0))
    check_node(lambda: f.build_lane(ctx), max_steps=8, every=2, compare_steps=3)


def test_field_filters_fingerprint_and_estimate(root):
    base, f = make(root), make(root, FIELD)
    other = make(root, [dict(FIELD[0], min=0.31), FIELD[1]])
    assert len({base.fingerprint, f.fingerprint, other.fingerprint}) == 3
    assert f.data_definition()["filters"][1]["params"] == {"field": "lang", "in": ["de", "en"]}
    # token shares are estimated after filtering: the kept share scales the BOS/EOS per record
    assert f.estimates["web"].tokens_per_record < base.estimates["web"].tokens_per_record


def test_missing_field_names_file_record_and_fix(root):
    f = [{"name": "q", "kind": "field", "field": "quality", "max": 3, "datasets": ["web"]}]
    with pytest.raises(
        RecipeError, match=r"filter 'q' \(field 'quality'\): the field is missing .* file '.*jsonl', line"
    ):
        make(root, f).prepare()
    wrong = [{"name": "q", "kind": "field", "field": "lang", "max": 3, "datasets": ["web"]}]
    with pytest.raises(RecipeError, match=r"the value '(en|de|fr)' is a str, not a number, on dataset 'web'.*on_error"):
        make(root, wrong).prepare()


def test_missing_field_is_a_counted_skip_under_on_error_skip(root):
    f = [{"name": "q", "kind": "field", "field": "score", "min": 0.3}]
    os.makedirs(root / "mixed", exist_ok=True)
    with open(root / "mixed" / "0.jsonl", "w") as out:
        for i, r in enumerate(_records(80)):
            out.write(json.dumps({"text": r["text"]} if i % 4 == 0 else r) + "\n")
    raw = recipe_dict(root, f, path="mixed/*.jsonl", on_error="skip", max_skipped_fraction=0.5)
    r = Recipe.from_dict(raw, str(root))
    with r.global_loader(1, prefetch=0) as g:
        for _ in range(8):
            next(g)
        skips = [m for ms in g.routers[0].lane_metrics().values() for m in ms if m["node"] == "SkipCounter"]
    assert sum(m["skipped"]["web"] for m in skips) > 0
    # the skips are counted under one reason class (the field is missing), not one per line
    reasons = {b["reason"] for m in skips for b in m["by_file"]}
    assert len(reasons) == 1 and "missing" in reasons.pop()
    raw["datasets"][0]["on_error"] = "raise"
    del raw["datasets"][0]["max_skipped_fraction"]
    with pytest.raises(RecipeError, match=r"field is missing .*mixed/0.jsonl', line \d+; fix"):
        Recipe.from_dict(raw, str(root)).prepare()  # met on the sample that estimates the tokens


@pytest.mark.parametrize(
    "entry,message",
    [
        ({"kind": "field", "field": "score"}, "needs min and/or max"),
        ({"kind": "field", "field": "score", "min": 1, "in": [1]}, "needs min and/or max"),
        ({"kind": "field", "field": "score", "min": "a"}, "min must be a number"),
        ({"kind": "field", "field": "lang", "in": []}, "in must be a non-empty list"),
        ({"kind": "field", "min": 1}, "needs field ="),
        ({"kind": "field", "field": "s", "min": 2, "max": 1}, "max = 1 is below min = 2"),
        ({"kind": "stateful", "function": "user_filters:NoLoad"}, r"has no method load\(\)"),
        ({"kind": "stateful", "function": "user_filters:has_word"}, "is not a class"),
        ({"kind": "stateful", "function": "user_filters:AtMostPerSource", "params": {"m": 1}}, "raised TypeError"),
    ],
)
def test_bad_field_and_stateful_entries_are_refused(root, entry, message):
    with pytest.raises(RecipeError, match=message):
        make(root, [entry])


def test_stateful_filter_elastic_resumable_and_counted(root):
    base, f = make(root), make(root, STATEFUL)
    ref, _ = run(f, 1, 10)
    assert ref != run(base, 1, 10)[0]
    assert run(f, 4, 10, WorkerConfig(2, "thread"))[0] == ref
    assert run(f, 2, 10, WorkerConfig(2, "process"))[0] == ref
    head, state = run(f, 4, 5)
    assert head + run(f, 1, 5, state=state)[0] == ref
    lanes = [state[k] for k in state if k.startswith("lane_")]
    assert "users" in json.dumps(lanes)  # the instances' states travel in the lane checkpoints
    counted: dict = {}
    run(f, 2, 10, metrics=counted)
    assert counted["per-source/web"] + counted["per-source/code"] > 0
    assert f.data_definition()["filters"][0]["code"]


def test_stateful_filter_lane_check_node(root):
    f = make(root, STATEFUL)
    ctx = f.lane_context(2, WorkerConfig(0))
    check_node(lambda: f.build_lane(ctx), max_steps=8, every=2, compare_steps=3)


@pytest.mark.parametrize(
    "cls,message",
    [
        ("Forgetful", r"is not deterministic or does not restore exactly: .* dataset 'web'"),
        ("NotJson", r"its state is not JSON"),
        ("Counts", r"returned a int, not a bool, on dataset 'web', file '.*jsonl', line"),
    ],
)
def test_stateful_errors_name_the_class_and_record(root, cls, message):
    entry = {"name": "s", "kind": "stateful", "function": f"user_filters:{cls}", "params": {"n": 1}}
    with pytest.raises(RecipeError, match=r"stateful filter 's' \('user_filters:" + cls + r"'\)") as e:
        make(root, [entry]).prepare()
    assert re.search(message, str(e.value)), str(e.value)


def _docs():
    """Whole and multi-part documents, some carrying their text for a stateful rule."""
    out = []
    for i in range(30):
        parts = 2 if i % 5 == 0 else 1
        for part in range(parts):
            item = WorkItem(i % 2, 0, i, 0, i, part, parts)
            doc = TokDoc(np.arange(i % 4 + 1, dtype=np.int32), i % 2, item)
            if i % 7 == 3:
                out.append(FilteredDoc(np.zeros(0, np.int32), i % 2, item, "len"))
            elif part == 0:
                out.append(Carried(doc, f"src{i % 3} text {i}"))
            else:
                out.append(doc)
    return out


def test_filter_counter_with_stateful_rule_check_node():
    rule = FilterRule("per", "stateful", None, {"n": 2}, "user_filters:AtMostPerSource")

    def node():
        return FilterCounter(ListSource(_docs()), rules=["len", "per"], dataset_names=["a", "b"], stateful=[rule])

    check_node(node)
    n = node()
    got = list(n)
    kept = {(d.item.record, d.item.part) for d in got}
    assert all((r, 1) in kept for r, p in kept if p == 0 and r % 5 == 0)  # parts follow their first part
    assert n.counts()["per"]["a"] + n.counts()["per"]["b"] == 26 - 6  # 26 carried, 3 sources x 2 kept


def test_readme_field_and_stateful_example_is_a_valid_recipe(root):
    """The TOML of the docs' "Metadata fields and stateful user functions" section validates."""
    readme = open(
        os.path.join(os.path.dirname(__file__), "..", "..", "docs", "filters-and-forks.md"), encoding="utf-8"
    ).read()
    section = readme.split("### Metadata fields and stateful user functions", 1)[1]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    r = make(root, tomllib.loads(example)["filters"])
    assert [f.kind for f in r.filters] == ["field", "field", "stateful"]
    assert r.prepare().fingerprint
