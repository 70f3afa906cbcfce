"""Data access: raw shards to per-shard metadata and random-access record reads, and the tokenizer.

Nothing here plans or shuffles: the WorkSource (an operator) decides which records to read;
this layer answers "how many records, how big is each, give me records i, j, k of shard s" and
"what are the token ids of these texts". The layer's names are those of :mod:`.datasets` and
:mod:`.tokenizer` (each package states its own list once).
"""

from . import datasets
from .datasets import *  # noqa: F403  # the names in datasets.__all__
from .tokenizer import BUNDLED_TOKENIZER, TextTokenizer, set_tokenizers_parallelism

__all__ = [*datasets.__all__, "BUNDLED_TOKENIZER", "TextTokenizer", "set_tokenizers_parallelism"]
