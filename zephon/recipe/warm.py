"""Warm the node's token cache ahead of a run: tokenize what a recipe will read into it.

Why: the first run of a corpus pays the tokenizer; a warm job run once (on idle CPUs, or spread
over a Ray cluster by ``zephon warm --ray``) makes every later run, ablation and concurrent job
read ids instead. What is written is exactly what the loader would write: the recipe's own
record pipeline (:attr:`Prepared.pipeline`, its filters included) is called on the items the
loader plans (every record of a text dataset, each long one as the parts the plan cuts it into;
every conversation of a chat dataset, rendered), so the loader's keys are the warm job's keys.

Resumable and idempotent without a state file: a shard whose entries are all present is skipped
(one look per block), and within a shard only the missing entries are tokenized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from zephon.data.datasets.tokencache import TokenCache, shard_identity, token_cache
from zephon.nodes import Carried, FetchChat, FetchTokenize, RecordPipeline
from zephon.nodes.tokencached import cache_places
from zephon.nodes.worksource import LaneWorkSource, WorkItem, WorkPlan

from .prepare import Prepared
from .recipe import Recipe
from .spec import RecipeError

__all__ = [
    "WARM_CHUNK",
    "WarmUnit",
    "cached",
    "check_warmable",
    "shard_items",
    "warm_local",
    "warm_shard",
    "warm_share",
    "warm_units",
]

#: items per tokenizer call of a warm job
WARM_CHUNK = 64


@dataclass(frozen=True)
class WarmUnit:
    """One shard of one dataset to warm, and its size in records (planned items)."""

    dataset: int
    shard: int
    items: int


def cached(enc: Any) -> bool:
    """Whether the token cache holds what encoder ``enc`` makes (texts' ids, conversations' ids
    and turns; not pretokenized ids, image-text samples or conversations with images)."""
    return isinstance(enc, (FetchTokenize, FetchChat))


def check_warmable(p: Prepared) -> TokenCache:
    """The token cache a recipe's warm job writes to; refuses a recipe or setting it cannot warm."""
    encs: list[Any] = [e for e in p.pipeline.encoders if cached(e)]
    if p.spec.multimodal or not encs:
        raise RecipeError(
            "zephon warm: the token cache holds text documents and conversations of recipes without images; this "
            "recipe has none (its datasets are pretokenized, image-text or conversations with images)"
        )
    cache = token_cache(encs[0].token_cache)
    if cache is None:
        raise RecipeError(
            "zephon warm: no token cache is set; set ZEPHON_TOKEN_CACHE to a local folder shared by the "
            "node's jobs (and ZEPHON_TOKEN_CACHE_GB to its cap, default 32)"
        )
    if cache.disabled is not None:
        raise RecipeError(f"zephon warm: the token cache {cache.root!r} cannot be used ({cache.disabled})")
    return cache


def shard_items(plan: WorkPlan, d: int, s: int) -> list[WorkItem]:
    """Every item ``plan`` makes of shard ``s`` of dataset ``d`` (one per record, or per part of
    a long record), in record order; epoch and position do not enter the cache's keys."""
    ds = plan.datasets[d]
    out = []
    for r, w in enumerate(ds.record_weight(s).tolist()):
        parts = ds.parts(int(w))
        out += [WorkItem(d, s, r, 0, 0, i, parts) for i in range(parts)]
    return out


def warm_units(p: Prepared) -> list[WarmUnit]:
    """The shards a warm job tokenizes: every shard of every text dataset (pretokenized ones have
    nothing to cache), largest first (the tail of a spread job is short)."""
    units = []
    for d, ix in enumerate(p.indexes):
        if not cached(p.pipeline.encoders[d]):
            continue  # pretokenized ids and image-text samples are not kept in the token cache
        for s, meta in enumerate(ix.shards):
            if meta.num_records and shard_identity(ix, s) is not None:
                units.append(WarmUnit(d, s, meta.num_records))
    return sorted(units, key=lambda u: (-u.items, u.dataset, u.shard))


def _missing(pipe: RecordPipeline, cache: TokenCache, items: list[WorkItem]) -> list[WorkItem]:
    if not items:
        return []
    places = cache_places(pipe.encoders[items[0].dataset], cache, items)
    groups: dict[Any, list[int]] = {}
    for j, pl in enumerate(places):
        if pl is not None:
            groups.setdefault(pl, []).append(j)
    have = set()
    for (path, tag), js in groups.items():
        got = cache.present(path, tag, [_key(items[j]) for j in js])
        have |= {j for j, ok in zip(js, got) if ok}
    return [it for j, it in enumerate(items) if j not in have and places[j] is not None]


def _key(it: WorkItem) -> tuple[int, int, int]:
    return (it.record, it.part, it.parts) if it.parts > 1 else (it.record, 0, 1)


def warm_shard(pipe: RecordPipeline, plan_items: list[WorkItem]) -> dict[str, int]:
    """Tokenize the items of one shard that the cache lacks (through ``pipe``, so the entries
    are the loader's), wait until they are written and publish them to the cache's remote tier
    if it has one (entries another node published are merged in, not tokenized). Returns counts:
    items, tokenized, tokens. A bad record is left out (the run that reads it raises or skips it,
    as its policy says)."""
    if not plan_items:
        return {"items": 0, "tokenized": 0, "tokens": 0}
    enc: Any = pipe.encoders[plan_items[0].dataset]  # a FetchTokenize or FetchChat (warm_units picks its datasets)
    cache = token_cache(enc.token_cache)
    if cache is None:
        raise RecipeError("zephon warm: this process has no token cache (set ZEPHON_TOKEN_CACHE where it runs)")
    todo = _missing(pipe, cache, plan_items)
    tokens = 0
    for i in range(0, len(todo), WARM_CHUNK):
        chunk = todo[i : i + WARM_CHUNK]
        try:
            docs = pipe(chunk)
        except Exception:  # a bad record under on_error = "raise": warm the others one by one
            docs = []
            for it in chunk:
                try:
                    docs += pipe([it])
                except Exception:
                    continue
        tokens += sum(int((d.doc if isinstance(d, Carried) else d).tokens.size) for d in docs)
    cache.flush(600.0)
    if todo:
        cache.publish(sorted({pl[0] for pl in cache_places(enc, cache, todo) if pl is not None}))
    return {"items": len(plan_items), "tokenized": len(todo), "tokens": tokens}


def warm_local(
    recipe: Recipe, *, threads: int = 1, progress: Callable[[int, int, dict[str, int]], None] | None = None
) -> dict[str, int]:
    """Warm the cache with every shard of ``recipe`` on this machine (``threads`` shards at a
    time); ``progress(done, total, counts)`` after each shard. Returns the summed counts."""
    p = recipe.prepare()
    check_warmable(p)
    units = warm_units(p)
    total = {"shards": len(units), "items": 0, "tokenized": 0, "tokens": 0}
    if progress:
        progress(0, len(units), total)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="zephon-warm") as pool:
        for done, got in enumerate(
            pool.map(lambda u: warm_shard(p.pipeline, shard_items(p.plan, u.dataset, u.shard)), units), 1
        ):
            for k, v in got.items():
                total[k] += v
            if progress:
                progress(done, len(units), total)
    return total


def warm_share(recipe: Recipe, steps: int, lanes: Iterator[int] | None = None) -> tuple[int, int]:
    """How much of the next ``steps`` steps of ``recipe`` the token cache holds: (items held,
    items planned), over the items its lanes' work sources plan for about that many steps (from
    the plan's token estimates; nothing is read or tokenized)."""
    p = recipe.prepare()
    cache = check_warmable(p)
    per_lane = p.plan.tokens_per_step * steps
    items: list[WorkItem] = []
    for lane in lanes if lanes is not None else range(recipe.lanes):
        src = LaneWorkSource(p.plan, lane)
        got = 0.0
        while got < per_lane:
            try:
                it = next(src)
            except StopIteration:
                break
            items.append(it)
            plan = p.plan.datasets[it.dataset]
            w = int(plan.record_weight(it.shard)[it.record])
            got += plan.part_weight(w, it.part, it.parts) * plan.tokens_per_byte + plan.tokens_per_record
    by_dataset: dict[int, list[WorkItem]] = {}
    for it in items:
        if cached(p.pipeline.encoders[it.dataset]):
            by_dataset.setdefault(it.dataset, []).append(it)
    missing = sum(len(_missing(p.pipeline, cache, its)) for its in by_dataset.values())
    return sum(map(len, by_dataset.values())) - missing, len(items)
