"""zephon: elastically deterministic data loading for PyTorch training.

Global batch t is the same bytes on 1, 2, 4, ... 64 data-parallel ranks, with any number of
loader workers, and after a resume on another number of ranks. See README.md.

This package is the public face of five layers, each one sub-package, importing only downwards:

==================  =====================================================================
``zephon.engine``   node contract, accumulator, ordered mapper, workers, lanes and router,
                    checkpoints, seeding, permutations, the ``check_node`` test kit
``zephon.data``     datasets (readers, indexes) and the tokenizer
``zephon.nodes``    operators, the WorkSource included (the ``nodes/`` folder)
``zephon.recipe``   the recipe: schema, preparation, lane assembly, checkpoint migrations
``zephon.tools``    command line, display, plots, demo, synthetic corpora;
``zephon.integrations``  TorchTitan
==================  =====================================================================

``zephon.titan``, ``zephon.testing``, ``zephon.demo``, ``zephon.display``, ``zephon.plots`` and
``zephon.synth`` are the short public paths of modules in those layers.

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

from zephon.engine import (
    FORMAT_VERSION,
    Accumulator,
    GlobalLoader,
    IndexPermutation,
    LaneContext,
    OrderedMapper,
    PipelineError,
    PoolSet,
    ProcessLocal,
    Router,
    StateError,
    WorkerConfig,
    WorkerError,
    WorkerPool,
    ZNode,
    batch_sha256,
    collate,
    decode_state,
    encode_state,
    lane_key,
    lane_rng,
    lanes_of_rank,
    merge_states,
    seed_sequence,
    stable_u64,
    valid_world_sizes,
)
from zephon.recipe import Recipe, RecipeError

__version__ = "0.1.0"

#: the layers, bottom up: a module imports only from its own layer or the ones before it
#: (``tests/test_layers.py`` checks every import of every file against the tree)
LAYERS = ("engine", "data", "nodes", "recipe", "tools", "integrations")

__all__ = [
    "FORMAT_VERSION",
    "Accumulator",
    "GlobalLoader",
    "IndexPermutation",
    "LaneContext",
    "OrderedMapper",
    "PipelineError",
    "PoolSet",
    "ProcessLocal",
    "Recipe",
    "RecipeError",
    "Router",
    "StateError",
    "WorkerConfig",
    "WorkerError",
    "WorkerPool",
    "ZNode",
    "batch_sha256",
    "collate",
    "decode_state",
    "encode_state",
    "lane_key",
    "lane_rng",
    "lanes_of_rank",
    "merge_states",
    "seed_sequence",
    "stable_u64",
    "valid_world_sizes",
]
