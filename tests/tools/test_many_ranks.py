"""A thousand ranks, simulated in one process (:mod:`zephon.tools.many_ranks`): 1,024 ranks x 8
lanes own exactly W = 1's lanes, deliver W = 1's rows, keep per-rank states of their share's size,
and their merged checkpoint resumes on W = 1 and on W = 1,024."""

from __future__ import annotations

from zephon.engine.testing import RangeSource, ToyBatch, ToyPacker, toy_lane
from zephon.tools.many_ranks import simulate


def _lane(ctx):
    """A cheap lane of engine parts (source -> packer with flush points -> batch of one row)."""
    return ToyBatch(ToyPacker(RangeSource(None, ctx.lane, ctx.lanes), row_len=4, flush_every=4), rows=1)


def test_1024_ranks_of_8_lanes_match_w1():
    r = simulate(_lane, lanes=8192, world_size=1024, steps=2, ranks=[0, 1, 511, 1023], seed=7)
    assert r["ownership_ok"], "the 1,024 lane blocks are not W = 1's lanes in order"
    assert r["same_batches_as_w1"], "a simulated rank's rows differ from W = 1's rows of its lanes"
    assert r["restored_ok"], "W = 1's checkpoint does not resume rank 511 of 1,024 (or W = 1) exactly"
    # a rank's state is its 8 lanes plus the shared entry: a thousandth of W = 1's, not W = 1's
    assert r["rank_state_bytes_max"] <= 8 * r["lane_entry_bytes_mean"] + r["shared_entry_bytes"] + 8 * 64
    assert r["rank_state_bytes_max"] * 500 < r["w1_state_bytes"]


def test_every_rank_of_128_simulated_and_the_checkpoint_is_w1s_size():
    r = simulate(toy_lane, lanes=1024, world_size=128, steps=2, seed=3)
    assert r["ranks_simulated"] == 128
    assert r["ownership_ok"] and r["same_batches_as_w1"] and r["restored_ok"]
    assert r["checkpoint_bytes"] == r["w1_state_bytes"]  # the merged states: every lane once, the shared entry once
