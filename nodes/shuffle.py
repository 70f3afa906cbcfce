"""Seeded per-lane shuffle of rows, checkpointed without its buffer."""

from __future__ import annotations

from typing import Any

from torchdata.nodes import BaseNode

from zephon.engine import Accumulator, lane_rng
from zephon.engine.node import check_state_keys, state_int

__all__ = ["WindowShuffle"]


class WindowShuffle(Accumulator):
    """Collect ``buffer`` items, emit them in a seeded random order, repeat.

    Lanes pass different ``phase`` values so that their windows end at different steps (see
    the constructor). The permutation of window w comes from the stream (seed, lane, "shuffle", epoch=0,
    counter=w), so replaying a window reproduces it exactly. Every item is emitted exactly once
    (unlike a reservoir buffer, nothing leaks across a checkpoint); a restore replays at most
    one window.

    >>> from zephon.engine.testing import RangeSource
    >>> out = list(WindowShuffle(RangeSource(8), buffer=4, seed=0, lane=0))
    >>> sorted(out[:4]), sorted(out[4:])   # each window of 4 is a permutation of its items
    ([0, 1, 2, 3], [4, 5, 6, 7])
    >>> out == list(WindowShuffle(RangeSource(8), buffer=4, seed=0, lane=0))   # seeded
    True
    """

    node_type = "shuffle"

    def __init__(
        self, source: BaseNode, *, buffer: int, seed: int, lane: int, name: str = "shuffle", phase: int = 0
    ) -> None:
        super().__init__(source)
        if not isinstance(buffer, int) or buffer < 1:
            raise ValueError(f"shuffle.buffer must be a positive integer (1 = no shuffle), got {buffer!r}")
        if not 0 <= phase < buffer:
            raise ValueError(f"shuffle phase must be in [0, buffer), got {phase}")
        self.buffer, self.seed, self.lane, self.name = buffer, seed, lane, name
        # the first window is `phase` items shorter: lanes given different phases refill their
        # windows at different steps, so a rank's work per step stays even instead of bursting
        self.phase = phase
        self._items: list[Any] = []
        self._window = 0

    def _repr_args(self):
        yield f"buffer={self.buffer}"
        yield f"lane={self.lane}"

    def clear(self) -> None:
        self._items = []
        self._window = 0

    def buffer_empty(self) -> bool:
        return not self._items

    def extra_state(self) -> dict[str, Any]:
        return {"window": self._window}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        check_state_keys(self, extra, ["window"], tagged=False)
        self._window = state_int(self, "extra.window", extra["window"])

    def max_since(self) -> int:
        """A window delivers at most ``buffer`` items, and once all are delivered the state moves
        to the next anchor: ``since`` is below ``buffer``."""
        return self.buffer - 1

    def accept(self, item: Any) -> None:
        self._items.append(item)
        size = self.buffer - self.phase if self._window == 0 and self.phase else self.buffer
        if len(self._items) >= size:
            self.flush()

    def flush(self) -> None:
        items, self._items = self._items, []
        if not items:
            return
        order = lane_rng(self.seed, self.lane, self.name, 0, self._window).permutation(len(items))
        for i in order:
            self.emit(items[i])

    def on_flush(self) -> None:
        self._window += 1
