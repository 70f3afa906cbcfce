"""The engine: what makes a pipeline elastic, whatever its operators are.

The node contract (:class:`ZNode`), the flush-and-replay :class:`Accumulator`, the
:class:`OrderedMapper` and the worker pools it shares, lanes and the lane-to-rank
:class:`Router`, lane-keyed JSON checkpoints, stable seeding and O(1)-memory permutations, and
the ``check_node`` test kit (:mod:`zephon.engine.testing`). It imports nothing of the layers
above it (data access, operators, recipes, tools), not even in examples.

A synthetic pipeline of 8 lanes, checkpointed on 4 ranks and resumed on 2:

    >>> import functools
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
from .checkpoint import (
    FORMAT_VERSION,
    LANE_ENTRY_KEYS,
    SHARED_KEY,
    STATE_KEYS,
    check_version,
    decode_state,
    encode_state,
    is_lane_key,
    lane_key,
    lane_state,
    load_state,
    merge_states,
    migrate,
    save_state,
    seal_state,
    verify_state,
)
from .collate import collate
from .digest import batch_sha256, ledger_digest
from .end import END_MODES, LaneEnd
from .lanes import LaneContext, LaneSet, check_world_size, count_lane_steps, divisors, lanes_of_rank
from .mapper import MAX_CHUNK_SIZE, OrderedMapper, WorkerError, describe_item
from .node import (
    ANCHOR,
    EXTRA,
    MAX_STATE_INT,
    SINCE,
    UPSTREAM,
    PipelineError,
    StateError,
    ZNode,
    check_state_keys,
    close_node,
    state_int,
    state_ints,
    state_node,
    upstream_nodes,
)
from .permute import IndexPermutation
from .router import GlobalLoader, Router
from .seeding import lane_rng, seed_sequence, stable_u64
from .workers import BACKENDS, PoolSet, ProcessLocal, WorkerConfig, WorkerPool

__all__ = [
    "ANCHOR",
    "BACKENDS",
    "END_MODES",
    "EXTRA",
    "FORMAT_VERSION",
    "LANE_ENTRY_KEYS",
    "MAX_CHUNK_SIZE",
    "MAX_STATE_INT",
    "SHARED_KEY",
    "SINCE",
    "STATE_KEYS",
    "UPSTREAM",
    "Accumulator",
    "GlobalLoader",
    "IndexPermutation",
    "LaneContext",
    "LaneEnd",
    "LaneSet",
    "OrderedMapper",
    "PipelineError",
    "PoolSet",
    "ProcessLocal",
    "Router",
    "StateError",
    "WorkerConfig",
    "WorkerError",
    "WorkerPool",
    "ZNode",
    "batch_sha256",
    "check_state_keys",
    "check_version",
    "check_world_size",
    "close_node",
    "collate",
    "count_lane_steps",
    "decode_state",
    "describe_item",
    "divisors",
    "encode_state",
    "is_lane_key",
    "lane_key",
    "lane_rng",
    "lane_state",
    "lanes_of_rank",
    "ledger_digest",
    "load_state",
    "merge_states",
    "migrate",
    "save_state",
    "seal_state",
    "seed_sequence",
    "stable_u64",
    "state_int",
    "state_ints",
    "state_node",
    "upstream_nodes",
    "verify_state",
]
