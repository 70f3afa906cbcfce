"""Dataset layer: raw shards -> per-shard metadata and random-access record reads.

No shuffling or planning happens here: a WorkSource decides which record indices to read;
this package answers "how many records, how big is each, give me records i, j, k of shard s"::

    idx = index_dataset("wiki", "data/wiki-*.jsonl.zst")
    idx.num_records, idx.shard_offsets(), idx.record_bytes(0)
    texts = idx.read(0, [5, 1, 3])     # str, or BadRecord for bad content

Every index kind implements :class:`ShardIndex` (image-text ones :class:`ImageTextShardIndex`).
The modules: one per format (``jsonl``, ``text``, ``parquet``, ``arrow``, ``wds``,
``mm_parquet``; vision-language chat records: ``wds_chat``, ``mm_jsonl``, ``chat_records``),
``resolve`` (paths to shard files), ``cache`` (metadata cache, shard caches,
pickling), and the two indexes (``index``: text, ``multimodal``: image-text); ``tokens``:
pretokenized files (numpy, Megatron), whose index reads token-id arrays; ``nodecache``: the
node-local cache of remote shards (``$ZEPHON_SHARD_CACHE``) and download-ahead; ``tokencache``:
the node-local cache of token ids keyed by content (``$ZEPHON_TOKEN_CACHE``).
"""

from .errors import BadRecord, DataError
from .fields import FIELD_FORMATS, read_fields
from .index import DEFAULT_MAX_RECORD_BYTES, EMPTY, TEXT_MODES, DatasetIndex, index_dataset
from .multimodal import KINDS, MultimodalIndex, index_multimodal
from .nodecache import NodeCache, node_cache
from .protocol import ImageTextShardIndex, ShardIndex
from .resolve import FORMATS, MM_FORMATS, SAME_FILE, ShardMeta, default_cache_dir
from .samples import MMRecord, image_header_size
from .tokencache import TokenCache, token_cache
from .tokens import (
    BYTES_PER_TOKEN,
    TOKEN_FORMATS,
    TokenIndex,
    index_tokens,
    out_of_vocab,
    write_mds,
    write_megatron,
    write_tokens,
)

__all__ = [
    "BYTES_PER_TOKEN",
    "DEFAULT_MAX_RECORD_BYTES",
    "EMPTY",
    "FIELD_FORMATS",
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
    "NodeCache",
    "ShardIndex",
    "ShardMeta",
    "TokenCache",
    "TokenIndex",
    "default_cache_dir",
    "image_header_size",
    "index_dataset",
    "index_multimodal",
    "index_tokens",
    "node_cache",
    "out_of_vocab",
    "read_fields",
    "token_cache",
    "write_mds",
    "write_megatron",
    "write_tokens",
]
