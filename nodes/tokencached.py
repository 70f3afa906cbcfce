"""The token cache on the tokenize path: a chunk's documents read from the node's token cache
(``$ZEPHON_TOKEN_CACHE``, :mod:`zephon.data.datasets.tokencache`) where their key matches, the
others tokenized as without it and queued for the cache's background writer.

Why a wrapper around the tokenize call: what a hit returns is the :class:`TokDoc` the call would
have made (the same ids, offset and part flag), so the batches are byte-identical whether the
cache is cold, warm, partial, corrupt or absent; a document's ids do not depend on the other
documents of its chunk, so tokenizing only the misses changes nothing.
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
    width_of,
)

from .worksource import WorkItem

__all__ = ["cache_places", "cache_setting", "through_cache"]

Place = tuple[str, bytes]  # a block file and its frames' tag
_UNKNOWN: Any = object()


def cache_places(fetch: Any, cache: TokenCache, items: Sequence[WorkItem]) -> list[Place | None]:
    """Where each item's entry lives in ``cache`` (None: a document the cache does not hold: a
    pretokenized one, or one of a dataset a ``transform`` filter rewrites). ``fetch``: the :class:`~zephon.nodes.tokenize.FetchTokenize`."""
    whole = TokenCache.settings_key(fetch.tokenizer.fingerprint)
    align = fetch.align if fetch.split == "tokens" else 1
    parts = TokenCache.settings_key(fetch.tokenizer.fingerprint, f"{fetch.split}|{align}|{fetch.part_search}")
    rewritten = fetch.rewritten  # datasets a transform rewrites: their texts are not the shards'
    out: list[Place | None] = []
    # a chunk's items share a few blocks: each block's place (a digest) is computed once per call
    known: dict[tuple[int, int, int, bool], Place | None] = {}
    for it in items:
        whole_doc = it.parts <= 1
        k = (it.dataset, it.shard, it.record // BLOCK_RECORDS, whole_doc)
        place = known.get(k, _UNKNOWN)
        if place is _UNKNOWN:
            shard = None if it.dataset in rewritten else shard_identity(fetch.datasets[it.dataset], it.shard)
            # a transform's text is not the shard's: not cached (user code may change)
            place = None if shard is None else cache.block_path(whole if whole_doc else parts, shard, it.record)
            known[k] = place
        out.append(place)
    return out


def through_cache(fetch: Any, items: list[WorkItem], call: Callable[[list[WorkItem]], list[Any]]) -> list[Any]:
    """``call(items)`` (a list of TokDoc), the documents the node's token cache holds read from it
    and the others tokenized by ``call`` and queued for the cache; plain ``call`` without a cache."""
    cache = token_cache(fetch.token_cache)
    if cache is None or cache.disabled is not None or not items:
        return call(items)
    doc_type = fetch.doc_type
    places = cache_places(fetch, cache, items)
    out: list[Any] = [None] * len(items)
    groups: dict[Place, list[int]] = collections.defaultdict(list)
    for j, p in enumerate(places):
        if p is not None:
            groups[p].append(j)
    for (path, tag), js in groups.items():
        for j, e in zip(js, cache.get_many(path, tag, [_key(items[j]) for j in js])):
            if e is not None:
                it = items[j]
                out[j] = doc_type(e.tokens, it.dataset, it, None, e.offset, e.text_part)
    miss = [j for j, d in enumerate(out) if d is None]
    if not miss:
        return out
    width = width_of(fetch.tokenizer.vocab_size)
    new: dict[Place, list[tuple[tuple[int, int, int], TokenEntry]]] = collections.defaultdict(list)
    for j, doc in zip(miss, call([items[j] for j in miss])):
        out[j] = doc
        p = places[j]
        if p is not None and doc.skipped is None and (not doc.tokens.size or int(doc.tokens.max()) >> (8 * width) == 0):
            new[p].append((_key(items[j]), TokenEntry(doc.tokens, doc.offset, doc.text_part)))
    for (path, tag), entries in new.items():
        cache.put_many(path, tag, width, entries)
    return out


def _key(it: WorkItem) -> tuple[int, int, int]:
    return (it.record, it.part, it.parts) if it.parts > 1 else (it.record, 0, 1)
