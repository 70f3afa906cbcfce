"""[[filters]] in a recipe: built-in rules and user functions, elastic, resumable, counted, fingerprinted."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from text_fixtures import write_corpus, write_recipe

from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.engine.testing import ListSource, check_node
from zephon.nodes import FilterCounter, FilteredDoc, FilterError, TokDoc, WorkItem, duplicate_records
from zephon.recipe import RecipeError
from zephon.tools.ledger import RecipeSteps
from zephon.tools.ledger_diff import diff

FILTERS = """
[[filters]]
name = "no-the"
kind = "regex"
pattern = "\\\\bthe\\\\b"
action = "exclude"
datasets = ["web"]

[[filters]]
name = "long"
kind = "length"
unit = "tokens"
max = 300
datasets = ["web", "code"]

[[filters]]
kind = "dedup"

[[filters]]
name = "caps"
kind = "transform"
function = "user_filters:upper"
datasets = ["code"]
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(str(root))
    return str(root)


@pytest.fixture(scope="module")
def base(corpus):
    return Recipe.from_toml(write_recipe(corpus))


@pytest.fixture(scope="module")
def filtered(corpus):
    return Recipe.from_toml(write_recipe(corpus, "filtered.toml", extra=FILTERS))


def run(recipe, world, steps, workers=WorkerConfig(0), state=None, metrics=None):
    with recipe.global_loader(world, workers=workers, prefetch=0) as g:
        if state is not None:
            g.load_state_dict(state)
        out = [batch_sha256(next(g)) for _ in range(steps)]
        if metrics is not None:
            for r in g.routers:
                for k, n in r.summary_metrics()["FilterCounter"]["filtered"].items():
                    metrics[k] = metrics.get(k, 0) + n
        return out, decode_state(encode_state(g.state_dict()))


def test_filters_change_batches_and_are_elastic_and_resumable(base, filtered):
    ref, _ = run(filtered, 1, 12)
    assert ref != run(base, 1, 12)[0]
    assert run(filtered, 4, 12, WorkerConfig(2, "thread"))[0] == ref
    assert run(filtered, 8, 12, WorkerConfig(2, "process"))[0] == ref
    head, state = run(filtered, 2, 5)
    tail, _ = run(filtered, 4, 7, WorkerConfig(1, "thread"), state=state)
    assert head + tail == ref
    counted: dict[str, int] = {}
    run(filtered, 2, 12, metrics=counted)  # counted per filter and dataset, summed over the lanes
    assert len(counted) == 4 * 3
    assert counted["no-the/web"] > 0 and counted["no-the/code"] == counted["no-the/books"] == 0
    assert counted["long/web"] + counted["long/code"] > 0 and counted["long/books"] == 0


def test_no_filters_no_change(base):
    assert not base.filters
    assert "filters" not in base.data_definition()


def test_fingerprint_holds_each_rule(corpus, filtered, base):
    other = Recipe.from_toml(write_recipe(corpus, "other.toml", extra=FILTERS.replace("max = 300", "max = 301")))
    fps = {base.fingerprint, filtered.fingerprint, other.fingerprint}
    assert len(fps) == 3
    d = filtered.data_definition()["filters"]
    assert [f["kind"] for f in d] == ["regex", "length", "dedup", "transform"]
    assert d[3]["function"] == "user_filters:upper" and len(d[3]["code"]) == 16


def test_token_shares_estimated_after_filtering(base, filtered):
    assert filtered.estimates["web"].tokens_per_byte < base.estimates["web"].tokens_per_byte
    assert filtered.estimates["web"].tokens_per_record < base.estimates["web"].tokens_per_record


def test_transform_reaches_the_tokenizer(filtered):
    p = filtered.prepare()
    src = p.plan.lane(0)
    items = [it for it in (next(src) for _ in range(60)) if it.dataset == 1][:4]
    docs = p.pipeline(items)
    tok = p.tokenizer
    for it, doc in zip(items, docs):
        if isinstance(doc, FilteredDoc):
            continue
        text = p.indexes[1].read(it.shard, [it.record])[0]
        assert doc.tokens.tolist() == tok.encode_batch([text.upper()])[0].tolist()


def test_filter_counter_check_node():
    docs = []
    for i in range(40):
        item = WorkItem(i % 2, 0, i, 0, i)
        if i % 3 == 0:
            docs.append(FilteredDoc(np.zeros(0, np.int32), i % 2, item, "r1" if i % 2 else "r0"))
        else:
            docs.append(TokDoc(np.arange(i % 5 + 1, dtype=np.int32), i % 2, item))
    check_node(lambda: FilterCounter(ListSource(docs), rules=["r0", "r1"], dataset_names=["a", "b"]))
    node = FilterCounter(ListSource(docs), rules=["r0", "r1"], dataset_names=["a", "b"])
    assert len(list(node)) == 26 and node.counts() == {"r0": {"a": 7, "b": 0}, "r1": {"a": 0, "b": 7}}


def test_lane_with_filters_check_node(filtered):
    ctx = filtered.lane_context(3, WorkerConfig(0))
    check_node(lambda: filtered.build_lane(ctx), max_steps=12, every=3, compare_steps=3)


def test_dedup_keeps_the_first_copy_in_file_order(tmp_path):
    texts = ["alpha beta", "gamma", "alpha beta", "delta", "gamma", "alpha beta"]
    shards = [texts[:3], texts[3:]]
    dups = duplicate_records(lambda s: shards[s], 2, lambda s, r, t: t)
    assert dups == {(0, 2), (1, 1), (1, 2)}
    os.makedirs(tmp_path / "d")
    for i, part in enumerate(shards):
        with open(tmp_path / "d" / f"{i}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in part)
    raw = _tiny(tmp_path) | {"filters": [{"kind": "dedup"}]}
    r = Recipe.from_dict(raw, str(tmp_path))
    got = []
    with r.global_loader(2) as g:
        for b in g:
            got += [tuple(seg[:3]) for row in b["provenance"] for seg in row if seg[0] >= 0]
    assert sorted(set(got)) == [(0, 0, 0), (0, 0, 1), (0, 1, 0)]


def _tiny(tmp_path, **extra):
    from zephon.data import BUNDLED_TOKENIZER

    return {
        "seed": 3,
        "lanes": 2,
        "seq_len": 16,
        "global_batch_size": 2,
        "cache_dir": str(tmp_path / "cache"),
        "tokenizer": {"path": BUNDLED_TOKENIZER},
        "datasets": [{"name": "d", "path": "d/*.jsonl", "policy": "stop", **extra}],
        "shuffle": {"buffer": 1},
    }


def _words(tmp_path, n=40):
    os.makedirs(tmp_path / "d", exist_ok=True)
    with open(tmp_path / "d" / "0.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"record {i} has some words e"}) + "\n" for i in range(n))


@pytest.mark.parametrize(
    "function,kind,message",
    [
        ("user_filters:explode", "function", r"filter 'f' \(function 'user_filters:explode'\) raised KeyError"),
        ("user_filters:wrong_type", "function", r"returned a int, not a bool"),
        ("user_filters:has_word", "transform", r"returned a bool, not a str"),
        (
            "user_filters:flaky",
            "function",
            r"is not deterministic: called twice on dataset 'd', file '.*0.jsonl', line",
        ),
    ],
)
def test_user_function_errors_name_function_and_record(tmp_path, function, kind, message):
    _words(tmp_path)
    raw = _tiny(tmp_path) | {"filters": [{"name": "f", "kind": kind, "function": function}]}
    with pytest.raises(RecipeError, match=message) as e:
        Recipe.from_dict(raw, str(tmp_path)).prepare()
    assert "line" in str(e.value) and "0.jsonl" in str(e.value)


def test_user_function_error_in_a_worker_names_the_record(tmp_path):
    """A failure the pre-run sample did not meet is raised by the worker, naming the record."""
    os.makedirs(tmp_path / "d")
    with open(tmp_path / "d" / "0.jsonl", "w") as f:
        f.writelines(json.dumps({"text": "zzz" if i else "one e"}) + "\n" for i in range(50))
    raw = _tiny(tmp_path) | {"filters": [{"name": "f", "kind": "function", "function": "user_filters:explode"}]}
    raw["mixing"] = {"estimate_samples": 1}
    r = Recipe.from_dict(raw, str(tmp_path))
    message = r"filter 'f' .* raised KeyError: 'no e allowed' on dataset 'd', file .*line 1"
    with r.global_loader(1, workers=WorkerConfig(2, "thread")) as g, pytest.raises(FilterError, match=message):
        list(g)


@pytest.mark.parametrize(
    "entry,message",
    [
        ({"kind": "sample"}, "kind must be one of"),
        ({"kind": "regex", "pattern": "("}, "is not a regular expression"),
        ({"kind": "length", "min": 5, "max": 2}, "max = 2 is below min = 5"),
        ({"kind": "length", "unit": "words"}, 'unit must be "chars" or "tokens"'),
        ({"kind": "dedup", "datasets": ["nope"]}, "datasets names 'nope'"),
        ({"kind": "dedup", "pattern": "x"}, r"unknown key 'pattern' in \[\[filters\]\] #1 \(kind = 'dedup'\)"),
        ({"kind": "function", "function": "no_such_module_zz:f"}, "cannot import module 'no_such_module_zz'"),
        ({"kind": "function", "function": "user_filters:nope"}, "has no 'nope'"),
    ],
)
def test_bad_filter_entries_are_refused(tmp_path, entry, message):
    with pytest.raises(RecipeError, match=message):
        Recipe.from_dict(_tiny(tmp_path) | {"filters": [entry]}, str(tmp_path))


def test_filter_dropping_everything_is_refused(tmp_path):
    _words(tmp_path)
    raw = _tiny(tmp_path) | {"filters": [{"kind": "length", "min": 10_000}]}
    with pytest.raises(RecipeError, match="drop all 40 records of dataset 'd'"):
        Recipe.from_dict(raw, str(tmp_path)).prepare()


def test_ledger_diff_names_documents_only_in_each_side(corpus, base):
    one = FILTERS.split("[[filters]]")[1]
    a = Recipe.from_toml(write_recipe(corpus, "a.toml", extra="[[filters]]" + one))
    d = diff(RecipeSteps(base), RecipeSteps(a), steps=6)
    text = "\n".join(d.lines)
    assert d.first is not None
    assert "recipe difference: filters" in text
    assert "only in A:" in text and "only in B:" in text


def test_readme_filters_example_is_a_valid_recipe(corpus):
    """The TOML of the docs' "Filters and transforms" section, added to a recipe, validates and prepares."""
    readme = open(
        os.path.join(os.path.dirname(__file__), "..", "..", "docs", "filters-and-forks.md"), encoding="utf-8"
    ).read()
    section = readme.split("## Filters and transforms", 1)[1]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    r = Recipe.from_toml(write_recipe(corpus, "readme.toml", extra=example))
    assert [f.kind for f in r.filters] == ["length", "regex", "dedup", "function"]
    assert r.filters[3].params == {"word": "the"} and r.prepare().fingerprint
