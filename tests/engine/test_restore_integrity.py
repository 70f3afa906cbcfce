"""A restore checks the checkpoint before it touches a node, and every node checks its own values:
an edited, swapped or corrupt state is refused naming the lane and the field, a `since` larger
than one flush interval can produce is refused before (or, exactly, during) replay, and nothing
replays without bound."""

from __future__ import annotations

import copy
import functools

import pytest
from state_edits import node_of
from state_edits import resealed as _resealed

from zephon import GlobalLoader, StateError, batch_sha256
from zephon.engine import LaneContext
from zephon.engine.checkpoint import lane_key, lane_state
from zephon.engine.mapper import MAX_CHUNK_SIZE
from zephon.engine.testing import RangeSource, toy_lane

LANE = functools.partial(toy_lane, n=None)


def run(world, steps, state=None, lanes=8):
    with GlobalLoader(LANE, lanes=lanes, world_size=world, seed=7) as g:
        if state is not None:
            g.load_state_dict(state)
        return [batch_sha256(next(g)) for _ in range(steps)], g.state_dict()


def resealed(state, lane, node_type, edit):
    """``state`` with one node state of ``lane`` edited and the digests recomputed: what a
    deliberate forgery looks like (only the nodes' own checks can refuse it)."""
    return _resealed(state, lambda raw: edit(node_of(raw[lane_key(lane)], node_type)))


@pytest.fixture(scope="module")
def saved():
    ref, _ = run(1, 10)
    _, state = run(2, 5)
    return ref, state


def test_unmodified_state_resumes_exactly(saved):
    ref, state = saved
    assert run(4, 5, state)[0] == ref[5:]


def test_refused_before_any_lane_is_reset(saved):
    """The router checks the whole checkpoint first: after a refused restore it still holds its
    own lanes, untouched, and goes on with the batches it would have produced."""
    ref, state = saved
    bad = copy.deepcopy(state)
    bad["lane_00006"]["state"]["since"] = 1  # the last lane: every other lane would reset first
    with GlobalLoader(LANE, lanes=8, world_size=1, seed=7) as g:
        first = [batch_sha256(next(g)) for _ in range(3)]
        with pytest.raises(StateError, match="lane_00006 does not match its digest"):
            g.load_state_dict(bad)
        assert first + [batch_sha256(next(g)) for _ in range(2)] == ref[:5]


@pytest.mark.parametrize(
    "node_type, edit, match",
    [
        ("toy_batch", lambda n: n.update(since=True), "'since' must be an integer"),
        ("toy_shuffle", lambda n: n.update(since=10**12), r"'since' must be an integer in \[0, 4\]"),
        ("toy_shuffle", lambda n: n.update(anchor=None), "'anchor' must be the upstream node's state"),
        ("toy_shuffle", lambda n: n["extra"].update(window=[1]), "'extra.window' must be an integer"),
        ("toy_shuffle", lambda n: n["extra"].update(window="abc"), "'extra.window' must be an integer"),
        ("toy_shuffle", lambda n: n["extra"].update(other=1), "unknown entry 'other'"),
        ("toy_shuffle", lambda n: n.update(surprise=0), "unknown entry 'surprise'"),
        ("toy_packer", lambda n: n.update(extra={"x": 1}), "'extra' must be empty"),
        ("ordered_map", lambda n: n.update(since=MAX_CHUNK_SIZE), r"'since' must be an integer in \[0, 4095\]"),
        ("ordered_map", lambda n: n.update(since=-1), "'since' must be an integer"),
        ("range_source", lambda n: n.update(cursor=10**30), "'cursor' must be an integer"),
        ("range_source", lambda n: n.pop("cursor"), "no 'cursor' entry"),
    ],
)
def test_forged_values_are_refused_by_the_node(saved, node_type, edit, match):
    _, state = saved
    with pytest.raises(StateError, match=r"checkpoint entry lane_00003: .*" + match):
        run(2, 1, resealed(state, 3, node_type, edit))


def test_since_above_the_static_bound_replays_nothing(saved):
    _, state = saved
    st = lane_state(resealed(state, 3, "toy_shuffle", lambda n: n.update(since=10**12)), 3)
    node = toy_lane(LaneContext(seed=7, lane=3, lanes=8), n=None)
    source = node
    while not isinstance(source, RangeSource):
        source = source.source
    with pytest.raises(StateError, match="since"):
        node.reset(st)
    assert source.reads == 0  # refused before anything was replayed


def test_since_beyond_the_flush_interval_is_refused_during_replay(saved):
    """The packer has no static bound; replay stops, with an error, where its flush interval ends:
    at most one interval's reads, whatever `since` says."""
    _, state = saved
    for since in (40, 10**12):
        st = lane_state(resealed(state, 3, "toy_packer", lambda n, s=since: n.update(since=s)), 3)
        node = toy_lane(LaneContext(seed=7, lane=3, lanes=8), n=None)
        source = node
        while not isinstance(source, RangeSource):
            source = source.source
        with pytest.raises(StateError, match=r"flush interval at its anchor produced only \d+ outputs"):
            node.reset(st)
        assert source.reads <= 16 + 2 * 4  # one interval of 16 documents, and at most two chunks around it
        node.close()


def test_lane_saved_at_another_step_is_refused():
    _, a = run(2, 5)
    _, b = run(2, 6)
    mixed = dict(a, lane_00002=b["lane_00002"])
    with pytest.raises(StateError, match="lane_00002 was saved at step 6 .* at step 5"):
        run(2, 1, mixed)
