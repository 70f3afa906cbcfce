"""zephon: elastically deterministic data loading for PyTorch training.

Global batch t is the same bytes on 1, 2, 4, ... 64 data-parallel ranks, with any number of
loader workers, and after a resume on another number of ranks. See README.md.

A synthetic pipeline of 8 lanes, checkpointed on 4 ranks and resumed on 2:

    >>> import functools
    >>> from zephon.testing import toy_lane
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
from .checkpoint import FORMAT_VERSION, decode_state, encode_state, lane_key, merge_states
from .lanes import GlobalLoader, LaneContext, Router, batch_sha256, collate, lanes_of_rank, valid_world_sizes
from .mapper import OrderedMapper, WorkerError
from .node import PipelineError, StateError, ZNode
from .permute import IndexPermutation
from .seeding import lane_rng, seed_sequence, stable_u64
from .workers import PoolSet, ProcessLocal, WorkerConfig, WorkerPool

__version__ = "0.1.0"


def __getattr__(name: str):
    # Recipe sits on top of the engine and the operator library; import it lazily so that
    # `import zephon` (the core) never imports zephon.nodes.
    if name in ("Recipe", "RecipeError"):
        from . import recipe

        return getattr(recipe, name)
    raise AttributeError(f"module 'zephon' has no attribute {name!r}")


__all__ = [
    "Accumulator", "FORMAT_VERSION", "GlobalLoader", "IndexPermutation", "LaneContext", "OrderedMapper",
    "PipelineError", "PoolSet", "ProcessLocal", "Recipe", "RecipeError", "Router", "StateError", "WorkerConfig", "WorkerError", "WorkerPool", "ZNode",
    "batch_sha256", "collate", "decode_state", "encode_state", "lane_key", "lane_rng", "lanes_of_rank",
    "merge_states", "seed_sequence", "stable_u64", "valid_world_sizes",
]
