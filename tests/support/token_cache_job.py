"""One job of the token-cache tests, as its own process: ``python token_cache_job.py RECIPE
INDEX_DIR WORLD STEPS WORKERS MODE`` prints one JSON line with its batch hashes and its token
cache's counters (the cache folder comes from the environment)."""

from __future__ import annotations

import io
import json
import sys

from zephon import Recipe, WorkerConfig
from zephon.data import token_cache
from zephon.tools.cli import run_hashes


def main(recipe: str, index_dir: str, world: str, steps: str, workers: str, mode: str) -> None:
    r = Recipe.from_toml(recipe).replace(cache_dir=index_dir)
    wc = WorkerConfig(int(workers), mode) if int(workers) else WorkerConfig(0)
    hashes = run_hashes(r, world_size=int(world), steps=int(steps), workers=wc, out=io.StringIO())
    cache = token_cache()
    if cache is not None:
        cache.flush()
    print(json.dumps({"hashes": hashes, "stats": cache.stats if cache else None}))


if __name__ == "__main__":
    main(*sys.argv[1:])
