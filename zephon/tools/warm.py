"""``zephon warm RECIPE``: fill the node's token cache with what a recipe will read, on this
machine or as a Ray job spread over a cluster's CPUs (``--ray``, the optional ``ray`` extra).

Why Ray: it is the engine users already run for batch data work; one task per shard, each
writing into the token cache folder of the node it runs on and publishing what it wrote to the
cache's object-storage tier (``$ZEPHON_TOKEN_CACHE_REMOTE``), which makes one warm cache for the
cluster. The tasks call the recipe's own tokenize function, so the entries are the loader's.
Resumable after a kill and idempotent: done shards are skipped, done entries are not tokenized
again.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from zephon.data import token_cache
from zephon.recipe import Recipe
from zephon.recipe.warm import check_warmable, shard_items, warm_local, warm_shard, warm_share, warm_units

__all__ = ["ProgressBar", "run_warm", "warm_line", "warm_on_ray"]


class ProgressBar:
    """A one-line progress bar on ``out`` (redrawn in place on a terminal, a line per 10% else)."""

    def __init__(self, what: str, out: TextIO | None = None) -> None:
        self.what, self.out = what, out if out is not None else sys.stderr
        self.t0 = time.monotonic()
        self._tty = hasattr(self.out, "isatty") and self.out.isatty()
        self._shown = -1

    def __call__(self, done: int, total: int, counts: dict[str, int]) -> None:
        share = done / total if total else 1.0
        if not self._tty and int(share * 10) == self._shown and done != total:
            return
        self._shown = int(share * 10)
        bar = "#" * int(share * 30)
        line = (
            f"{self.what} [{bar:<30}] {done}/{total} shards, {counts.get('tokenized', 0):,} documents tokenized, "
            f"{counts.get('tokens', 0):,} tokens, {time.monotonic() - self.t0:.0f} s"
        )
        print(
            ("\r" + line) if self._tty else line,
            end="" if self._tty and done < total else "\n",
            file=self.out,
            flush=True,
        )


def _ray_task(fetch: Any, plan: Any, dataset: int, shard: int) -> dict[str, int]:
    """One shard, in a Ray worker: the plan's items of it tokenized into the node's cache."""
    return warm_shard(fetch, shard_items(plan, dataset, shard))


def warm_on_ray(recipe: Recipe, *, address: str | None = None, progress: Any = None) -> dict[str, int]:
    """Warm the cache as a Ray job: one task per shard over the cluster's CPUs (``address``: the
    cluster's, default a running one or a local one). Returns the summed counts."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("zephon warm --ray needs Ray: pip install 'zephon[ray]' (or pip install ray)") from None
    p = recipe.prepare()
    check_warmable(p)
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    fetch_ref, plan_ref = ray.put(p.pipeline), ray.put(p.plan)
    task = ray.remote(num_cpus=1)(_ray_task)
    units = warm_units(p)
    pending = [task.remote(fetch_ref, plan_ref, u.dataset, u.shard) for u in units]
    total = {"shards": len(units), "items": 0, "tokenized": 0, "tokens": 0}
    done = 0
    if progress:
        progress(0, len(units), total)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for got in ray.get(ready):
            for k, v in got.items():
                total[k] += v
            done += 1
        if progress:
            progress(done, len(units), total)
    return total


def run_warm(
    path: str, *, steps: int | None = None, threads: int = 0, ray_address: str | None = None, use_ray: bool = False
) -> int:
    """The ``zephon warm`` command: every shard of the recipe (default), or the next ``steps``
    steps exactly as the loader reads them (a run at W = 1 whose batches are dropped)."""
    recipe = Recipe.from_toml(path)
    cache = check_warmable(recipe.prepare())
    bar = ProgressBar(f"zephon warm {os.path.basename(path)}")
    t0 = time.monotonic()
    if steps is not None:
        from zephon.engine import WorkerConfig

        workers = WorkerConfig(threads, "thread") if threads else None
        with recipe.global_loader(1, workers=workers) as g:
            for t in range(steps):
                next(g)
                bar(t + 1, steps, {"tokenized": cache.stats["written"], "tokens": 0})
        cache.flush(600.0)
        cache.publish()
        counts = {"items": cache.stats["hits"] + cache.stats["misses"], "tokenized": cache.stats["misses"]}
    elif use_ray:
        counts = warm_on_ray(recipe, address=ray_address, progress=bar)
    else:
        counts = warm_local(recipe, threads=threads or os.cpu_count() or 1, progress=bar)
    tier = "" if cache.remote is None else f"; its remote tier is {cache.remote.url}"
    print(
        f"zephon warm: {counts.get('items', 0):,} documents planned, {counts.get('tokenized', 0):,} tokenized "
        f"now (the others were warm), in {time.monotonic() - t0:.1f} s; cache {cache.root} holds "
        f"{cache.size_bytes() / 1e6:.1f} MB{tier}",
        file=sys.stderr,
    )
    return 0


def warm_line(recipe: Recipe, steps: int) -> str | None:
    """``zephon inspect``'s line on the token cache: how much of about the next ``steps`` steps
    is warm (None without a cache, or for an image-text recipe)."""
    cache = token_cache()
    if cache is None or recipe.spec.multimodal:
        return None
    held, planned = warm_share(recipe, steps)
    return (
        f"token cache {cache.root}: {held:,} of the {planned:,} documents of about the next "
        f"{steps} steps are warm ({held / max(planned, 1):.0%})"
    )
