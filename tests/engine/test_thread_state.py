"""state_dict() from another thread (issue 21, class 6): before the first batch and during
iteration, a loader's state is a consistent snapshot (it resumes exactly at the batch after the
last one delivered when it was taken) and the iterating thread never crashes.

Real threads, many repetitions: a TorchTitan checkpointer or a monitoring thread may ask for the
state at any moment."""

from __future__ import annotations

import functools
import threading

import pytest

from zephon.engine import WorkerConfig
from zephon.engine.digest import batch_sha256
from zephon.engine.router import GlobalLoader, Router
from zephon.engine.testing import toy_lane

LANE = functools.partial(toy_lane, n=None)
STEPS = 12


@functools.cache
def reference() -> list[str]:
    with GlobalLoader(LANE, lanes=4, world_size=1, seed=5) as g:
        return [batch_sha256(next(g)) for _ in range(STEPS + 1)]


def race(make, rounds: int) -> list[dict]:
    """``rounds`` times: one thread iterates STEPS batches of a fresh loader while another takes
    states from before its first batch to after its last; every state taken, with the errors
    of both threads (none expected)."""
    states: list[dict] = []
    errors: list[BaseException] = []
    for _ in range(rounds):
        loader = make()
        start = threading.Barrier(2)
        done = threading.Event()

        def iterate(loader=loader, start=start, done=done) -> None:
            try:
                start.wait()
                for _ in range(STEPS):
                    next(loader)
            except BaseException as e:
                errors.append(e)
            finally:
                done.set()

        def snapshot(loader=loader, start=start, done=done) -> None:
            try:
                start.wait()
                while not done.is_set():
                    states.append(loader.state_dict())
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=iterate), threading.Thread(target=snapshot)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        loader.close()
        assert not errors, errors[:3]
    return states


def check_resumes(states: list[dict]) -> None:
    """Every state resumes at the step it names, with the reference's next batch."""
    by_step: dict[int, dict] = {}
    for st in states:
        by_step.setdefault(st["step"], st)
    assert 0 in by_step, "no state from before the first batch was taken"
    for step, st in sorted(by_step.items()):
        with GlobalLoader(LANE, lanes=4, world_size=2, seed=5) as g:
            g.load_state_dict(st)
            assert batch_sha256(next(g)) == reference()[step], f"the state at step {step} does not resume there"


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("workers", [WorkerConfig(0), WorkerConfig(2, "thread")])
def test_router_state_from_another_thread(prefetch, workers):
    states = race(lambda: Router(LANE, lanes=4, world_size=1, seed=5, prefetch=prefetch, workers=workers), 40)
    check_resumes(states)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_global_loader_state_from_another_thread(prefetch):
    # two ranks in one loader: a state must never mix rank 0 after step t with rank 1 before it
    states = race(lambda: GlobalLoader(LANE, lanes=4, world_size=2, seed=5, prefetch=prefetch), 40)
    assert all(st["lane_00000"] is not None for st in states)
    check_resumes(states)
