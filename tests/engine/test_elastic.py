"""Elastic identity: global batches are the same bytes for every world size, worker count and resume chain."""

import functools

import pytest

from zephon import GlobalLoader, StateError, WorkerConfig, batch_sha256
from zephon.engine.checkpoint import decode_state, encode_state, merge_states
from zephon.engine.lanes import divisors
from zephon.engine.router import Router
from zephon.engine.testing import toy_lane

LANE = functools.partial(toy_lane, n=None)


def run(lanes, world, steps, *, workers=WorkerConfig(), state=None, seed=7, fingerprint="toy", lane=LANE):
    g = GlobalLoader(lane, lanes=lanes, world_size=world, seed=seed, workers=workers, fingerprint=fingerprint)
    try:
        if state is not None:
            g.load_state_dict(state)
        hashes = [batch_sha256(next(g)) for _ in range(steps)]
        return hashes, g.state_dict()
    finally:
        g.close()


@pytest.fixture(scope="module")
def ref8():
    return run(8, 1, 40)[0]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_l8_identical_for_every_world_size(world, ref8):
    assert run(8, world, 40)[0] == ref8


def test_l24_identical_for_every_divisor():
    ref = run(24, 1, 25)[0]
    assert divisors(24) == [1, 2, 3, 4, 6, 8, 12, 24]
    for w in divisors(24)[1:]:
        assert run(24, w, 25)[0] == ref, w


@pytest.mark.parametrize(
    "workers",
    [WorkerConfig(1, "thread"), WorkerConfig(4, "thread"), WorkerConfig(2, "process")],
    ids=lambda c: f"{c.backend}{c.count}",
)
def test_worker_count_and_backend_never_change_the_data(workers, ref8):
    assert run(8, 2, 40, workers=workers)[0] == ref8


def test_different_seed_or_lanes_do_change_the_data(ref8):
    # guards against a hash that ignores the data
    assert run(8, 1, 40, seed=8)[0] != ref8
    assert run(16, 1, 40)[0] != ref8


@pytest.mark.parametrize(
    "chain", [[(4, 3), (2, 11), (8, 1), (1, 25)], [(1, 17), (8, 5), (2, 18)], [(8, 1), (4, 1), (2, 1), (1, 37)]]
)
def test_resume_chains_across_world_sizes(chain, ref8):
    got, state = [], None
    for world, steps in chain:
        h, state = run(8, world, steps, state=state)
        got += h
        # every hop through DCP-style bytes: one JSON value per lane
        state = decode_state(encode_state(state))
    assert got == ref8


def test_resume_through_rank_states_merged_from_separate_ranks(ref8):
    routers = [Router(LANE, lanes=8, world_size=4, rank=r, seed=7, fingerprint="toy") for r in range(4)]
    for _ in range(9):
        for r in routers:
            next(r)
    rank_states = [encode_state(r.state_dict()) for r in routers]
    for r in routers:
        r.close()
    # each rank's entries only hold its own lanes; shared entries are identical
    assert all(len([k for k in s if k.startswith("lane_")]) == 2 for s in rank_states)
    merged = {}
    for s in rank_states:
        merged.update(s)
    assert run(8, 2, 31, state=decode_state(merged))[0] == ref8[9:]


def test_invalid_world_size_lists_valid_ones():
    with pytest.raises(ValueError, match=r"Valid world sizes for lanes = 24: \[1, 2, 3, 4, 6, 8, 12, 24\]"):
        GlobalLoader(LANE, lanes=24, world_size=5, seed=7)


def test_mismatched_checkpoint_is_refused():
    _, state = run(8, 2, 3)
    with pytest.raises(StateError, match="lanes = 8"):
        run(16, 2, 1, state=state)
    with pytest.raises(StateError, match="recipe changed"):
        run(8, 2, 1, state=state, fingerprint="other")
    with pytest.raises(StateError, match="seed"):
        run(8, 2, 1, state=state, seed=9)
    partial = {k: v for k, v in state.items() if k != "lane_00005"}
    with pytest.raises(StateError, match="lane entries"):
        run(8, 2, 1, state=partial)


def test_merge_refuses_states_from_different_steps():
    _, a = run(8, 2, 3)
    _, b = run(8, 2, 4)
    with pytest.raises(StateError):
        merge_states([a, b])


def test_router_repr_and_state_keys():
    r = Router(LANE, lanes=8, world_size=4, rank=1, seed=7)
    assert "owns 2..3" in repr(r)
    keys = set(r.state_dict())
    next(r)
    assert (
        set(r.state_dict())
        == keys
        == {
            "type",
            "version",
            "format_version",
            "lanes",
            "seed",
            "fingerprint",
            "step",
            "shared",
            "digest",
            "lane_00002",
            "lane_00003",
        }
    )
    r.close()


@pytest.mark.parametrize("prefetch", [1, 3])
def test_prefetch_changes_nothing_and_checkpoints_what_was_delivered(prefetch, ref8):
    from zephon.engine.testing import _threads, assert_no_leaks

    before = _threads()
    got, state = [], None
    for world, steps in [(4, 7), (2, 13), (8, 20)]:
        g = GlobalLoader(
            LANE,
            lanes=8,
            world_size=world,
            seed=7,
            fingerprint="toy",
            prefetch=prefetch,
            workers=WorkerConfig(1, "thread"),
        )
        if state is not None:
            g.load_state_dict(state)
        got += [batch_sha256(next(g)) for _ in range(steps)]
        state = decode_state(encode_state(g.state_dict()))  # while the thread is ahead
        g.close()
    assert got == ref8
    assert_no_leaks(before)


def test_prefetch_surfaces_errors_in_the_consumer():
    from zephon import WorkerError
    from zephon.engine.testing import toy_lane

    def bad(x):
        if x == 40:
            raise ValueError("bad record forty")
        return x

    lane = functools.partial(toy_lane, n=None, map_fn=bad)
    g = GlobalLoader(lane, lanes=2, world_size=1, seed=1, prefetch=2)
    with pytest.raises(ValueError, match="bad record forty") as ei:  # the function's own exception
        for _ in range(1000):
            next(g)
    assert not isinstance(ei.value, WorkerError) and "source position" in ei.value.__notes__[-1]
    with pytest.raises(ValueError):  # and keeps raising, never hangs
        next(g)
    g.close()


def test_step_counts_delivered_batches_with_prefetch():
    r = Router(LANE, lanes=4, world_size=1, seed=1, prefetch=3)
    for t in range(1, 6):
        next(r)
        assert r.step == t and r.state_dict()["step"] == t
    r.close()
