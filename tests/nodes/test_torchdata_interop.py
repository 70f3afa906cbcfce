"""zephon nodes compose with torchdata's own nodes, both ways, and resume exactly; closing the last
node stops every thread and pool underneath, through torchdata nodes too."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from torchdata.nodes import Batcher, IterableWrapper, Loader, ParallelMapper, Prefetcher

from zephon.engine import OrderedMapper, WorkerConfig
from zephon.engine.node import close_node, upstream_nodes
from zephon.engine.testing import RangeSource, assert_no_leaks, check_node
from zephon.nodes import Batch, WindowShuffle


def _rows(n: int) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full(3, i, np.int64)} for i in range(n)]


def test_torchdata_source_under_zephon_operators_resumes_at_every_step():
    r = check_node(lambda: Batch(WindowShuffle(IterableWrapper(_rows(23)), buffer=5, seed=3, lane=0), batch_size=2))
    assert r.steps == 11


def test_torchdata_parallel_mapper_under_zephon_batch_resumes_at_every_step():
    def make():
        mapped = ParallelMapper(
            IterableWrapper(range(30)),
            lambda i: {"x": np.arange(i, i + 4)},
            num_workers=2,
            in_order=True,
            method="thread",
        )
        return Batch(mapped, batch_size=4)

    assert check_node(make).steps == 7


def _zephon_under_torchdata_batcher():
    return Batcher(WindowShuffle(RangeSource(40), buffer=6, seed=1, lane=0), batch_size=3, drop_last=True)


def test_zephon_node_under_torchdata_batcher_and_loader_resumes_exactly():
    ref = list(Loader(_zephon_under_torchdata_batcher()))
    for k in (0, 1, 4, 9):
        loader = Loader(_zephon_under_torchdata_batcher())
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(loader.state_dict()))  # plain JSON all the way down
        resumed = Loader(_zephon_under_torchdata_batcher())
        resumed.load_state_dict(state)
        assert head + list(resumed) == ref, k


def _mapper_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("zephon-worker")}


@pytest.mark.parametrize("top", ["zephon", "torchdata"])
def test_close_reaches_through_torchdata_nodes(top):
    before = {t for t in threading.enumerate() if t.is_alive()}
    mapper = OrderedMapper(RangeSource(200), lambda x: {"x": np.array([x])}, workers=WorkerConfig(2, "thread"))
    middle = Prefetcher(mapper, prefetch_factor=4)  # torchdata: no close() of its own
    node = Batch(middle, batch_size=4) if top == "zephon" else Batcher(middle, batch_size=4)
    assert next(iter(node)) is not None and _mapper_threads()  # the mapper's private pool is running
    assert mapper in upstream_nodes(middle)
    if top == "zephon":
        node.close()
        assert "Prefetcher" in node.describe()  # the graph is walked through torchdata nodes too
    else:
        close_node(node)
    assert_no_leaks(before)
    assert mapper.closed
