"""zephon: elastically deterministic data loading for PyTorch training.

Global batch t is the same bytes on 1, 2, 4, ... 64 data-parallel ranks, with any number of
loader workers, and after a resume on another number of ranks. See README.md.

This package is the public face of six layers, each one sub-package, importing only downwards:

==================  =====================================================================
``zephon.engine``   node contract, accumulator, ordered mapper, workers, lanes and router,
                    checkpoints, seeding, permutations, the ``check_node`` test kit
``zephon.data``     datasets (readers, indexes) and the tokenizer
``zephon.nodes``    operators, the WorkSource included (the ``nodes/`` folder)
``zephon.recipe``   the recipe: schema, preparation, lane assembly, checkpoint migrations
``zephon.tools``    command line, display, plots, demo, synthetic corpora
``zephon.integrations``  TorchTitan, plain torch, HF Trainer and datasets, Lightning
==================  =====================================================================

Every module has one public path, its place in the layers: ``zephon.tools.demo``,
``zephon.engine.testing``, ``zephon.integrations.torchtitan``, ... (no short aliases).

Quickstart (the README has more; the engine's own example, with no operators at all, is in
:mod:`zephon.engine`):

    >>> from zephon.tools.demo import demo_recipe
    >>> import tempfile
    >>> recipe = demo_recipe(tempfile.mkdtemp(), scale=0.01).replace(shuffle={"buffer": 1})
    >>> with recipe.global_loader(world_size=1) as g1, recipe.global_loader(world_size=4) as g4:
    ...     batch_sha256(next(g1)) == batch_sha256(next(g4))
    True
"""

from zephon.data import DataError
from zephon.engine import PipelineError, StateError, WorkerConfig, WorkerError
from zephon.engine.digest import batch_sha256
from zephon.engine.router import GlobalLoader
from zephon.recipe import Recipe, RecipeError

__version__ = "0.1.0"

#: the layers, bottom up: a module imports only from its own layer or the ones before it
#: (``tests/system/test_layers.py`` checks every import of every file against the tree)
LAYERS = ("engine", "data", "nodes", "recipe", "tools", "integrations")

__all__ = [
    "DataError",
    "GlobalLoader",
    "PipelineError",
    "Recipe",
    "RecipeError",
    "StateError",
    "WorkerConfig",
    "WorkerError",
    "batch_sha256",
]
