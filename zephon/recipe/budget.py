"""What a recipe costs in memory, worst case, from its keys alone: refused before anything is
allocated when one rank's lanes would not fit the limit. Never part of the data definition, except
that data version 2's image-text shuffle window is sized from it (:data:`VL_WINDOW_BYTES`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .spec import RecipeError, RecipeSpec

__all__ = [
    "MEMORY_GB_DEFAULT",
    "VL_WINDOW_BYTES",
    "MemoryBudget",
    "memory_budget",
    "memory_limit_gb",
    "size",
]

#: The memory limit (GB, 10**9 bytes) one rank's lanes may hold when neither the recipe's
#: ``memory_gb`` nor ``$ZEPHON_MEMORY_GB`` says otherwise: what fits a typical training node's
#: share per GPU. Not part of the data definition: it only decides which recipes are refused.
MEMORY_GB_DEFAULT = 32.0

#: Data version 2's default ``[shuffle] buffer`` of a vision-language recipe: the most whole
#: micro-batches (at most 1024 rows, at least one micro-batch) whose worst case fits these
#: bytes. A function of the recipe's data keys only, never of the machine.
VL_WINDOW_BYTES = 1 << 30


def memory_limit_gb(given: float | None = None) -> float:
    """The memory limit in GB: the recipe's ``memory_gb``, else ``$ZEPHON_MEMORY_GB``, else
    :data:`MEMORY_GB_DEFAULT`.

    >>> memory_limit_gb(4.0)
    4.0
    """
    if given is not None:
        return given
    env = os.environ.get("ZEPHON_MEMORY_GB")
    if env:
        try:
            value = float(env)
        except ValueError:
            value = -1.0
        if not value > 0 or value == float("inf"):
            raise RecipeError(
                f"ZEPHON_MEMORY_GB = {env!r} is not a positive number of GB; set e.g. ZEPHON_MEMORY_GB=16"
            )
        return value
    return MEMORY_GB_DEFAULT


#: bytes per token of a row: input, labels, positions (int64), document_ids (int32), dataset (int16)
TOKEN_BYTES = 30
#: an image-text row with ``[vision] mrope`` adds mrope_positions (3 x int64) per token
MROPE_TOKEN_BYTES = 24
#: image-text work chunks a lane has in flight at most (decoded samples waiting for the packer)
CHUNKS_IN_FLIGHT = 2


@dataclass(frozen=True)
class MemoryBudget:
    """The most bytes one lane of a recipe holds, worst case, from its keys alone: the shuffle
    window, the micro-batch being built (and a packer's open rows), and for image-text lanes the
    decoded samples in flight. An image-text row counts its ``pixel_values`` too: each image
    token is ``merge_size**2`` patches of ``patch_dim`` float32s (24,576 bytes with the default
    ``[vision]``), and every token of a row may be one, unless ``max_images_per_row`` /
    ``max_images_per_batch`` and ``max_pixels`` bound the images' tokens lower.

    >>> b = MemoryBudget(row_bytes=100, window_rows=4, window_bytes=400, batch_bytes=300,
    ...                  in_flight_bytes=0, micro_batch_bytes=200, limit_gb=1.0)
    >>> b.lane_bytes, b.rank_bytes(lanes=2, prefetch=3)
    (700, 2600)
    """

    row_bytes: int  #: one row, worst case
    window_rows: int  #: rows one lane's shuffle window holds (image-text: whole micro-batches)
    window_bytes: int  #: the shuffle window, worst case
    batch_bytes: int  #: the micro-batch being built and a packer's open rows
    in_flight_bytes: int  #: image-text: decoded samples of the chunks in flight
    micro_batch_bytes: int  #: one lane's micro-batch (what a prefetched local batch holds per lane)
    limit_gb: float  #: the limit one rank's lanes must fit (``memory_gb``, ``$ZEPHON_MEMORY_GB``)

    @property
    def lane_bytes(self) -> int:
        """The bytes one lane holds at most."""
        return self.window_bytes + self.batch_bytes + self.in_flight_bytes

    def rank_bytes(self, lanes: int, prefetch: int) -> int:
        """The bytes a rank running ``lanes`` lanes with ``prefetch`` local batches ahead holds."""
        return lanes * (self.lane_bytes + prefetch * self.micro_batch_bytes)

    def describe(self, lanes: int, prefetch: int) -> str:
        """One line: the budget per lane, its parts, and a rank's total against the limit."""
        return (
            f"memory budget per lane: {size(self.lane_bytes)} (shuffle window {self.window_rows} rows x "
            f"{size(self.row_bytes)} = {size(self.window_bytes)}; micro-batch being built and open rows "
            f"{size(self.batch_bytes)}; in flight {size(self.in_flight_bytes)}); {lanes} lane(s) on a rank "
            f"with {prefetch} batches prefetched: {size(self.rank_bytes(lanes, prefetch))} of the "
            f"{self.limit_gb:g} GB limit"
        )


def size(n: float) -> str:
    """Bytes for a message: ``"1.23 GB"``, ``"4.56 MB"`` (powers of 10).

    >>> size(52_690_000_000), size(63_000_000), size(1500)
    ('52.69 GB', '63.00 MB', '0.00 MB')
    """
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def memory_budget(spec: RecipeSpec) -> MemoryBudget:
    """The most bytes one lane of ``spec`` holds, worst case (see :class:`MemoryBudget`)."""
    L, rows = spec.seq_len + 1, spec.rows_per_lane
    limit = memory_limit_gb(spec.memory_gb)
    if not spec.multimodal:
        row = L * TOKEN_BYTES
        return MemoryBudget(
            row_bytes=row,
            window_rows=spec.shuffle.buffer,
            window_bytes=spec.shuffle.buffer * row,
            batch_bytes=(rows + spec.pack.max_open) * row,
            in_flight_bytes=0,
            micro_batch_bytes=rows * row,
            limit_gb=limit,
        )
    c = spec.vision.config
    per_token = TOKEN_BYTES + (MROPE_TOKEN_BYTES if c.mrope else 0)
    pixels = c.merge_size**2 * c.patch_dim * 4  # float32 patches per image token
    per_image = max(1, c.max_pixels // (c.factor * c.factor))  # smart resize keeps h x w <= max_pixels
    batch_cap = c.max_images_per_batch * per_image  # a micro-batch's images, so a row's and a sample's too
    row_images = min(L, batch_cap) if c.max_images_per_row == 0 else min(L, batch_cap, c.max_images_per_row * per_image)
    batch_images = min(rows * row_images, batch_cap)
    row = L * per_token + row_images * pixels
    micro = rows * L * per_token + batch_images * pixels
    micro_batches = -(-spec.shuffle.buffer // rows)
    return MemoryBudget(
        row_bytes=row,
        window_rows=micro_batches * rows,
        window_bytes=micro_batches * micro,
        batch_bytes=micro,
        in_flight_bytes=CHUNKS_IN_FLIGHT * spec.workers.vision_chunk_size * row,  # a sample fits one row
        micro_batch_bytes=micro,
        limit_gb=limit,
    )
