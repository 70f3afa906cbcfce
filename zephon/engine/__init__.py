"""The engine: what makes a pipeline elastic, whatever its operators are.

The node contract (:class:`ZNode`), the flush-and-replay :class:`Accumulator`, the
:class:`OrderedMapper` and the worker pools it shares, lanes and the lane-to-rank
:class:`Router`, lane-keyed JSON checkpoints, stable seeding and O(1)-memory permutations, and
the ``check_node`` test kit (:mod:`zephon.engine.testing`). It imports nothing of the layers
above it (data access, operators, recipes, tools), not even in examples.

This package lists what an operator author needs (the node contract and its state helpers, the
accumulator, the ordered mapper and worker pools, a lane's context and random streams, the
errors). Everything else is public in its own module: :mod:`.lanes` (rank arithmetic, lane
sets), :mod:`.end`, :mod:`.router` (``Router``, ``GlobalLoader``), :mod:`.prefetch`,
:mod:`.digest`, :mod:`.collate`, :mod:`.checkpoint`, :mod:`.workers`, :mod:`.mapper`.

A synthetic pipeline of 8 lanes, checkpointed on 4 ranks and resumed on 2:

    >>> import functools
    >>> from zephon.engine import WorkerConfig
    >>> from zephon.engine.digest import batch_sha256
    >>> from zephon.engine.router import GlobalLoader
    >>> from zephon.engine.testing import toy_lane
    >>> lane = functools.partial(toy_lane, n=None)
    >>> with GlobalLoader(lane, lanes=8, world_size=1, seed=1234) as g:
    ...     reference = [batch_sha256(next(g)) for _ in range(4)]
    >>> with GlobalLoader(lane, lanes=8, world_size=4, seed=1234, workers=WorkerConfig(2, "thread")) as g:
    ...     first = [batch_sha256(next(g)) for _ in range(2)]
    ...     state = g.state_dict()                  # lane-keyed JSON
    >>> with GlobalLoader(lane, lanes=8, world_size=2, seed=1234) as g:
    ...     g.load_state_dict(state)
    ...     rest = [batch_sha256(next(g)) for _ in range(2)]
    >>> first + rest == reference
    True
"""

from .accumulator import Accumulator
from .lanes import LaneContext
from .mapper import OrderedMapper, WorkerError
from .node import PipelineError, StateError, ZNode
from .permute import IndexPermutation
from .seeding import lane_rng
from .workers import ProcessLocal, WorkerConfig, WorkerPool

__all__ = [
    "Accumulator",
    "IndexPermutation",
    "LaneContext",
    "OrderedMapper",
    "PipelineError",
    "ProcessLocal",
    "StateError",
    "WorkerConfig",
    "WorkerError",
    "WorkerPool",
    "ZNode",
    "lane_rng",
]
