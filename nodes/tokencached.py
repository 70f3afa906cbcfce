"""The token cache on the tokenize path: a chunk's documents read from the node's token cache
(``$ZEPHON_TOKEN_CACHE``, :mod:`zephon.data.datasets.tokencache`) where their key matches, the
others tokenized as without it and queued for the cache's background writer.

Why a wrapper around the encoder's call: what a hit returns is what the call would have made
(a text's :class:`TokDoc`: the same ids, offset and part flag; a conversation's ids and assistant
turns, before its dataset's ``long`` policy and ``loss_on`` are applied), so the batches are
byte-identical whether the cache is cold, warm, partial, corrupt or absent; a document's ids do
not depend on the other documents of its chunk, so encoding only the misses changes nothing.
The encoders (:class:`~zephon.nodes.FetchTokenize`, :class:`~zephon.nodes.FetchChat`) say what
their entries depend on (``cache_settings``) and how their results become entries and back.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

from zephon.data.datasets.tokencache import (
    BLOCK_RECORDS,
    TokenCache,
    TokenEntry,
    cache_setting,
    shard_identity,
    token_cache,
)

from .worksource import WorkItem

__all__ = ["cache_places", "cache_setting", "cached_entries", "through_cache"]

Place = tuple[str, bytes]  # a block file and its frames' tag
_UNKNOWN: Any = object()


def cache_places(fetch: Any, cache: TokenCache, items: Sequence[WorkItem]) -> list[Place | None]:
    """Where each item's entry lives in ``cache`` (None: a document the cache does not hold: a
    pretokenized one, or one of a dataset a ``transform`` filter rewrites). ``fetch``: the encoder
    (:class:`~zephon.nodes.FetchTokenize`, :class:`~zephon.nodes.FetchChat`), whose
    ``cache_settings(dataset, whole)`` names what its entries depend on besides the record."""
    out: list[Place | None] = []
    # a chunk's items share a few blocks: each block's place (a digest) is computed once per call
    known: dict[tuple[int, int, int, bool], Place | None] = {}
    for it in items:
        whole_doc = it.parts <= 1
        k = (it.dataset, it.shard, it.record // BLOCK_RECORDS, whole_doc)
        place = known.get(k, _UNKNOWN)
        if place is _UNKNOWN:
            settings = fetch.cache_settings(it.dataset, whole_doc)
            shard = None if settings is None else shard_identity(fetch.datasets[it.dataset], it.shard)
            place = None if shard is None else cache.block_path(settings, shard, it.record)
            known[k] = place
        out.append(place)
    return out


def through_cache(fetch: Any, items: list[WorkItem], call: Callable[[list[WorkItem]], list[Any]]) -> list[Any]:
    """``call(items)``, the items the node's token cache holds read from it and the others made
    by ``call`` and queued for the cache; plain ``call`` without a cache. ``fetch`` turns what
    ``call`` returns into an entry (``to_entry``: None for a skip) and back (``from_entry``)."""
    cache = token_cache(fetch.token_cache)
    if cache is None or cache.disabled is not None or not items:
        return call(items)
    places = cache_places(fetch, cache, items)
    out: list[Any] = [None] * len(items)
    groups: dict[Place, list[int]] = collections.defaultdict(list)
    for j, p in enumerate(places):
        if p is not None:
            groups[p].append(j)
    for (path, tag), js in groups.items():
        for j, e in zip(js, cache.get_many(path, tag, [_key(items[j]) for j in js])):
            if e is not None:
                out[j] = fetch.from_entry(e, items[j])
    miss = [j for j, d in enumerate(out) if d is None]
    if not miss:
        return out
    width = fetch.cache_width()
    new: dict[Place, list[tuple[tuple[int, int, int], TokenEntry]]] = collections.defaultdict(list)
    for j, doc in zip(miss, call([items[j] for j in miss])):
        out[j] = doc
        p = places[j]
        if p is None:
            continue
        e = fetch.to_entry(doc)
        if e is not None and (not e.tokens.size or int(e.tokens.max()) >> (8 * width) == 0):
            new[p].append((_key(items[j]), e))
    for (path, tag), entries in new.items():
        cache.put_many(path, tag, width, entries)
    return out


def cached_entries(
    cache: TokenCache | None, settings: str, index: Any, shard: int, records: Sequence[int]
) -> dict[int, TokenEntry]:
    """The whole-record entries (by record) that ``cache`` holds for ``records`` of shard
    ``shard`` of ``index`` under encoder settings ``settings``: what a recipe's token estimates
    read instead of tokenizing (or rendering) their sample again; none without a cache."""
    if cache is None or cache.disabled is not None or not records:
        return {}
    ident = shard_identity(index, shard)
    if ident is None:
        return {}
    groups: dict[Place, list[int]] = collections.defaultdict(list)
    for r in records:
        groups[cache.block_path(settings, ident, r)].append(r)
    out: dict[int, TokenEntry] = {}
    for (path, tag), rs in groups.items():
        for r, e in zip(rs, cache.get_many(path, tag, [(r, 0, 1) for r in rs], counted=False)):
            if e is not None:
                out[r] = e
    return out


def _key(it: WorkItem) -> tuple[int, int, int]:
    return (it.record, it.part, it.parts) if it.parts > 1 else (it.record, 0, 1)
