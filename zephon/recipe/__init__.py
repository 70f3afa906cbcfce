"""Assembly: a recipe describes a whole pipeline; this layer turns it into lanes.

:class:`Recipe` validates a TOML (or dict) description up front, prepares what it needs (the
tokenizer, dataset indexes, token estimates, the work plan) and builds each lane's pipeline
from the operators of :mod:`zephon.nodes`.
"""

from .recipe import DatasetSpec, Recipe, RecipeError, TokenEstimate, estimate_tokens

__all__ = ["DatasetSpec", "Recipe", "RecipeError", "TokenEstimate", "estimate_tokens"]
