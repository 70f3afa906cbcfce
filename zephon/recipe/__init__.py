"""Assembly: a recipe describes a whole pipeline; this layer turns it into lanes.

One module per job: :mod:`~zephon.recipe.spec` (the schema: frozen dataclasses, each
key declared once, the way :mod:`~zephon.recipe.keys` says), :mod:`~zephon.recipe.budget` (the
worst-case memory of a recipe), :mod:`~zephon.recipe.parse` (TOML into the schema, and the cross-field
rules), :mod:`~zephon.recipe.prepare` (tokenizer, indexes, token estimates, the work plan),
:mod:`~zephon.recipe.build` (each lane's pipeline of operators),
:mod:`~zephon.recipe.phases` (batch-size and sequence-length schedules: ``[[batch_schedule]]``),
:mod:`~zephon.recipe.migrations` (how lane states moved between checkpoint formats), and
:mod:`~zephon.recipe.recipe` (the :class:`Recipe` that ties them together) and
:mod:`~zephon.recipe.runtime` (:class:`RankBatches`: one rank's batches, step by step),
:mod:`~zephon.recipe.peers` (model-parallel peers of a DP rank reading once),
:mod:`~zephon.recipe.loader_metrics` (per-step loader metrics for dashboards), and
:mod:`~zephon.recipe.ledger` (the batch ledger's file format and :class:`LedgerWriter`).
"""

from .budget import MemoryBudget
from .estimate import BadSamplesWarning, TokenEstimate
from .loader_metrics import LoaderMetrics
from .parse import parse_recipe
from .prepare import Prepared, prepare
from .recipe import Recipe
from .runtime import RankBatches
from .spec import DATA_VERSION, RecipeError, RecipeSpec

__all__ = [
    "DATA_VERSION",
    "BadSamplesWarning",
    "LoaderMetrics",
    "MemoryBudget",
    "Prepared",
    "RankBatches",
    "Recipe",
    "RecipeError",
    "RecipeSpec",
    "TokenEstimate",
    "parse_recipe",
    "prepare",
]
