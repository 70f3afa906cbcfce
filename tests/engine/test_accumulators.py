"""Accumulators: restore at every step, flush-and-replay cost, JSON state."""

import json

import pytest

from zephon.engine import LaneContext
from zephon.engine.testing import ListSource, RangeSource, ToyPacker, check_node, toy_lane
from zephon.nodes import Batch, WindowShuffle


def test_toy_packer_restores_at_every_step():
    r = check_node(lambda: ToyPacker(RangeSource(120), row_len=8, flush_every=10))
    assert r.steps > 50


def test_toy_packer_without_flush_interval_still_restores():
    # no flush_every: anchors only where the buffer happens to empty; replay is longer but exact
    check_node(lambda: ToyPacker(RangeSource(60), row_len=8, flush_every=None))


def test_shuffle_restores_and_is_a_permutation():
    r = check_node(lambda: WindowShuffle(RangeSource(47), buffer=6, seed=3, lane=0))
    assert r.steps == 47
    out = list(WindowShuffle(RangeSource(47), buffer=6, seed=3, lane=0))
    assert sorted(out) == list(range(47)) and out != list(range(47))
    assert list(WindowShuffle(RangeSource(47), buffer=6, seed=3, lane=1)) != out


def test_batch_restores_and_drops_last():
    r = check_node(lambda: Batch(RangeSource(23), batch_size=4))
    assert r.steps == 5
    assert len(list(Batch(RangeSource(23), batch_size=4, drop_last=False))) == 6


@pytest.mark.parametrize("lane", [0, 5])
def test_whole_lane_restores_at_every_step(lane):
    r = check_node(lambda: toy_lane(LaneContext(seed=11, lane=lane, lanes=8), n=1500), max_steps=80)
    assert r.steps == 80
    assert r.max_state_bytes < 1024  # the design target: a lane's state is under 1 KB


def test_state_never_holds_buffer_contents():
    node = toy_lane(LaneContext(seed=1, lane=0, lanes=1), n=None, buffer=64)
    for _ in range(37):
        next(node)
    text = json.dumps(node.state_dict())
    assert len(text) < 1024
    node.close()


def _restore_reads(step, flush_every=16, buffer=5):
    """Source records read while restoring a lane at ``step``."""
    ctx = LaneContext(seed=2, lane=1, lanes=4)
    ref = toy_lane(ctx, n=None, flush_every=flush_every, buffer=buffer)
    for _ in range(step):
        next(ref)
    state = ref.state_dict()
    ref.close()
    fresh = toy_lane(ctx, n=None, flush_every=flush_every, buffer=buffer)
    node = fresh
    while not hasattr(node, "reads"):  # find the RangeSource at the bottom of the lane
        node = node.source
    fresh.reset(state)
    reads = node.reads
    fresh.close()
    return reads


def test_replay_cost_is_bounded_by_flush_interval_not_step():
    early, late = _restore_reads(10), _restore_reads(1000)
    # records in one flush interval of every accumulator: pack flushes every 16 records, the
    # shuffle window (5 rows) and a batch (2 rows) need at most a few more flush intervals
    bound = 16 * 4 + 4
    assert early <= bound and late <= bound, (early, late)
    assert abs(late - early) <= bound


def test_restore_into_a_different_node_type_is_refused():
    from zephon import StateError

    state = Batch(RangeSource(10), batch_size=2).state_dict()
    with pytest.raises(StateError, match="type 'batch'"):
        WindowShuffle(RangeSource(10), buffer=2, seed=0, lane=0).reset(state)


def test_bad_parameters():
    with pytest.raises(ValueError, match="buffer"):
        WindowShuffle(RangeSource(3), buffer=0, seed=0, lane=0)
    with pytest.raises(ValueError, match="batch_size"):
        Batch(RangeSource(3), batch_size=0)
    assert "batch_size=4" in repr(Batch(RangeSource(3), batch_size=4))


class CountingListSource(ListSource):
    """Outputs right after a restore, but its state counts reads since construction: a resumed
    run would write other checkpoints than an uninterrupted one."""

    node_type = "counting_list_source"

    def __init__(self, items):
        super().__init__(items)
        self.reads = 0

    def reset(self, initial_state=None):
        if initial_state is not None:
            initial_state = {k: v for k, v in initial_state.items() if k != "reads"}
        super().reset(initial_state)

    def next(self):
        self.reads += 1
        return super().next()

    def get_state(self):
        return {**super().get_state(), "reads": self.reads}


def test_check_node_holds_restored_states_to_the_uninterrupted_run():
    with pytest.raises(AssertionError, match=r"restored from step 1, before its first output.*/reads: 0 != 1"):
        check_node(lambda: CountingListSource(range(5)))
