"""The end of a finite run is a global step boundary, the same on every world size.

Toy lanes of unequal length (lane l of L holds a different number of micro-batches); both end
modes ("drop": the last step every lane fills; "pad": the longest lane's, shorter lanes padded);
prefetch on and off; states before, at and after the end, resumed on another world size; the
per-lane counts carried in the checkpoint; the per-lane digests a batch ledger records.
"""

from __future__ import annotations

import numpy as np
import pytest
from state_edits import resealed

from zephon.engine import LaneContext, PipelineError, StateError
from zephon.engine.checkpoint import decode_state, encode_state, lane_state, merge_states
from zephon.engine.digest import batch_sha256, ledger_digest
from zephon.engine.end import LaneEnd
from zephon.engine.lanes import LaneSet, count_lane_steps
from zephon.engine.router import GlobalLoader, Router
from zephon.engine.testing import check_node, toy_lane

LANES = 8
PAD = {"tokens": np.full((2, 8), -7, dtype=np.int64)}  # toy_lane's micro-batch: 2 rows of 8 tokens


def uneven(ctx: LaneContext):
    """Lane l reads a different amount of data: its micro-batch count depends on l."""
    return toy_lane(ctx, n=ctx.lanes * (12 + 5 * (ctx.lane % 3) + 2 * (ctx.lane // 3)))


def lane_set(end, pad=None):
    return LaneSet(uneven, end=end, pad=(lambda lane: PAD) if end == "pad" else pad)


def run_to_end(g):
    hashes = []
    while True:
        try:
            hashes.append(batch_sha256(next(g)))
        except StopIteration:
            return hashes


@pytest.fixture(scope="module")
def counts():
    return count_lane_steps(uneven, lanes=LANES, seed=3)


def test_the_toy_lanes_are_uneven(counts):
    assert len(set(counts)) >= 3 and min(counts) >= 4, counts


@pytest.mark.parametrize("mode", ["drop", "pad"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_every_world_size_ends_on_the_same_step(mode, prefetch, counts):
    expected_steps = min(counts) if mode == "drop" else max(counts)
    ref = None
    for W in (1, 2, 4, 8):
        g = GlobalLoader(lane_set(mode), lanes=LANES, world_size=W, seed=3, prefetch=prefetch, workers=None)
        try:
            hashes = run_to_end(g)
            assert len(hashes) == expected_steps == g.end.steps
            assert g.end == LaneEnd(mode, tuple(counts))
            # every rank delivered the same number of steps and stays ended
            assert [r.step for r in g.routers] == [expected_steps] * W
            for _ in range(2):
                with pytest.raises(StopIteration):
                    next(g)
            assert all(r.ended for r in g.routers)
            state = g.state_dict()  # was: "shared entry 'step' differs between rank states"
            assert state["step"] == expected_steps and state["shared"]["end"]["lane_steps"] == counts
        finally:
            g.close()
        ref = ref or hashes
        assert hashes == ref, f"W={W} differs from W=1"


def test_each_rank_raises_on_the_same_call_in_its_own_process(counts):
    """What W training processes see: each rank's router alone ends after the same step."""
    for W in (2, 4):
        ends = []
        for rank in range(W):
            r = Router(lane_set("drop"), lanes=LANES, world_size=W, rank=rank, seed=3)
            n = 0
            try:
                while True:
                    next(r)
                    n += 1
            except StopIteration:
                ends.append(n)
            finally:
                r.close()
        assert ends == [min(counts)] * W


def test_pad_mode_pads_only_lanes_past_their_end(counts):
    g = GlobalLoader(lane_set("pad"), lanes=LANES, world_size=2, seed=3)
    try:
        for t in range(max(counts)):
            batch = next(g)["tokens"].reshape(LANES, 2, 8)
            for lane in range(LANES):
                padded = bool((batch[lane] == -7).all())
                assert padded == (t >= counts[lane]), (t, lane)
    finally:
        g.close()


def test_drop_mode_never_pulls_a_lane_past_the_shortest(counts):
    g = GlobalLoader(lane_set("drop"), lanes=LANES, world_size=1, seed=3)
    try:
        run_to_end(g)
        # the longest lane was not read to its end: its state resumes inside its data
        st = g.state_dict()
    finally:
        g.close()
    longest = int(np.argmax(counts))
    lane = uneven(LaneContext(seed=3, lane=longest, lanes=LANES))
    lane.reset(lane_state(st, longest))
    assert len(list(lane)) == counts[longest] - min(counts)
    lane.close()


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_state_before_at_and_after_the_end_resumes_on_another_world_size(mode, counts):
    with GlobalLoader(lane_set(mode), lanes=LANES, world_size=1, seed=3) as g:
        ref = run_to_end(g)
    n = len(ref)
    # saved on W=4 three steps before the end, resumed on W=2: exactly the last three steps
    with GlobalLoader(lane_set(mode), lanes=LANES, world_size=4, seed=3, prefetch=2) as g:
        head = [batch_sha256(next(g)) for _ in range(n - 3)]
        before = decode_state(encode_state(g.state_dict()))
    with GlobalLoader(lane_set(mode), lanes=LANES, world_size=2, seed=3) as g:
        g.load_state_dict(before)
        tail = run_to_end(g)
        at_end = decode_state(encode_state(g.state_dict()))
        after = decode_state(encode_state(g.state_dict()))  # asked again after the end: unchanged
    assert head + tail == ref and len(tail) == 3
    assert at_end == after and at_end["step"] == n
    # a state saved at the end resumes ended, on any W, and its own state is still the end
    for W in (8, 1):
        with GlobalLoader(lane_set(mode), lanes=LANES, world_size=W, seed=3, prefetch=W % 2) as g:
            g.load_state_dict(at_end)
            with pytest.raises(StopIteration):
                next(g)
            assert g.state_dict()["step"] == n


def test_the_counts_travel_in_the_checkpoint_and_are_adopted(counts):
    class WrongCounts(LaneSet):
        def count_steps(self, **kw):  # a resume must use the counts in the checkpoint
            return [1] * LANES

    with GlobalLoader(lane_set("drop"), lanes=LANES, world_size=2, seed=3) as g:
        next(g)
        state = g.state_dict()
    assert state["shared"]["end"] == {"mode": "drop", "lane_steps": counts}
    with GlobalLoader(WrongCounts(uneven, end="drop"), lanes=LANES, world_size=4, seed=3, prefetch=2) as g:
        template = g.state_dict()  # what DCP asks for before loading: counted, the shape of every step
        assert template["shared"]["end"] == {"mode": "drop", "lane_steps": [1] * LANES}
        g.load_state_dict(state)
        assert len(run_to_end(g)) == min(counts) - 1
    # another end mode, or an infinite pipeline, refuses the checkpoint by name
    # (resealed: edits a forger made consistent, so the check that refuses them is the end's own)
    bad_counts = resealed(state, lambda raw: raw["shared"].update(end={"mode": "drop", "lane_steps": counts[:3]}))
    past_the_end = resealed(state, lambda raw: raw.update(step=min(counts) + 1))
    for lanes, st, needle in [
        (lane_set("pad"), state, "end = 'drop' but the pipeline has end = 'pad'"),
        (LaneSet(uneven), state, "finite run"),
        (lane_set("drop"), bad_counts, "counts 3 lanes"),
        (lane_set("drop"), past_the_end, "data ends after"),
    ]:
        g = GlobalLoader(lanes, lanes=LANES, world_size=2, seed=3)
        with pytest.raises(StateError, match=needle):
            g.load_state_dict(st)
        g.close()


def test_a_lane_that_ends_without_a_declared_end_is_an_error():
    g = GlobalLoader(uneven, lanes=LANES, world_size=2, seed=3)
    with pytest.raises(PipelineError, match=r"lane \d ended after \d+ micro-batches, but its lane set declares no end"):
        run_to_end(g)
    g.close()


def test_lane_set_arguments():
    with pytest.raises(ValueError, match="end must be None"):
        LaneSet(uneven, end="truncate")
    with pytest.raises(ValueError, match="needs pad="):
        LaneSet(uneven, end="pad")
    with pytest.raises(ValueError, match="non-negative"):
        LaneEnd("drop", (3, -1))
    with pytest.raises(StateError, match="shared.end"):
        LaneEnd.from_json({"mode": "drop"})


@pytest.mark.parametrize("mode", [None, "pad"])
def test_lane_digests_give_the_same_step_digest_on_every_world_size(mode, counts):
    steps = 6 if mode is None else max(counts)
    build = toy_lane if mode is None else uneven
    ref = None
    for W in (1, 2, 4, 8):
        ls = LaneSet(build) if mode is None else lane_set(mode)
        with GlobalLoader(ls, lanes=LANES, world_size=W, seed=3, digests=True, prefetch=W % 2) as g:
            digests = []
            for _ in range(steps):
                next(g)
                digests.append(g.step_digest())
        ref = ref or digests
        assert digests == ref
    # the digest is over the lanes' own micro-batches, in lane order
    lanes = [(uneven if mode else toy_lane)(LaneContext(seed=3, lane=l, lanes=LANES)) for l in range(LANES)]
    first = [batch_sha256(next(n)) for n in lanes]
    assert ref[0] == ledger_digest(first)
    for n in lanes:
        n.close()
    with GlobalLoader(toy_lane, lanes=LANES, world_size=2, seed=3) as g:
        next(g)
        with pytest.raises(PipelineError, match="digests=True"):
            g.step_digest()


def test_merge_states_at_the_end_agree_across_ranks(counts):
    routers = [Router(lane_set("pad"), lanes=LANES, world_size=4, rank=r, seed=3) for r in range(4)]
    try:
        for r in routers:
            while True:
                try:
                    next(r)
                except StopIteration:
                    break
        merged = merge_states(r.state_dict() for r in routers)
        assert merged["step"] == max(counts)
    finally:
        for r in routers:
            r.close()


@pytest.mark.parametrize("mode, prefetch", [("drop", 0), ("pad", 2)])
def test_a_finite_router_keeps_its_state_keys_from_step_0(mode, prefetch):
    # issue 20: the state gained shared.end after the first next(); issue 33: its counts were []
    # until the first next() counted them. Now the lanes are counted on the reset before step 0
    # (Router.count_end), so every state has the same keys and types (Grain's state-spec check)
    def make():
        return Router(lane_set(mode), lanes=4, world_size=2, rank=1, seed=3, prefetch=prefetch)

    check = check_node(make, every=3)
    assert check.states[0]["shared"]["end"] == check.states[-1]["shared"]["end"]
    assert len(check.states[0]["shared"]["end"]["lane_steps"]) == 4
    assert all(_spec(s) == _spec(check.states[0]) for s in check.states)


def _spec(x):
    """A state's structure as Grain's state-spec check compares it: keys, types, list lengths."""
    if isinstance(x, dict):
        return {k: _spec(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_spec(v) for v in x]
    return type(x).__name__


def test_an_uncounted_end_is_still_checked_on_restore():
    with Router(lane_set("drop"), lanes=4, seed=3) as r:
        state = r.state_dict()  # before the first step
    state = resealed(state, lambda raw: raw["shared"].update(end={"mode": "drop", "lane_steps": []}))  # uncounted
    for lanes, needle in [
        (lane_set("pad"), "end = 'drop' but the pipeline has end = 'pad'"),
        (LaneSet(uneven), "finite run"),
    ]:
        with Router(lanes, lanes=4, seed=3) as r, pytest.raises(StateError, match=needle):
            r.reset(state)
