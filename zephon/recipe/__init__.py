"""Assembly: a recipe describes a whole pipeline; this layer turns it into lanes.

One module per job: :mod:`~zephon.recipe.spec` (the schema: frozen dataclasses, each
key declared once, the way :mod:`~zephon.recipe.keys` says), :mod:`~zephon.recipe.budget` (the
worst-case memory of a recipe), :mod:`~zephon.recipe.parse` (TOML into the schema, and the cross-field
rules), :mod:`~zephon.recipe.prepare` (tokenizer, indexes, token estimates, the work plan),
:mod:`~zephon.recipe.build` (each lane's pipeline of operators),
:mod:`~zephon.recipe.migrations` (how lane states moved between checkpoint formats), and
:mod:`~zephon.recipe.recipe` (the :class:`Recipe` that ties them together) and
:mod:`~zephon.recipe.runtime` (:class:`RankBatches`: one rank's batches, step by step),
:mod:`~zephon.recipe.peers` (model-parallel peers of a DP rank reading once),
:mod:`~zephon.recipe.loader_metrics` (per-step loader metrics for dashboards), and
:mod:`~zephon.recipe.ledger` (the batch ledger's file format and :class:`LedgerWriter`).
"""

from .budget import MemoryBudget
from .build import RecipeLanes, build_lane
from .estimate import BadSamplesWarning, TokenEstimate, bad_samples_message, estimate_tokens
from .keys import LIMITS, max_workers
from .ledger import LEDGER_DIR, LEDGER_GLOB, LEDGER_VERSION, LedgerWriter, dataset_tokens, ledger_file
from .loader_metrics import LoaderMetrics, metered
from .migrations import LANE_MIGRATIONS
from .parse import parse_recipe
from .peers import FollowerBatches, LeaderBatches, PeerLink, definition_digest
from .prepare import Prepared, prepare
from .recipe import Recipe
from .runtime import RankBatches
from .spec import (
    DATA_VERSION,
    DatasetSpec,
    MixingSpec,
    PackSpec,
    RecipeError,
    RecipeSpec,
    ShuffleSpec,
    TokenizerSpec,
    VisionSpec,
    WorkersSpec,
)

__all__ = [
    "DATA_VERSION",
    "LANE_MIGRATIONS",
    "LEDGER_DIR",
    "LEDGER_GLOB",
    "LEDGER_VERSION",
    "LIMITS",
    "BadSamplesWarning",
    "DatasetSpec",
    "FollowerBatches",
    "LeaderBatches",
    "LedgerWriter",
    "LoaderMetrics",
    "MemoryBudget",
    "MixingSpec",
    "PackSpec",
    "PeerLink",
    "Prepared",
    "RankBatches",
    "Recipe",
    "RecipeError",
    "RecipeLanes",
    "RecipeSpec",
    "ShuffleSpec",
    "TokenEstimate",
    "TokenizerSpec",
    "VisionSpec",
    "WorkersSpec",
    "bad_samples_message",
    "build_lane",
    "dataset_tokens",
    "definition_digest",
    "estimate_tokens",
    "ledger_file",
    "max_workers",
    "metered",
    "parse_recipe",
    "prepare",
]
