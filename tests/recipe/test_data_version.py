"""The data-definition version: a change that alters batches is declared, and a checkpoint from
another version is refused with the setting that resumes its own stream."""

from __future__ import annotations

import pytest
from text_fixtures import write_corpus, write_recipe

from zephon.engine import StateError
from zephon.engine.digest import batch_sha256
from zephon.recipe import DATA_VERSION, Recipe, RecipeError
from zephon.recipe import build as build_module
from zephon.recipe import parse as parse_module
from zephon.recipe import spec as spec_module


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dv"))
    write_corpus(root, scale=0.02)
    return write_recipe(root, buffer=4)


def _bump(monkeypatch, versioned):
    """Pretend this zephon has one more data version, which changes ``versioned`` defaults."""
    new = DATA_VERSION + 1
    for module in (spec_module, parse_module, build_module):
        monkeypatch.setattr(module, "DATA_VERSION", new)
    for k, v in versioned.items():
        monkeypatch.setitem(spec_module.VERSIONED, k, {new: v})
    return new


def test_default_is_newest_and_version_one_keeps_fingerprints(recipe_path):
    r = Recipe.from_toml(recipe_path)
    assert r.spec.data_version == DATA_VERSION
    v1 = r.replace(data_version=1)
    assert "data_version" not in v1.data_definition()  # version 1: the fingerprints of every older recipe
    if DATA_VERSION == 1:
        assert v1.fingerprint == r.fingerprint


def test_unknown_version_is_refused(recipe_path):
    r = Recipe.from_toml(recipe_path)
    with pytest.raises(RecipeError, match="data_version"):
        r.replace(data_version=DATA_VERSION + 1)
    with pytest.raises(RecipeError, match="data_version"):
        r.replace(data_version=0)


def test_versioned_default_applies_only_when_not_given(recipe_path, monkeypatch):
    old = Recipe.from_toml(recipe_path)
    old_v1 = old.replace(data_version=1)
    new = _bump(monkeypatch, {("PackSpec", "max_open"): 3})
    r = Recipe.from_toml(recipe_path)
    assert r.spec.data_version == new and r.spec.pack.max_open == 3
    assert r.replace(data_version=DATA_VERSION).spec.pack.max_open == old.spec.pack.max_open
    assert r.replace(pack={"max_open": 5, "algorithm": "greedy", "flush_every": 32}).spec.pack.max_open == 5
    assert r.replace(data_version=1).fingerprint == old_v1.fingerprint
    assert r.replace(data_version=DATA_VERSION).fingerprint == old.fingerprint


def test_checkpoint_of_older_version_names_the_setting_and_resumes(recipe_path, monkeypatch):
    old = Recipe.from_toml(recipe_path).replace(data_version=1)
    with old.global_loader(world_size=2) as g:
        for _ in range(3):
            next(g)
        state = g.state_dict()
        rest = [batch_sha256(next(g)) for _ in range(3)]
    _bump(monkeypatch, {("ShuffleSpec", "buffer"): 2})
    r = Recipe.from_toml(recipe_path)
    assert r.fingerprint != old.fingerprint
    with r.global_loader(world_size=1) as g, pytest.raises(StateError, match="set data_version = 1"):
        g.load_state_dict(state)
    with r.replace(data_version=1).global_loader(world_size=1) as g:
        g.load_state_dict(state)
        assert [batch_sha256(next(g)) for _ in range(3)] == rest
