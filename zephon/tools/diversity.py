"""Shuffle quality in numbers: distinct shards per global batch against a global shuffle's.

``zephon inspect`` prints it for the first batches of a recipe, and
``benchmarks/block_shuffle.py`` for each ``[shuffle] block``: a record-level global shuffle of
the same corpus would draw ``sum(1 - (1 - p_s) ** n)`` shards on average for the ``n`` records of a
batch (``p_s`` a shard's share of its dataset's records, each dataset's records of the batch
counted apart), see :func:`zephon.nodes.global_batch_diversity`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zephon.nodes import global_batch_diversity

__all__ = ["diversity_line", "shard_diversity"]


def shard_diversity(recipe: Any, batches: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(mean distinct shards per global batch, mean global-shuffle expectation) of ``batches``
    (global batches of ``recipe``, with their ``provenance``)."""
    sizes = [[sh.num_records for sh in ix.shards] for ix in recipe.indexes]
    got = want = 0.0
    for b in batches:
        a, e = global_batch_diversity(b["provenance"], sizes)
        got += a
        want += e
    n = max(len(batches), 1)
    return got / n, want / n


def diversity_line(recipe: Any, batches: Sequence[dict[str, Any]]) -> str:
    """One line for ``zephon inspect``: the shuffle, and its distinct shards per batch."""
    got, want = shard_diversity(recipe, batches)
    block = recipe.spec.shuffle.block
    how = f"block shuffle, blocks of {block} records" if block else "stripe order (data version 1-2)"
    ratio = f" ({got / want:.2f}x)" if want else ""
    return (
        f"shuffle: {how}, window {recipe.spec.shuffle.buffer} rows; distinct shards per global batch over the "
        f"first {len(batches)} steps: {got:.1f}, a record-level global shuffle: {want:.1f}{ratio}"
    )
