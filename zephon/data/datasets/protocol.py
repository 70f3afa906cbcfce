"""The contract every dataset index implements, stated once.

The layers above (the WorkSource's plan in ``zephon.nodes``, ``zephon.recipe``'s preparation,
``zephon.tools``' provenance and reports) use an index only through these names, whatever its
kind (text: :class:`~zephon.data.datasets.index.DatasetIndex`; image-text:
:class:`~zephon.data.datasets.multimodal.MultimodalIndex`), so they are typed against the
Protocol, not a class. Like Grain's ``RandomAccessDataSource``, it is structural: anything with
these attributes and methods is an index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .resolve import ShardMeta

__all__ = ["ImageTextShardIndex", "ShardIndex"]


@runtime_checkable
class ShardIndex(Protocol):
    """A dataset's shards, their per-record metadata and thread-safe random-access reads.

    ``record_bytes(s)`` weighs records for token-weighted mixing; ``read`` returns records in
    the order asked (bad content as :class:`~zephon.data.datasets.errors.BadRecord`);
    ``fingerprint`` changes whenever a shard file does (checkpoints refuse to resume on other
    data). An index pickles as a small handle: process workers reload metadata lazily.

    >>> import os, tempfile
    >>> from zephon.data.datasets import index_dataset
    >>> root = tempfile.mkdtemp(); p = os.path.join(root, "a.txt")
    >>> _ = open(p, "w").write("one\\ntwo\\n")
    >>> isinstance(index_dataset("d", p, cache_dir=root), ShardIndex)
    True
    """

    name: str
    format: str
    max_record_bytes: int
    shards: list[ShardMeta]
    num_records: int
    fingerprint: str

    def shard_offsets(self) -> np.ndarray:
        """int64 ``[len(shards) + 1]``: the global index of each shard's first record, then the total."""
        ...

    def record_bytes(self, shard: int) -> np.ndarray:
        """int64 size in bytes of every record of ``shard`` (its weight when mixing by tokens)."""
        ...

    def read(self, shard: int, indices: Sequence[int]) -> list[Any]:
        """Records ``indices`` (0-based within ``shard``), in the order given; bad ones as BadRecord."""
        ...

    def locate(self, shard: int, record: int) -> dict[str, Any]:
        """Where a record lives, from the index alone: at least ``file`` and ``locator``."""
        ...

    def close(self) -> None:
        """Release cached decompressed shards, row groups and maps (reads reopen what they need)."""
        ...


@runtime_checkable
class ImageTextShardIndex(ShardIndex, Protocol):
    """A :class:`ShardIndex` of image-text records: also the indexed image sizes (so the plan
    counts image tokens exactly, without decoding) and each segment's source (provenance)."""

    kind: str

    def image_sizes(self, shard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(images per record, widths, heights), widths/heights flattened in record order."""
        ...

    def sources(self, shard: int, record: int) -> list[dict[str, Any]]:
        """Where each segment of a record is stored (one dict per segment, in segment order)."""
        ...
