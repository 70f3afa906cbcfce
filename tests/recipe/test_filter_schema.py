"""[[filters]] and [fork] are read by the recipe schema (zephon.recipe.filterspec): unknown keys are
refused like any other section's, each kind's keys come from its dataclass, the reference
documents them, and the data definition of existing entries is what it always was."""

from __future__ import annotations

import pytest

from zephon.data import BUNDLED_TOKENIZER
from zephon.recipe import RecipeError, parse_recipe
from zephon.recipe.filterspec import FILTER_TABLES, KINDS, FilterSpec, ForkSpec
from zephon.recipe.keys import keys
from zephon.recipe.reference import reference

BASE = {
    "seed": 1,
    "lanes": 4,
    "seq_len": 64,
    "global_batch_size": 8,
    "tokenizer": {"path": BUNDLED_TOKENIZER},
    "datasets": [{"name": "web", "path": "web/*.jsonl"}, {"name": "chat", "path": "c/*.jsonl", "kind": "chat"}],
    "pack": {"algorithm": "best_fit"},
}


def parse(**sections):
    return parse_recipe(dict(BASE, **sections), "/data")


def test_definitions_are_what_they_always_were():
    """FilterSpec.definition() enters the fingerprint: the same dicts as before the schema."""
    spec = parse(
        filters=[
            {"kind": "length", "min": 20, "max": 900, "datasets": ["web"]},
            {"name": "r", "kind": "regex", "pattern": "x+"},
            {"kind": "dedup"},
            {"kind": "field", "field": "lang", "in": ["en", "de", "en"]},
            {"kind": "field", "field": "score", "min": 0.5},
        ]
    )
    assert [f.definition() for f in spec.filters] == [
        {
            "name": "length#1",
            "kind": "length",
            "datasets": ("web",),
            "params": {"unit": "chars", "min": 20, "max": 900},
        },
        {"name": "r", "kind": "regex", "params": {"pattern": "x+", "action": "exclude"}},
        {"name": "dedup#3", "kind": "dedup", "params": {}},
        {"name": "field#4", "kind": "field", "params": {"field": "lang", "in": ["de", "en"]}},
        {"name": "field#5", "kind": "field", "params": {"field": "score", "min": 0.5}},
    ]
    assert spec.fork is None and parse().filters == ()


@pytest.mark.parametrize(
    "entry,message",
    [
        (
            {"kind": "regex", "patern": "x"},
            r"unknown key 'patern' in \[\[filters\]\] #1 \(kind = 'regex'\)\. Did you mean 'pattern'\?",
        ),
        (
            {"kind": "field", "field": "f", "min": 1, "sees": "raw"},
            r"unknown key 'sees' in \[\[filters\]\] #1 \(kind = 'field'\)",
        ),
        (
            {"kind": "length", "sees": "json"},
            r"\[\[filters\]\] #1 sees = 'json' is not valid; use one of 'rendered', 'raw'",
        ),
        ({"kind": "regex"}, r'\[\[filters\]\] #1: needs pattern = "a regular expression"'),
        ({"kind": "function"}, r'\[\[filters\]\] #1: needs function = "package.module:function"'),
        (
            {"kind": "image_size", "datasets": ["web"], "min_side": 0},
            r"\[\[filters\]\] #1 min_side must be >= 1, got 0",
        ),
        ({"kind": "image_size", "min_side": "big"}, r"min_side must be an integer"),
        ({"kind": "image_size"}, r"needs min_side and/or max_side"),
        ({"kind": "image_size", "min_side": 64, "max_side": 32}, r"max_side = 32 is below min_side = 64"),
        ({"kind": "image_size", "min_side": 64}, r"judges decoded images, and dataset 'web' has no images"),
    ],
)
def test_filter_entries_are_read_by_the_schema(entry, message):
    with pytest.raises(RecipeError, match=message):
        parse(filters=[entry])


def test_sees_enters_the_definition_only_off_its_default():
    default = parse(filters=[{"kind": "length", "min": 5, "sees": "rendered"}]).filters[0]
    assert default.sees is None and "sees" not in default.definition()
    assert default == parse(filters=[{"kind": "length", "min": 5}]).filters[0]
    raw = parse(filters=[{"kind": "length", "min": 5, "sees": "raw"}]).filters[0]
    assert raw.definition()["sees"] == "raw"
    for kind in ("regex", "dedup", "function", "transform", "stateful", "length"):
        assert "sees" in keys(FILTER_TABLES[kind])
    assert "sees" not in keys(FILTER_TABLES["field"]) and "sees" not in keys(FILTER_TABLES["image_size"])


def test_fork_is_read_by_the_schema():
    assert parse(fork={"parent": "base.toml", "step": 3}).fork == ForkSpec("/data/base.toml", 3)
    with pytest.raises(
        RecipeError,
        match=r"unknown key 'stpe' in \[fork\]\. Did you mean 'step'\? Allowed keys: parent, step, fingerprint\.",
    ):
        parse(fork={"parent": "base.toml", "stpe": 3})
    with pytest.raises(RecipeError, match=r"\[fork\] fingerprint must be a string, got 3"):
        parse(fork={"parent": "base.toml", "step": 3, "fingerprint": 3})
    with pytest.raises(RecipeError, match=r'\[fork\] must be a table with parent = "recipe.toml" and step = N'):
        parse(fork=5)
    with pytest.raises(RecipeError, match=r"\[fork\] step must be an integer >= 0 .*, got None"):
        parse(fork={"parent": "base.toml"})


def test_the_reference_documents_every_kind_and_key():
    page = reference()
    filters = page.split("## `[[filters]]`", 1)[1].split("## `[fork]`", 1)[0]
    for kind in KINDS:
        assert f"`{kind}`" in filters, kind
    for cls in set(FILTER_TABLES.values()):
        for k in keys(cls):
            assert f"| `{k}` |" in filters, k
    fork = page.split("## `[fork]`", 1)[1]
    assert all(f"| `{k}` |" in fork for k in keys(ForkSpec))
    assert FilterSpec("a", "dedup").definition() == {"name": "a", "kind": "dedup", "params": {}}
