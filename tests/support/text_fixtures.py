"""Shared fixtures for text-pipeline tests: a small three-format corpus and its recipe."""

from __future__ import annotations

import io
import os

from zephon import Recipe, WorkerConfig
from zephon.data.datasets import tokencache as tc
from zephon.tools.cli import run_hashes
from zephon.tools.demo import TOKENIZER_DIR
from zephon.tools.synth import make_demo_corpus

RECIPE = """\
seed = 77
lanes = 8
seq_len = 64
global_batch_size = 16
cache_dir = "cache"

[tokenizer]
path = "{tok}"

[[datasets]]
name = "web"
path = "web/*.jsonl"
format = "jsonl"
weight = 0.5
{web_extra}
[[datasets]]
name = "code"
path = "code/*.parquet"
format = "parquet"
weight = 0.3
{code_extra}
[[datasets]]
name = "books"
path = "books/*.txt"
format = "text"
weight = 0.2
{books_extra}
[pack]
algorithm = "{algorithm}"
flush_every = 32

[shuffle]
buffer = {buffer}
{extra}
"""


def write_corpus(root: str, scale: float = 0.05) -> None:
    make_demo_corpus(root, seed=3, scale=scale)


def write_recipe(
    root: str,
    name: str = "recipe.toml",
    *,
    algorithm: str = "greedy",
    buffer: int = 8,
    extra: str = "",
    web_extra: str = "",
    code_extra: str = "",
    books_extra: str = "",
) -> str:
    path = os.path.join(root, name)
    with open(path, "w") as f:
        f.write(
            RECIPE.format(
                tok=TOKENIZER_DIR,
                algorithm=algorithm,
                buffer=buffer,
                extra=extra,
                web_extra=web_extra,
                code_extra=code_extra,
                books_extra=books_extra,
            )
        )
    return path


def hashes_without_token_cache(recipe_path: str, steps: int) -> list[str]:
    """The global-batch hashes of ``steps`` steps of a recipe with no token cache set (W = 1,
    inline workers; any W and worker count gives these): what every cached run must equal."""
    env = os.environ.pop(tc.ENV_DIR, None)
    try:
        return run_hashes(
            Recipe.from_toml(recipe_path), world_size=1, steps=steps, workers=WorkerConfig(0), out=io.StringIO()
        )
    finally:
        if env is not None:
            os.environ[tc.ENV_DIR] = env


def use_token_cache_folder(tmp_path, monkeypatch):
    """Point ``$ZEPHON_TOKEN_CACHE`` at the test's own folder (the default cap); returns it."""
    path = tmp_path / "token-cache"
    monkeypatch.setenv(tc.ENV_DIR, str(path))
    monkeypatch.delenv(tc.ENV_GB, raising=False)
    return path
