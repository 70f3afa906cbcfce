"""The bundled demo: a three-dataset mixture generated offline and the bundled BPE tokenizer."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from zephon.data import BUNDLED_TOKENIZER
from zephon.recipe import Recipe

__all__ = ["TOKENIZER_DIR", "demo_recipe", "demo_root", "what_you_saw", "write_demo_recipe"]

TOKENIZER_DIR = BUNDLED_TOKENIZER  # the bundled BPE (zephon.data.BUNDLED_TOKENIZER)

DEMO_TOML = """\
# zephon demo recipe: a mixture of JSONL (web), Parquet (code) and text (books), token-weighted.
seed = 1234
lanes = 16                 # fixed for the life of a run: any W in 1, 2, 4, 8, 16
seq_len = 256
global_batch_size = 32     # packed rows per step (2 per lane)
cache_dir = "cache"        # dataset indexes

[tokenizer]
path = "{tokenizer}"

[[datasets]]
name = "web"
path = "web/*.jsonl"
format = "jsonl"
text_field = "text"
weight = 0.6

[[datasets]]
name = "code"
path = "code/*.parquet"
format = "parquet"
weight = 0.25

[[datasets]]
name = "books"
path = "books/*.txt"
format = "text"
text_mode = "line"
weight = 0.15

[pack]
algorithm = "greedy"
flush_every = 256

[shuffle]
buffer = 32

[workers]
count = 2
backend = "thread"
"""


def demo_root(root: str | None = None) -> str:
    """Where the demo data lives: ``root`` if given, else ``$ZEPHON_CACHE_DIR/demo`` (default
    ``~/.cache/zephon/demo``).

    >>> demo_root("/tmp/my-demo")
    '/tmp/my-demo'
    """
    if root:
        return root
    base = os.environ.get("ZEPHON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "zephon")
    return os.path.join(base, "demo")


def write_demo_recipe(root: str | None = None, scale: float = 1.0) -> str:
    """Generate the demo corpus (idempotent) and write ``demo.toml`` beside it; return its path."""
    from .synth import make_demo_corpus

    root = demo_root(root)
    os.makedirs(root, exist_ok=True)
    make_demo_corpus(root, seed=0, scale=scale)
    path = os.path.join(root, "demo.toml")
    text = DEMO_TOML.format(tokenizer=TOKENIZER_DIR.replace("\\", "/"))
    if not os.path.exists(path) or open(path, encoding="utf-8").read() != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return path


def demo_recipe(root: str | None = None, scale: float = 1.0) -> Recipe:
    """The demo recipe, ready to use (data generated on first call).

    >>> import tempfile
    >>> recipe = demo_recipe(tempfile.mkdtemp(), scale=0.01)   # a small corpus: under a second
    >>> [d.name for d in recipe.datasets], recipe.lanes, recipe.seq_len
    (['web', 'code', 'books'], 16, 256)
    """
    return Recipe.from_toml(write_demo_recipe(root, scale))


def what_you_saw(recipe: Recipe, batch: Mapping[str, Any], runs: Sequence[str], steps: int, same: bool) -> list[str]:
    """The demo's closing lines for a newcomer: the batch's shape, what the elastic check compared
    and its verdict, where the recipe is, what to try next and which page to read.

    >>> import numpy as np, tempfile
    >>> r = demo_recipe(tempfile.mkdtemp(), scale=0.01)
    >>> lines = what_you_saw(r, {"input": np.zeros((32, 256))}, ["W=1", "W=2"], 6, True)
    >>> lines[1]
    '  - a global batch: 32 rows of 256 tokens (input [32, 256]), mixed from web, code, books by token share'
    """
    toml = os.path.join(recipe.base_dir, "demo.toml")
    shape = ", ".join(str(n) for n in batch["input"].shape)
    names = ", ".join(d.name for d in recipe.datasets)
    verdict = "passed" if same else "FAILED (the runs differ: please report it with the table above)"
    return [
        "What you just saw:",
        f"  - a global batch: {recipe.global_batch_size} rows of {recipe.seq_len} tokens (input [{shape}]), "
        f"mixed from {names} by token share",
        f"  - the elastic check {verdict}: the {len(runs)} runs of the table (world sizes 1, 2, 4, 8; inline or 2 "
        f"thread workers; saved on 4 ranks, resumed on 2) made the same {steps} global batches, byte for byte",
        f"  - the recipe: {toml} ({recipe.lanes} lanes: any world size dividing {recipe.lanes} gets these batches)",
        "Try next:",
        f"  zephon inspect {toml} --show 2                  # the plan, token shares, lane map, decoded rows",
        f"  zephon hashes {toml} --world-size 4 --steps 6   # the hashes above, on 4 simulated ranks",
        "  edit a weight in the recipe and compare: zephon ledger diff OLD.toml NEW.toml",
        "Read next: docs/getting-started.md (the quickstart), docs/recipes.md (the recipe's keys), docs/torchtitan.md",
    ]
