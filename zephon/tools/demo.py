"""The bundled demo: a three-dataset mixture generated offline and the bundled BPE tokenizer."""

from __future__ import annotations

import os

from zephon.data import BUNDLED_TOKENIZER
from zephon.recipe import Recipe

__all__ = ["TOKENIZER_DIR", "demo_recipe", "demo_root", "write_demo_recipe"]

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
