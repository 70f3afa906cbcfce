"""The work source's vectorised lookahead equals its scalar reference on many layouts (lane counts
up to 1,024, one to many shards, empty shards, several epochs per lookahead window)."""

import numpy as np
import pytest

from zephon.engine import IndexPermutation
from zephon.nodes.worksource import DatasetPlan, LaneWorkSource, WeightSchedule, WorkPlan


def layouts(count=30):
    rng = np.random.default_rng(15)
    for i in range(count):
        shards = int(rng.integers(1, 40))
        sizes = rng.integers(0 if i % 3 == 0 else 1, 300, shards)
        sizes[rng.integers(0, shards)] += 1  # never an empty dataset
        lanes = int(rng.choice([1, 3, 8, 64, 256, 1024]))
        yield i, [int(s) for s in sizes], lanes


@pytest.mark.parametrize("case,sizes,lanes", list(layouts()), ids=lambda v: str(v) if isinstance(v, int) else None)
def test_vectorised_lookahead_equals_the_scalar_path(case, sizes, lanes):
    ds = DatasetPlan("d", sizes, lambda s: np.ones(sizes[s], np.int64))
    plan = WorkPlan([ds], seed=case, lanes=lanes, schedule=WeightSchedule([(0, [1.0])]), tokens_per_step=1.0)
    for lane in sorted({0, lanes // 2, lanes - 1}):
        src = LaneWorkSource(plan, lane)
        n = ds.num_records
        ks = sorted({0, 1, 63, 64, 65, n // lanes, 2 * n // lanes + 5, 3 * n // lanes + 64})
        for k in ks:
            q, epoch, shard, record = src._locate_count(0, k)
            assert (epoch, shard, record) == src._locate(0, q)


def test_take_each_equals_take_per_permutation():
    rng = np.random.default_rng(0)
    perms = [IndexPermutation(int(n), int(k)) for n, k in zip(rng.integers(1, 5000, 50), rng.integers(0, 2**63, 50))]
    which = rng.integers(0, len(perms), 4000)
    idx = np.array([rng.integers(0, perms[w].n) for w in which])
    want = np.array([perms[w].take(np.array([i]))[0] for w, i in zip(which, idx)])
    assert np.array_equal(IndexPermutation.take_each(perms, which, idx), want)
    with pytest.raises(IndexError):
        IndexPermutation.take_each(perms[:2], np.array([0]), np.array([perms[0].n]))
