"""The block shuffle's plan (issue 22), from metadata alone: a bijection of every epoch on many
layouts; each lane reads whole blocks front to back, a few at a time; the lanes of a step read
many shards, at offsets that do not follow the step; exact resume at every step."""

import itertools

import numpy as np
import pytest

from zephon.engine.testing import check_node
from zephon.nodes import OPEN_BLOCKS, BlockOrder, expected_distinct
from zephon.nodes.worksource import DatasetPlan, LaneWorkSource, WeightSchedule, WorkPlan


def layouts(count=40):
    rng = np.random.default_rng(22)
    for i in range(count):
        shards = int(rng.integers(1, 50))
        sizes = rng.integers(0 if i % 3 == 0 else 1, 400 if i % 2 else 30, shards)
        sizes[rng.integers(0, shards)] += 1
        yield i, [int(s) for s in sizes], int(rng.choice([1, 3, 8, 16, 64])), int(rng.choice([1, 2, 5, 16]))


@pytest.mark.parametrize(
    "case,sizes,lanes,block", list(layouts()), ids=lambda v: str(v) if isinstance(v, int) else None
)
def test_every_epoch_is_a_bijection(case, sizes, lanes, block):
    n = sum(sizes)
    for epoch in range(3):
        order = BlockOrder(case, 0, sizes, epoch, lanes=lanes, block=block)
        shards, records = order.locate_many(np.arange(n))
        assert len(set(zip(shards.tolist(), records.tolist()))) == n
        assert all(0 <= r < sizes[s] for s, r in zip(shards.tolist(), records.tolist()))
        assert order.locate(n // 2) == (int(shards[n // 2]), int(records[n // 2]))


def plan(sizes, lanes, block, **kw):
    ds = DatasetPlan("d", sizes, lambda s: np.full(sizes[s], 100, np.int64), block=block, **kw)
    return WorkPlan([ds], seed=3, lanes=lanes, schedule=WeightSchedule([(0, [1.0])]), tokens_per_step=1.0)


def test_a_lane_reads_whole_blocks_front_to_back_a_few_at_a_time():
    sizes, block = [5000] * 20, 16
    p = plan(sizes, 8, block)
    src = LaneWorkSource(p, 3)
    items = [next(src) for _ in range(8 * OPEN_BLOCKS * block)]
    for slot in range(OPEN_BLOCKS):
        seq = [(it.shard, it.record) for it in items[slot::OPEN_BLOCKS]]
        for b in range(0, len(seq), block):
            run = seq[b : b + block]
            # one block: consecutive records of one file (shards here are far larger than a block)
            assert all(s == run[0][0] for s, _ in run) and [r for _, r in run] == list(
                range(run[0][1], run[0][1] + block)
            )
    # any 32 consecutive records of the lane (a work chunk) lie in at most OPEN_BLOCKS + 1 ranges
    for c in range(0, len(items), 32):
        chunk = sorted((it.shard, it.record) for it in items[c : c + 32])
        ranges = 1 + sum(1 for a, b in itertools.pairwise(chunk) if a[0] != b[0] or b[1] != a[1] + 1)
        assert ranges <= OPEN_BLOCKS + 1


def test_lanes_of_a_step_spread_over_shards_and_offsets():
    sizes, lanes = [2000] * 64, 16
    p = plan(sizes, lanes, 16)
    sources = [LaneWorkSource(p, lane) for lane in range(lanes)]
    per_step = 8  # records a lane takes per step
    shards_per_step, offsets, steps = [], [], []
    for step in range(100):
        items = [next(s) for s in sources for _ in range(per_step)]
        shards_per_step.append(len({it.shard for it in items}))
        offsets += [it.record / sizes[it.shard] for it in items]
        steps += [step] * len(items)
    want = expected_distinct(sizes, lanes * per_step)
    assert np.mean(shards_per_step) >= 0.9 * want  # not one shard for every lane, as the stripe order
    assert abs(np.corrcoef(steps, offsets)[0, 1]) < 0.1  # where in its shard a record is does not follow the step


def test_every_record_once_per_epoch_across_lanes():
    sizes, lanes = [37, 0, 500, 3, 120], 7
    p = plan(sizes, lanes, 4)
    n = sum(sizes)
    got = []
    for lane in range(lanes):
        src = LaneWorkSource(p, lane)
        got += [(it.shard, it.record) for it in (next(src) for _ in range(-(-(n - lane) // lanes)))]
    assert len(got) == n == len(set(got))


@pytest.mark.parametrize("policy,epochs", [("repeat", None), ("stop", 2)])
def test_resume_at_every_step(policy, epochs):
    p = plan([45, 7, 130, 1], 3, 4, policy=policy, epochs=epochs)
    check_node(lambda: LaneWorkSource(p, 1), max_steps=400)


@pytest.mark.parametrize("lanes", [1, 7, 64, 4096])
def test_one_position_at_a_time_is_locate_many(lanes):
    for case, sizes, _, block in itertools.islice(layouts(), 12):
        n = sum(sizes)
        order = BlockOrder(case, 1, sizes, 5, lanes=lanes, block=block)
        shards, records = order.locate_many(np.arange(n))
        assert [order.locate(p) for p in range(n)] == list(zip(shards.tolist(), records.tolist()))


def test_lanes_far_above_the_records_locate_each_record_without_a_vector_call(monkeypatch):
    """4,096 lanes over 3,000 records: each record of a lane is in another epoch, so a lane's
    window of records held one position per epoch, and each took a vectorised ``locate_many``
    call (numpy's overhead per one-element call was most of the cold start, lanes x records
    drawn). They are located one at a time in plain integers: the same records, no vector call."""
    p = plan([1000, 1000, 1000], 4096, 16)
    lanes = range(0, 4096, 64)
    want = {}
    for lane in lanes:  # the reference: each position through locate_many
        for k in range(6):
            q = lane + k * 4096
            e, pos = divmod(q, 3000)
            sh, rec = p.epoch_order(0, e).locate_many(np.array([pos]))
            want[lane, k] = (int(sh[0]), int(rec[0]), e)
    calls = []
    real = BlockOrder.locate_many
    monkeypatch.setattr(BlockOrder, "locate_many", lambda self, ps: calls.append(len(ps)) or real(self, ps))
    for lane in lanes:
        src = p.lane(lane)
        got = [next(src) for _ in range(6)]
        assert [(it.shard, it.record, it.epoch) for it in got] == [want[lane, k] for k in range(6)]
    assert calls == [], f"{len(calls)} locate_many calls for {len(lanes) * 6} records"
