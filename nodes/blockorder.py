"""The block shuffle (data version 3): one epoch's positions -> records, across all shards.

Why: under the stripe order (versions 1 and 2) lane ``l`` takes positions ``l, l + L, ...`` of
one shard-ordered stream, so at any step every lane reads the same shard, a global batch draws
from one to three shards whatever the corpus, and each lane's coalesced byte ranges span its
neighbours' records. Here the epoch is cut into *blocks* of ``block`` consecutive records of the
file order, and the blocks, from every shard of the dataset, are dealt to the lanes in a seeded
global permutation (an :class:`~zephon.engine.IndexPermutation`: O(1) memory, a new one every
epoch). A lane holds ``OPEN_BLOCKS`` blocks at a time and takes their records round-robin, each
block read front to back: at any step the L lanes read ``L x OPEN_BLOCKS`` random blocks of the
whole corpus (a global batch draws about as many shards as a record-level shuffle), and every
read is a contiguous byte range of one file (bytes read = bytes delivered, one open range per
open block). The lane's shuffle window then mixes the rows of many blocks.

The map stays a bijection on the epoch's ``N`` positions, so everything the WorkSource promises
holds unchanged: lane ``l`` still takes the stream positions ``l + kL`` (exactly once per epoch,
epochs back to back, the same end of a finite dataset, the same state), only the record each
position names changes. Layout of an epoch, in the file order of a seeded shard order rotated by
a seeded offset (so block edges move every epoch and a block may run from one shard into the
next):

* lane ``l``'s ``j``-th record of the epoch, for ``j`` below ``T x OPEN_BLOCKS x block`` (``T``
  full bands of ``OPEN_BLOCKS`` blocks per lane), is record ``o`` of block ``perm(b)``, with
  ``b = (band x OPEN_BLOCKS + j % OPEN_BLOCKS) x L + l`` and ``o = (j % (OPEN_BLOCKS x block)) //
  OPEN_BLOCKS``;
* the rest (fewer than ``OPEN_BLOCKS x block`` records per lane; the whole epoch of a corpus
  smaller than ``L x OPEN_BLOCKS x block``) is cut into one contiguous range per lane, in lane
  order, each taken as ``OPEN_BLOCKS`` interleaved sub-ranges.

>>> import numpy as np
>>> o = BlockOrder(seed=0, ds_index=0, sizes=[40, 25, 35], epoch=0, lanes=4, block=4)
>>> sh, rec = o.locate_many(np.arange(100))
>>> len(set(zip(sh.tolist(), rec.tolist())))   # a bijection of the epoch's 100 records
100
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from zephon.engine import IndexPermutation
from zephon.engine.seeding import stable_u64

__all__ = ["OPEN_BLOCKS", "BlockOrder", "expected_distinct", "global_batch_diversity"]

#: blocks a lane reads at once (round-robin): part of the data definition of the block order
OPEN_BLOCKS = 8


class BlockOrder:
    """Position -> (shard, record) of one dataset epoch under the block shuffle; O(shards) memory.

    The same interface as the stripe order's (``key``, ``locate``, ``locate_many``), so the
    WorkSource takes either.
    """

    def __init__(self, seed: int, ds_index: int, sizes: Sequence[int], epoch: int, *, lanes: int, block: int) -> None:
        if block < 1 or lanes < 1:
            raise ValueError(f"block order: block and lanes must be >= 1, got block={block}, lanes={lanes}")
        self.key = (seed, ds_index, epoch)
        self.sizes, self.lanes, self.block = [int(s) for s in sizes], int(lanes), int(block)
        n_shards = len(self.sizes)
        self.n = n = int(sum(self.sizes))
        shard_perm = IndexPermutation(n_shards, stable_u64("block-shards", seed, ds_index, epoch))
        self.order = shard_perm.take(np.arange(n_shards)) if n_shards else np.zeros(0, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(np.asarray(self.sizes, dtype=np.int64)[self.order])])
        self.shift = stable_u64("block-shift", seed, ds_index, epoch) % max(n, 1)
        self.a = (epoch * n) % lanes  # lane (p + a) % L takes position p of this epoch
        self.per_lane = n // lanes  # every lane has this many records of the epoch, some one more
        self.extra = n % lanes
        span = OPEN_BLOCKS * block
        self.bands = self.per_lane // span
        self.full = self.bands * span  # records per lane in full bands
        nblocks = self.bands * OPEN_BLOCKS * lanes
        self.perm = IndexPermutation(nblocks, stable_u64("blocks", seed, ds_index, epoch))

    def _extra_before(self, lane: np.ndarray) -> np.ndarray:
        """How many lanes before ``lane`` have one record more than ``per_lane`` in this epoch
        (those whose first position ``(l - a) mod L`` is below ``N mod L``: a cyclic run from ``a``)."""
        a, ex, L = self.a, self.extra, self.lanes
        if a + ex <= L:
            return np.clip(lane - a, 0, ex)
        return np.clip(lane - a, 0, L - a) + np.minimum(lane, a + ex - L)

    def flat(self, p: np.ndarray) -> np.ndarray:
        """The epoch's positions ``p`` -> indices into the rotated file order (a bijection)."""
        L, B, K = self.lanes, self.block, OPEN_BLOCKS
        p = np.asarray(p, dtype=np.int64)
        lane = (p + self.a) % L
        j = p // L  # the lane's index within this epoch (its first position is p mod L)
        v = np.empty_like(p)
        banded = j < self.full
        if banded.any():
            jb, lb = j[banded], lane[banded]
            band, i = np.divmod(jb, K * B)
            b = (band * K + i % K) * L + lb
            v[banded] = self.perm.take(b) * B + i // K
        rest = ~banded
        if rest.any():
            jr, lr = j[rest] - self.full, lane[rest]
            left = self.per_lane - self.full
            has_extra = (lr - self.a) % L < self.extra
            count = left + has_extra.astype(np.int64)  # the lane's records in the rest
            base = L * self.full + lr * left + self._extra_before(lr)
            # OPEN_BLOCKS sub-ranges of the lane's range, taken round-robin
            s, o = jr % K, jr // K
            q, r = np.divmod(count, K)
            v[rest] = base + s * q + np.minimum(s, r) + o
        return (v + self.shift) % max(self.n, 1)

    def locate_many(self, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, record) of each of the epoch's positions ``p``."""
        f = self.flat(p)
        j = np.searchsorted(self.starts, f, side="right") - 1
        return self.order[j].astype(np.int64), f - self.starts[j]

    def flat_one(self, p: int) -> int:
        """:meth:`flat` of one position in plain Python integers (no numpy: where lanes
        outnumber records, each record of a lane is in another epoch, so a lane locates its
        records one at a time, and numpy's per-call overhead on one element was most of a cold
        start's time)."""
        L, B, K = self.lanes, self.block, OPEN_BLOCKS
        lane, j = (p + self.a) % L, p // L
        if j < self.full:
            band, i = divmod(j, K * B)
            v = self.perm[(band * K + i % K) * L + lane] * B + i // K
        else:
            a, ex = self.a, self.extra
            left = self.per_lane - self.full
            count = left + (1 if (lane - a) % L < ex else 0)
            before = min(max(lane - a, 0), ex)
            if a + ex > L:
                before = min(max(lane - a, 0), L - a) + min(lane, a + ex - L)
            s, o = (j - self.full) % K, (j - self.full) // K
            q, r = divmod(count, K)
            v = L * self.full + lane * left + before + s * q + min(s, r) + o
        return (v + self.shift) % max(self.n, 1)

    def locate(self, p: int) -> tuple[int, int]:
        """(shard, record) of one position: :meth:`locate_many` of one, in plain integers.

        >>> o = BlockOrder(0, 0, [3, 5], 0, lanes=2, block=2)
        >>> [o.locate(p) for p in range(8)] == list(zip(*(a.tolist() for a in o.locate_many(np.arange(8)))))
        True
        """
        f = self.flat_one(int(p))
        starts = self.__dict__.get("_starts_list")
        if starts is None:
            starts = self.__dict__["_starts_list"] = self.starts.tolist()
        j = bisect.bisect_right(starts, f) - 1
        return int(self.order[j]), f - starts[j]


def expected_distinct(sizes: Sequence[int], n: int) -> float:
    """Distinct shards ``n`` records drawn by a record-level global shuffle of a dataset with
    shards of ``sizes`` records reach on average: ``sum(1 - (1 - p_s) ** n)``, ``p_s`` the
    shard's share of the records.

    >>> round(expected_distinct([100] * 64, 256), 1)
    62.9
    """
    p = np.asarray(sizes, dtype=np.float64)
    p = p[p > 0] / max(p.sum(), 1.0)
    return float((1.0 - (1.0 - p) ** n).sum()) if n > 0 else 0.0


def global_batch_diversity(
    provenance: Sequence[Sequence[Sequence[int]]], shard_sizes: Sequence[Sequence[int]]
) -> tuple[int, float]:
    """(distinct shards, global-shuffle expectation) of one global batch, from its rows'
    provenance (per row, one ``(dataset, shard, record, ...)`` per segment): the expectation
    draws each dataset's records of the batch from a record-level shuffle of that dataset.

    >>> global_batch_diversity([[(0, 1, 5, 0, 0, 9)], [(0, 2, 0, 0, 0, 9), (0, 2, 1, 0, 0, 9)]], [[10, 10, 10]])
    (2, 2.111)
    """
    seen: set[tuple[int, int]] = set()
    per_dataset = [0] * len(shard_sizes)
    records: set[tuple[int, int, int, int]] = set()
    for row in provenance:
        for seg in row:
            d, s, r, e = (int(x) for x in seg[:4])
            seen.add((d, s))
            if (d, s, r, e) not in records:  # a document cut over two rows counts once
                records.add((d, s, r, e))
                per_dataset[d] += 1
    expected = sum(expected_distinct(sizes, k) for sizes, k in zip(shard_sizes, per_dataset))
    return len(seen), round(expected, 3)
