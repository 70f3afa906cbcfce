"""The memory a recipe may take is bounded by default: validation states one lane's worst-case
bytes (the shuffle window's rows with their pixel_values, the micro-batch being built, samples
in flight), refuses a recipe above the limit naming the keys and the numbers, and a recipe it
accepts stays inside the budget it states."""

from __future__ import annotations

import numpy as np
import pytest
from vl_fixtures import vl_config, write_vl_root

from zephon import Recipe, RecipeError, WorkerConfig
from zephon.data import BUNDLED_TOKENIZER
from zephon.nodes import WindowShuffle
from zephon.recipe import parse_recipe
from zephon.recipe.budget import memory_budget


def old_default_vl(**over):
    """The recipe that grew past 14 GB without a first batch: default [shuffle] buffer (1024 rows)
    at seq_len 2048, default [vision] (an image token carries 4 x 1536 float32 pixels)."""
    return {
        "seed": 1,
        "lanes": 8,
        "seq_len": 2048,
        "global_batch_size": 32,
        "tokenizer": {"path": BUNDLED_TOKENIZER},
        "datasets": [{"name": "pairs", "path": "pairs/*.tar", "kind": "image_text"}],
    } | over


def test_old_default_vl_recipe_is_refused_under_version_1_naming_keys_and_numbers(monkeypatch):
    monkeypatch.delenv("ZEPHON_MEMORY_GB", raising=False)
    with pytest.raises(RecipeError) as e:
        parse_recipe(old_default_vl(data_version=1), "/data")
    msg = str(e.value)
    assert "52.69 GB" in msg and "memory limit of 32 GB" in msg  # 1024 rows x 50.47 MB + micro-batch
    assert "[shuffle] buffer = 1024" in msg and "set [shuffle] buffer = 612" in msg and "memory_gb" in msg
    # the fix it names is accepted
    parse_recipe(old_default_vl(data_version=1, shuffle={"buffer": 612}), "/data")


def test_default_vl_buffer_fits_from_version_2(monkeypatch):
    monkeypatch.delenv("ZEPHON_MEMORY_GB", raising=False)
    spec = parse_recipe(old_default_vl(data_version=2), "/data")
    b = memory_budget(spec)
    assert spec.shuffle.buffer == 20  # 5 micro-batches of 4 rows: <= 1 GiB worst case
    assert b.window_bytes <= 1 << 30 and b.row_bytes == 2049 * (54 + 4 * 1536 * 4)
    # the whole recipe on one rank (8 lanes, prefetch) fits the default limit
    assert b.rank_bytes(8, 2) <= 32e9
    # a buffer given keeps its value under every version; text recipes keep 1024
    assert parse_recipe(old_default_vl(shuffle={"buffer": 8}), "/data").shuffle.buffer == 8
    text = old_default_vl(datasets=[{"name": "web", "path": "web/*.jsonl"}])
    assert parse_recipe(text, "/data").shuffle.buffer == 1024


def test_memory_limit_from_the_recipe_or_the_environment(monkeypatch):
    text = old_default_vl(datasets=[{"name": "web", "path": "web/*.jsonl"}])  # 63 MB per lane
    parse_recipe(text, "/data")
    with pytest.raises(RecipeError, match=r"memory limit of 0.05 GB.*set \[shuffle\] buffer = 801"):
        parse_recipe(text | {"memory_gb": 0.05}, "/data")
    monkeypatch.setenv("ZEPHON_MEMORY_GB", "0.05")
    with pytest.raises(RecipeError, match="memory limit of 0.05 GB"):
        parse_recipe(text, "/data")
    assert memory_budget(parse_recipe(text | {"memory_gb": 1}, "/data")).limit_gb == 1
    monkeypatch.setenv("ZEPHON_MEMORY_GB", "lots")
    with pytest.raises(RecipeError, match="ZEPHON_MEMORY_GB"):
        parse_recipe(text, "/data")


def test_memory_limit_is_not_part_of_the_data(tmp_path):
    text = old_default_vl(datasets=[{"name": "web", "path": "web/*.jsonl"}])
    assert parse_recipe(text, "/d").data_definition() == parse_recipe(text | {"memory_gb": 100}, "/d").data_definition()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_vl_root(tmp_path_factory.mktemp("vlmem"), seed=0, text_scale=0.02)


def _nbytes(item) -> int:
    return sum(v.nbytes for v in item.values() if isinstance(v, np.ndarray))


def test_accepted_vl_recipe_stays_inside_the_budget_it_states(root, monkeypatch):
    """The shuffle window's actual bytes (pixels included) never exceed the stated window, nor a
    micro-batch the stated micro-batch: the image-heaviest settings of the fixture, small window."""
    cfg = vl_config(root, shuffle={"buffer": 6}, vision=vl_config(root)["vision"] | {"max_images_per_batch": 64})
    recipe = Recipe.from_dict(cfg, root)
    b = recipe.memory_budget()
    peak = {"window": 0, "micro": 0}
    accept = WindowShuffle.accept

    def measured(self, item):
        peak["micro"] = max(peak["micro"], _nbytes(item))
        peak["window"] = max(peak["window"], sum(map(_nbytes, self._items)) + _nbytes(item))
        accept(self, item)

    monkeypatch.setattr(WindowShuffle, "accept", measured)
    with recipe.global_loader(1, workers=WorkerConfig(0)) as g:
        for _ in range(12):
            next(g)
    assert 0 < peak["micro"] <= b.micro_batch_bytes
    assert 0 < peak["window"] <= b.window_bytes
    assert "memory budget per lane" in b.describe(4, 2)


def test_a_rank_holding_too_many_lanes_is_refused(root):
    cfg = vl_config(root, lanes=8, memory_gb=0.02)
    recipe = Recipe.from_dict(cfg, root)  # one lane fits
    assert recipe.memory_budget().lane_bytes <= 0.02e9
    with pytest.raises(RecipeError, match=r"8 lane\(s\) in this process hold up to .* above the memory limit"):
        recipe.global_loader(1)
    recipe.check_memory(world_size=8)  # one lane per rank fits
