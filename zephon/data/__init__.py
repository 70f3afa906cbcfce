"""Data access: raw shards to per-shard metadata and random-access record reads, and the tokenizer.

Nothing here plans or shuffles: the WorkSource (an operator) decides which records to read;
this layer answers "how many records, how big is each, give me records i, j, k of shard s" and
"what are the token ids of these texts". The layer's names are those of :mod:`.datasets` and
:mod:`.tokenizer` (``tests/system/test_house.py`` checks the list is sorted and complete).
"""

from .datasets import (
    BYTES_PER_TOKEN,
    DEFAULT_MAX_RECORD_BYTES,
    EMPTY,
    FORMATS,
    KINDS,
    MM_FORMATS,
    SAME_FILE,
    TEXT_MODES,
    TOKEN_FORMATS,
    BadRecord,
    DataError,
    DatasetIndex,
    ImageTextShardIndex,
    MMRecord,
    MultimodalIndex,
    ShardIndex,
    ShardMeta,
    TokenIndex,
    default_cache_dir,
    image_header_size,
    index_dataset,
    index_multimodal,
    index_tokens,
    out_of_vocab,
    write_mds,
    write_megatron,
    write_tokens,
)
from .tokenizer import BUNDLED_TOKENIZER, TextTokenizer, set_tokenizers_parallelism

__all__ = [
    "BUNDLED_TOKENIZER",
    "BYTES_PER_TOKEN",
    "DEFAULT_MAX_RECORD_BYTES",
    "EMPTY",
    "FORMATS",
    "KINDS",
    "MM_FORMATS",
    "SAME_FILE",
    "TEXT_MODES",
    "TOKEN_FORMATS",
    "BadRecord",
    "DataError",
    "DatasetIndex",
    "ImageTextShardIndex",
    "MMRecord",
    "MultimodalIndex",
    "ShardIndex",
    "ShardMeta",
    "TextTokenizer",
    "TokenIndex",
    "default_cache_dir",
    "image_header_size",
    "index_dataset",
    "index_multimodal",
    "index_tokens",
    "out_of_vocab",
    "set_tokenizers_parallelism",
    "write_mds",
    "write_megatron",
    "write_tokens",
]
