"""Hostile or mistaken recipe files cost bounded time and memory and give one short message:
a huge string, a deeply nested table, a file far larger than any recipe, a FIFO."""

from __future__ import annotations

import pytest
from fifo import refusal_of_fifo

from zephon import Recipe, RecipeError
from zephon.recipe.recipe import MAX_RECIPE_BYTES
from zephon.tools.demo import TOKENIZER_DIR

HEAD = f'seed = 1\nlanes = 4\nseq_len = 64\nglobal_batch_size = 8\n[tokenizer]\npath = "{TOKENIZER_DIR}"\n'


def _write(tmp_path, text: str) -> str:
    p = tmp_path / "r.toml"
    p.write_text(text)
    return str(p)


def test_a_ten_megabyte_string_is_refused_with_a_short_message(tmp_path):
    big = "x" * (10 << 20)
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict(
            {
                "seed": 1,
                "lanes": 4,
                "seq_len": 64,
                "global_batch_size": 8,
                "tokenizer": {"path": TOKENIZER_DIR},
                "datasets": [{"name": big, "path": "x/*.jsonl"}],
            },
            str(tmp_path),
        )
    assert len(str(e.value)) < 1000 and "characters" in str(e.value)


def test_a_huge_unknown_key_gets_a_short_message(tmp_path):
    with pytest.raises(RecipeError, match="unknown key") as e:
        Recipe.from_dict({"y" * (1 << 20): 1}, str(tmp_path))
    assert len(str(e.value)) < 2000


def test_a_recipe_file_larger_than_any_recipe_is_refused_before_it_is_parsed(tmp_path):
    path = _write(tmp_path, HEAD + f"# {'z' * (MAX_RECIPE_BYTES + 10)}\n")
    with pytest.raises(RecipeError, match="a recipe is at most"):
        Recipe.from_toml(path)


def test_a_deeply_nested_recipe_is_an_error_not_a_recursion_traceback(tmp_path):
    path = _write(tmp_path, "x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(RecipeError, match="too deeply"):
        Recipe.from_toml(path)
    deep: dict = {}
    inner = deep
    for _ in range(100_000):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(RecipeError):
        Recipe.from_dict(deep, str(tmp_path))


def test_a_fifo_is_refused_without_blocking(tmp_path):
    load = "from zephon import Recipe, RecipeError; Recipe.from_toml(PATH)"
    assert "not a regular file" in refusal_of_fifo(str(tmp_path / "r.toml"), load, "RecipeError")
