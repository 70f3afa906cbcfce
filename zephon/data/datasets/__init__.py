"""Dataset layer: raw text shards -> per-shard metadata and random-access record reads.

No shuffling or planning happens here: a WorkSource decides which record indices to read;
this package answers "how many records, how big is each, give me records i, j, k of shard s".

    idx = index_dataset("wiki", "data/wiki-*.jsonl.zst")
    idx.num_records, idx.shard_offsets(), idx.record_bytes(0)
    texts = idx.read(0, [5, 1, 3])     # str, or BadRecord for bad content
"""

from .errors import BadRecord, DataError
from .index import (
    DEFAULT_MAX_RECORD_BYTES,
    FORMATS,
    TEXT_MODES,
    DatasetIndex,
    ShardMeta,
    default_cache_dir,
    index_dataset,
)
from .multimodal import KINDS, MM_FORMATS, MMRecord, MultimodalIndex, image_header_size, index_multimodal

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES",
    "FORMATS",
    "KINDS",
    "MM_FORMATS",
    "TEXT_MODES",
    "BadRecord",
    "DataError",
    "DatasetIndex",
    "MMRecord",
    "MultimodalIndex",
    "ShardMeta",
    "default_cache_dir",
    "image_header_size",
    "index_dataset",
    "index_multimodal",
]
