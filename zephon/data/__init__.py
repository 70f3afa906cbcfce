"""Data access: raw shards to per-shard metadata and random-access record reads, and the tokenizer.

Nothing here plans or shuffles: the WorkSource (an operator) decides which records to read;
this layer answers "how many records, how big is each, give me records i, j, k of shard s" and
"what are the token ids of these texts". The layer's names are those of :mod:`.datasets` and
:mod:`.tokenizer` and :mod:`.chat` (``tests/system/test_house.py`` checks the list is sorted and complete).
"""

from .chat import (
    CHAT_FORMATS,
    CHAT_TOKENIZER,
    LOSS_ON,
    SHAREGPT_ROLES,
    TEMPLATES,
    ChatEncoding,
    ChatRenderer,
    ConversationError,
    load_chat_template,
    parse_conversation,
    select_mask,
)
from .datasets import (
    DEFAULT_MAX_RECORD_BYTES,
    EMPTY,
    FORMATS,
    KINDS,
    MM_FORMATS,
    SAME_FILE,
    TEXT_MODES,
    BadRecord,
    DataError,
    DatasetIndex,
    ImageTextShardIndex,
    MMRecord,
    MultimodalIndex,
    ShardIndex,
    ShardMeta,
    default_cache_dir,
    image_header_size,
    index_dataset,
    index_multimodal,
)
from .tokenizer import BUNDLED_TOKENIZER, TextTokenizer, set_tokenizers_parallelism

__all__ = [
    "BUNDLED_TOKENIZER",
    "CHAT_FORMATS",
    "CHAT_TOKENIZER",
    "DEFAULT_MAX_RECORD_BYTES",
    "EMPTY",
    "FORMATS",
    "KINDS",
    "LOSS_ON",
    "MM_FORMATS",
    "SAME_FILE",
    "SHAREGPT_ROLES",
    "TEMPLATES",
    "TEXT_MODES",
    "BadRecord",
    "ChatEncoding",
    "ChatRenderer",
    "ConversationError",
    "DataError",
    "DatasetIndex",
    "ImageTextShardIndex",
    "MMRecord",
    "MultimodalIndex",
    "ShardIndex",
    "ShardMeta",
    "TextTokenizer",
    "default_cache_dir",
    "image_header_size",
    "index_dataset",
    "index_multimodal",
    "load_chat_template",
    "parse_conversation",
    "select_mask",
    "set_tokenizers_parallelism",
]
