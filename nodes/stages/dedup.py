"""``kind = "dedup"``: exact duplicates within a dataset; the first copy in file order stays.

Decided without lane state: before the run, one pass over the dataset
(:func:`duplicate_records`) keeps the first record of each text (or stored ids) in file order
and lists the later copies; a worker drops a record iff it is on that list, so nothing depends
on which lane read what first, on the world size, or on where a run resumed."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from zephon.data.datasets import BadRecord

from .rule import FilterVerdict, Record, RuleStage, rule_class

__all__ = ["DedupRule", "duplicate_records"]


@rule_class("dedup")
class DedupRule(RuleStage):
    """``duplicates``: per dataset, the ``(shard, record)`` of every later copy."""

    needs_text = False

    def __call__(self, rec: Record, count_tokens: Callable[[str], int] = len) -> FilterVerdict | None:
        return self.drop((rec.shard, rec.record) not in self.duplicates.get(rec.dataset, ()))


def _digest(seen: Any) -> bytes | None:
    if isinstance(seen, str):
        return hashlib.blake2b(seen.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    if isinstance(seen, np.ndarray):
        return hashlib.blake2b(np.ascontiguousarray(seen, np.int64).tobytes(), digest_size=16).digest()
    return None


def duplicate_records(
    read_shard: Callable[[int], Iterable[Any]], shards: int, text_of: Callable[[int, int, Any], Any]
) -> frozenset[tuple[int, int]]:
    """``(shard, record)`` of every record whose text (``text_of(shard, record, raw)``: the text
    after the rules before the dedup rule, or a pretokenized record's ids; a
    :class:`FilterVerdict` or bad record is neither) equals an earlier record's, in file order.
    Memory: a 16-byte digest per distinct text."""
    seen: set[bytes] = set()
    dups: set[tuple[int, int]] = set()
    for s in range(shards):
        for r, raw in enumerate(read_shard(s)):
            if isinstance(raw, BadRecord):
                continue
            h = _digest(text_of(s, r, raw))
            if h is None:
                continue
            if h in seen:
                dups.add((s, r))
            else:
                seen.add(h)
    return frozenset(dups)
