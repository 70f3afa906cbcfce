"""The recipe schema states each key once: the dataclass defaults are what parsing an empty
section gives, the allowed keys are the dataclass fields, and the parser knows every key's
type, bounds and choices from its field alone (so adding a key is one line)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from zephon.data import BUNDLED_TOKENIZER
from zephon.engine import WorkerConfig
from zephon.nodes import VisionConfig
from zephon.recipe import RecipeError
from zephon.recipe.keys import LIMITS, as_list, key, keys, meta
from zephon.recipe.parse import parse_recipe, read_table
from zephon.recipe.phases import BatchPhaseTable
from zephon.recipe.spec import (
    DATASET_KEYS,
    TOP_KEYS,
    VISION_KEYS,
    DatasetSpec,
    MixingSpec,
    PackSpec,
    PhaseTable,
    RecipeSpec,
    ShuffleSpec,
    TokenizerSpec,
    TokenizeTable,
    VisionSpec,
    VisionTable,
    WorkersSpec,
    WorkersTable,
    versioned_default,
)

MINIMAL = {
    "seed": 1,
    "lanes": 4,
    "seq_len": 64,
    "global_batch_size": 8,
    "tokenizer": {"path": BUNDLED_TOKENIZER},
    "datasets": [{"name": "web", "path": "web/*.jsonl"}],
}
KEYED = [DatasetSpec, TokenizerSpec, PackSpec, ShuffleSpec, MixingSpec, RecipeSpec]
TABLES = [WorkersTable, TokenizeTable, VisionTable, PhaseTable, BatchPhaseTable]


def _no_default(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@pytest.mark.parametrize("cls", KEYED, ids=lambda c: c.__name__)
def test_an_empty_section_parses_to_the_dataclass_defaults(cls):
    """Every default lives in the dataclass: a recipe that leaves a section (or key) out gets
    exactly the field's default, except the keys whose default is derived from others."""
    spec = parse_recipe(MINIMAL, "/data")
    parsed = {
        DatasetSpec: spec.datasets[0],
        TokenizerSpec: spec.tokenizer,
        PackSpec: spec.pack,
        ShuffleSpec: spec.shuffle,
        MixingSpec: spec.mixing,
        RecipeSpec: spec,
    }[cls]
    for f in dataclasses.fields(cls):
        if _no_default(f):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if cls is not RecipeSpec:  # a versioned default: the value of the recipe's data version
            default = versioned_default(cls, f.name, spec.data_version)
        k = meta(cls, f.name)
        if k.read == "table":
            continue  # a nested section: checked as its own class (and below)
        if k.derived is None:  # (a versioned key: its default under the recipe's data version)
            want = default
            assert getattr(parsed, f.name) == want, f"{cls.__name__}.{f.name}"
    mixing = dataclasses.replace(
        MixingSpec(), split_mode=versioned_default(MixingSpec, "split_mode", spec.data_version)
    )
    assert spec.mixing == dataclasses.replace(mixing, split_tokens=4 * (64 + 1))  # the one derived here
    assert spec.workers == WorkersSpec() and spec.vision == _vision_at(spec.data_version) and spec.end is None


def _vision_at(version: int) -> VisionSpec:
    """VisionSpec's defaults with the image settings whose default follows the data version."""
    config = dataclasses.replace(VisionConfig(), decode=versioned_default(VisionTable, "decode", version))
    return dataclasses.replace(VisionSpec(), config=config)


def test_workers_and_vision_defaults_are_the_lower_layers_own():
    """[workers] and [vision] take their defaults from WorkerConfig / VisionConfig, not copies."""
    assert WorkersSpec().default == WorkerConfig(
        **{f.name: getattr(WorkersTable(), f.name) for f in dataclasses.fields(WorkerConfig)}
    )
    assert {f.name for f in dataclasses.fields(VisionConfig)} <= set(VISION_KEYS)
    assert VisionSpec().config == VisionConfig(
        **{f.name: getattr(VisionTable(), f.name) for f in dataclasses.fields(VisionConfig)}
    )
    assert WorkersSpec().chunk_size == WorkersTable().chunk_size
    assert WorkersSpec().vision_chunk_size == VisionTable().chunk_size
    assert VisionSpec().tokens == {
        n.removesuffix("_token"): getattr(VisionTable(), n) for n in VISION_KEYS if n.endswith("_token")
    }
    spec = parse_recipe(dict(MINIMAL, datasets=[{"name": "i", "path": "x", "kind": "image_text"}]), "/data")
    assert spec.vision == _vision_at(spec.data_version) and spec.workers == WorkersSpec()
    assert (spec.datasets[0].text_field, spec.datasets[0].image_field) == ("caption", "image")


def test_key_lists_are_the_dataclass_fields():
    assert [f.name for f in dataclasses.fields(DatasetSpec)] == DATASET_KEYS
    assert [f.name for f in dataclasses.fields(RecipeSpec)][:13] + [
        "tokenize",
        "vision",
        "cache_dir",
        "end",
        "memory_gb",
        "data_version",
        "filters",
        "fork",
    ] == TOP_KEYS
    assert [f.name for f in dataclasses.fields(VisionTable)] == VISION_KEYS
    for cls in KEYED + TABLES:
        assert all("key" in f.metadata for f in dataclasses.fields(cls)), cls.__name__
        for name in keys(cls):
            k = meta(cls, name) if name in {f.name for f in dataclasses.fields(cls)} else None
            assert k is None or k.doc.strip(), f"{cls.__name__}.{name} has no doc"
            assert k is None or not isinstance(k.hi, str) or k.hi in LIMITS, f"{cls.__name__}.{name}: {k.hi}"


SECTIONS = {
    "pack": PackSpec,
    "shuffle": ShuffleSpec,
    "mixing": MixingSpec,
    "workers": WorkersTable,
    "tokenize": TokenizeTable,
    "vision": VisionTable,
    "tokenizer": TokenizerSpec,
}


@pytest.mark.parametrize("section", list(SECTIONS))
def test_the_parser_allows_exactly_the_fields(section):
    cls = SECTIONS[section]
    table = {"zzz": 1, "path": BUNDLED_TOKENIZER} if section == "tokenizer" else {"zzz": 1}
    with pytest.raises(RecipeError, match=r"Allowed keys: (.*)\.$") as e:
        parse_recipe(dict(MINIMAL, **{section: table}))
    assert re.search(r"Allowed keys: (.*)\.$", str(e.value)).group(1).split(", ") == keys(cls)
    with pytest.raises(RecipeError, match=r"Allowed keys: (.*)\.$") as e:
        parse_recipe(dict(MINIMAL, datasets=[{"name": "a", "path": "x", "zzz": 1}]))
    assert str(e.value).endswith(f"Allowed keys: {', '.join(DATASET_KEYS)}.")


def test_a_new_key_is_one_line():
    """A field with key() metadata is all the reader needs: default, type, bounds, choices."""

    @dataclasses.dataclass(frozen=True)
    class Section:
        depth: int = key(3, lo=1, hi="max_open", doc="how deep")
        mode: str = key("a", choices=("a", "b"), doc="which mode")
        ratio: float = key(0.5, positive=True, doc="how much")

    assert Section(**read_table(Section, {}, "[s]")) == Section()
    assert Section(**read_table(Section, {"depth": 7, "mode": "b"}, "[s]")) == Section(7, "b")
    for table, match in [
        ({"depth": 0}, r"\[s\].depth must be >= 1, got 0"),
        ({"depth": 10**6}, rf"\[s\].depth = 1000000 is above its limit of {LIMITS['max_open']}"),
        ({"mode": "c"}, r"\[s\].mode = 'c' is not valid; use one of 'a', 'b'"),
        ({"ratio": 0}, r"\[s\].ratio must be a finite number > 0"),
        ({"dpth": 1}, r"unknown key 'dpth' in \[s\]. Did you mean 'depth'\? Allowed keys: depth, mode, ratio."),
    ]:
        with pytest.raises(RecipeError, match=match):
            read_table(Section, table, "[s]")


def test_a_new_key_at_its_default_keeps_the_data_definition():
    """``new=True`` keys enter the data definition only off their default (old fingerprints stay)."""

    @dataclasses.dataclass(frozen=True)
    class Pack2:
        algorithm: str = key("greedy", doc="a")
        flush_every: int = key(512, doc="b")
        lookahead: int = key(0, new=True, doc="c")

    assert as_list(Pack2()) == ["greedy", 512]
    assert as_list(Pack2(lookahead=4)) == ["greedy", 512, {"lookahead": 4}]
    spec = parse_recipe(dict(MINIMAL, data_version=1), "/data")
    assert spec.data_definition()["pack"] == ["greedy", 512, 8] and spec.data_definition()["shuffle"] == 1024
    assert "max_record_bytes" not in spec.data_definition()["datasets"][0]
    big = parse_recipe(dict(MINIMAL, datasets=[{"name": "web", "path": "w", "max_record_bytes": 1 << 20}]), "/")
    assert big.data_definition()["datasets"][0]["max_record_bytes"] == 1 << 20
