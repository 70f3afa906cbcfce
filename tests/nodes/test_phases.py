"""The schedule operators alone (zephon.nodes.phases): rows per step by step, the carry-over rule
at a seq_len change (nothing dropped or repeated), restore at every step including mid-drain."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from zephon.engine.testing import ListSource, check_node
from zephon.nodes import (
    BatchSchedule,
    Carry,
    Pack,
    PhasedLane,
    ScheduledBatch,
    SegmentPack,
    TokDoc,
    WindowShuffle,
    WorkItem,
)

SCHED = BatchSchedule([(0, 2, 16), (4, 3, 16), (7, 2, 32), (10, 4, 8)])
DOCS = [
    TokDoc(np.arange(1000 * i, 1000 * i + int(n), dtype=np.int32), 0, WorkItem(0, 0, i, 0, i))
    for i, n in enumerate(np.random.default_rng(0).integers(3, 40, 300))
]


def lane(algorithm="greedy", buffer=6):
    segs = SCHED.segments()

    def stage(k, bottom, cls):
        pack = cls(bottom, seq_len=segs[k][1], flush_every=5, algorithm=algorithm, max_open=3)
        return WindowShuffle(pack, buffer=buffer, seed=1, lane=0, name=f"shuffle.{k}") if buffer > 1 else pack

    def held(k, source):
        return stage(k, source if k == 0 else Carry(source, functools.partial(held, k - 1)), SegmentPack)

    def build(k, old):
        front = ListSource(DOCS)
        bottom = front if k == 0 else Carry(front, functools.partial(held, k - 1), old)
        return ScheduledBatch(stage(k, bottom, Pack), schedule=SCHED, first_step=segs[k][0])

    return PhasedLane(SCHED, build)


def test_schedule_lookups():
    assert [SCHED.rows_at(t) for t in (0, 3, 4, 7, 10, 99)] == [2, 2, 3, 2, 4, 4]
    assert SCHED.segments() == [(0, 16), (7, 32), (10, 8)]
    with pytest.raises(ValueError, match="start at step 0"):
        BatchSchedule([(1, 2, 16)])
    with pytest.raises(ValueError, match="strictly increasing"):
        BatchSchedule([(0, 2, 16), (0, 3, 16)])


@pytest.mark.parametrize("algorithm", ["greedy", "best_fit"])
@pytest.mark.parametrize("buffer", [1, 6])
def test_shapes_and_every_token_once(algorithm, buffer):
    seen: set[tuple[int, int]] = set()
    shapes = []
    for b in lane(algorithm, buffer):
        shapes.append(b["input"].shape)
        for row in b["provenance"]:
            for p in row:
                for t in range(p.tok_start, p.tok_end):
                    assert (p.record, t) not in seen
                    seen.add((p.record, t))
    assert shapes[:14] == [(2, 16)] * 4 + [(3, 16)] * 3 + [(2, 32)] * 3 + [(4, 8)] * 4
    # everything but the last partial micro-batch and what the packer held at the end arrives
    assert len(seen) > sum(len(d.tokens) for d in DOCS) - 4 * 9 - 3 * 9


def test_carried_documents_come_first_with_their_provenance():
    out = list(lane("best_fit", 6))
    before = {tuple(p) for b in out[:7] for row in b["provenance"] for p in row}
    first_new = [tuple(p) for row in out[7]["provenance"] for p in row]
    # the first rows of the new length hold pieces the old segment had read but not delivered
    assert not set(first_new) & before
    assert all(p[4] < p[5] for p in first_new)


@pytest.mark.parametrize("buffer", [1, 6])
def test_restores_at_every_step(buffer):
    r = check_node(lambda: lane("first_fit", buffer), max_steps=16)
    assert r.steps == 16


def test_carry_restores_mid_drain():
    # the new segment's packer restores its Carry from anchors taken while pieces were still carried
    node = lane("greedy", 6)
    for _ in range(8):
        next(node)
    carry = node.upstreams()[0].source.source.source
    assert isinstance(carry, Carry)
    state = carry.state_dict()
    fresh = lane("greedy", 6)
    fresh.reset(node.state_dict())
    assert next(fresh)["input"].tolist() == next(node)["input"].tolist()
    assert set(state) >= {"old", "drained", "upstream"}
