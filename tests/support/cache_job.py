"""One job of the shared-cache tests, as its own process: ``python cache_job.py RECIPE INDEX_DIR
WORLD STEPS WORKERS MODE`` (RECIPE: a TOML file, or a ``.json`` dict for ``Recipe.from_dict``)
prints one JSON line with its batch hashes and its shard cache's counters (the cache folder and
the S3 endpoint come from the environment)."""

from __future__ import annotations

import io
import json
import os
import sys

from zephon import Recipe, WorkerConfig
from zephon.data import node_cache
from zephon.tools.cli import run_hashes


def main(recipe: str, index_dir: str, world: str, steps: str, workers: str, mode: str) -> None:
    if recipe.endswith(".json"):  # a recipe as Recipe.from_dict's dict, relative to its folder
        with open(recipe, encoding="utf-8") as f:
            r = Recipe.from_dict(json.load(f), os.path.dirname(recipe))
    else:
        r = Recipe.from_toml(recipe)
    r = r.replace(cache_dir=index_dir)
    wc = WorkerConfig(int(workers), mode) if int(workers) else WorkerConfig(0)
    hashes = run_hashes(r, world_size=int(world), steps=int(steps), workers=wc, out=io.StringIO())
    cache = node_cache()
    print(json.dumps({"hashes": hashes, "stats": cache.stats if cache else None}))


if __name__ == "__main__":
    main(*sys.argv[1:])
