"""Which order each dataset of a recipe is planned in: the block shuffle or the stripe order.

``[shuffle] block`` (data version 3: 16 records; 0 under versions 1 and 2) is the size of the
blocks of consecutive records the block shuffle (:mod:`zephon.nodes.blockorder`) deals to the
lanes. One exception, decided from the files alone so it is the same on every machine: a dataset
with a whole-file compressed shard (``.gz``, ``.zst``) keeps the stripe order. Such a shard is
read by decompressing all of it (there is no random access into a gzip or zstd stream), and a
rank keeps two decompressed shards: under the stripe order every lane reads the same shard, under
the block order the lanes' open blocks lie in up to ``lanes x OPEN_BLOCKS`` shards, and each visit
of a block would decompress its whole shard again. Convert such a dataset to uncompressed JSON
Lines, Parquet or Arrow (compressed pages, random access) to get the block shuffle.
"""

from __future__ import annotations

from zephon.data import ShardIndex

from .spec import DatasetSpec, RecipeSpec

__all__ = ["WHOLE_FILE_COMPRESSION", "dataset_block"]

#: file name endings of shards read by decompressing the whole file
WHOLE_FILE_COMPRESSION = (".gz", ".zst", ".zstd")


def dataset_block(spec: RecipeSpec, ds: DatasetSpec, index: ShardIndex) -> int:
    """Records per block of ``ds`` under the recipe's shuffle; 0 = the stripe order (the
    recipe's ``block`` is 0, or a shard of ``ds`` is whole-file compressed)."""
    block = int(spec.shuffle.block)
    if block <= 0:
        return 0
    if any(m.path.lower().rstrip("/").endswith(WHOLE_FILE_COMPRESSION) for m in index.shards):
        return 0
    return block
