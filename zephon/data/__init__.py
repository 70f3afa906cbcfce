"""Data access: raw shards to per-shard metadata and random-access record reads, and the tokenizer.

Nothing here plans or shuffles: the WorkSource (an operator) decides which records to read;
this layer answers "how many records, how big is each, give me records i, j, k of shard s" and
"what are the token ids of these texts". The layer's names are those of :mod:`.datasets` and
:mod:`.tokenizer` and :mod:`.chat` (``tests/system/test_house.py`` checks the list is sorted and complete).
"""

from .chat import ChatRenderer, ConversationError
from .datasets import (
    BadRecord,
    DataError,
    DatasetIndex,
    ImageTextShardIndex,
    MultimodalIndex,
    NodeCache,
    ShardIndex,
    TokenCache,
    TokenIndex,
    index_dataset,
    index_multimodal,
    index_tokens,
    node_cache,
    token_cache,
    write_mds,
    write_megatron,
    write_tokens,
)
from .tokenizer import BUNDLED_TOKENIZER, TextTokenizer

__all__ = [
    "BUNDLED_TOKENIZER",
    "BadRecord",
    "ChatRenderer",
    "ConversationError",
    "DataError",
    "DatasetIndex",
    "ImageTextShardIndex",
    "MultimodalIndex",
    "NodeCache",
    "ShardIndex",
    "TextTokenizer",
    "TokenCache",
    "TokenIndex",
    "index_dataset",
    "index_multimodal",
    "index_tokens",
    "node_cache",
    "token_cache",
    "write_mds",
    "write_megatron",
    "write_tokens",
]
