"""Per-lane micro-batches: stack rows into arrays."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from zephon.engine import Accumulator

__all__ = ["Batch", "stack_rows"]


def stack_rows(rows: Sequence[Any]) -> Any:
    """Dicts of equal-shape arrays -> dict of stacked arrays; other values -> lists.

    >>> b = stack_rows([{"input": np.arange(3), "provenance": (0, 1)}, {"input": np.arange(3), "provenance": (2,)}])
    >>> b["input"].shape, b["provenance"]
    ((2, 3), [(0, 1), (2,)])
    """
    first = rows[0]
    if isinstance(first, dict):
        return {k: stack_rows([r[k] for r in rows]) for k in first}
    if isinstance(first, np.ndarray):
        return first[None] if len(rows) == 1 else np.stack(rows)  # one row: a view, no copy
    if isinstance(first, (int, float, np.integer, np.floating)):
        return np.asarray(rows)
    return list(rows)


class Batch(Accumulator):
    """Group ``batch_size`` rows into one micro-batch (a full batch is a flush point).

    ``drop_last`` drops a final partial batch so every step has the same shape; ``fill`` (a row)
    instead completes it with copies of that row, so no row is lost and the shape stays (a
    finite recipe with ``end = "pad"`` fills with a padding row).

    >>> from zephon.engine.testing import RangeSource
    >>> [b.tolist() for b in Batch(RangeSource(7), batch_size=3)]
    [[0, 1, 2], [3, 4, 5]]
    >>> [b.tolist() for b in Batch(RangeSource(7), batch_size=3, fill=-1)]
    [[0, 1, 2], [3, 4, 5], [6, -1, -1]]
    """

    node_type = "batch"

    def __init__(self, source: BaseNode, *, batch_size: int, drop_last: bool = True, fill: Any = None) -> None:
        super().__init__(source)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.batch_size, self.drop_last, self.fill = batch_size, drop_last, fill
        self._rows: list[Any] = []

    def _repr_args(self):
        yield f"batch_size={self.batch_size}"
        yield f"drop_last={self.drop_last}" if self.fill is None else "fill"

    def max_since(self) -> int:
        """Each flush interval emits one micro-batch, and the state moves to the next anchor as
        soon as it is delivered: ``since`` is always 0."""
        return 0

    def clear(self) -> None:
        self._rows = []

    def buffer_empty(self) -> bool:
        return not self._rows

    def accept(self, item: Any) -> None:
        self._rows.append(item)
        if len(self._rows) == self.batch_size:
            self.flush()

    def flush(self) -> None:
        rows, self._rows = self._rows, []
        if rows and len(rows) < self.batch_size and self.fill is not None:
            rows += [self.fill] * (self.batch_size - len(rows))
        if rows and (len(rows) == self.batch_size or not self.drop_last):
            self.emit(stack_rows(rows))
