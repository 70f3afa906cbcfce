"""Where a finite run ends: a global step boundary that is the same on every world size.

The lane set says how many micro-batches each lane holds (:class:`LaneEnd`), and every rank stops
before the same step, in one of two modes: ``"drop"`` (the last step is the last one every lane
can fill) or ``"pad"`` (the run lasts as long as the longest lane; a lane past its end delivers
its lane set's padding item).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .node import StateError

__all__ = ["END_MODES", "LaneEnd"]

#: how a finite run ends: "drop" = after the last step every lane can fill, "pad" = after the
#: longest lane's last micro-batch, shorter lanes delivering padding items until then
END_MODES = ("drop", "pad")


@dataclass(frozen=True)
class LaneEnd:
    """Where a finite run ends: how many micro-batches each lane holds, and the end mode.

    The run's last global step is a boundary that does not depend on the world size:
    ``"drop"`` ends after ``min(lane_steps)`` steps (every step full; the longer lanes' last
    micro-batches are never delivered); ``"pad"`` ends after ``max(lane_steps)`` steps (every
    micro-batch delivered once; a lane past its own end contributes its padding item).

    >>> end = LaneEnd("pad", (3, 5, 4))
    >>> end.steps, end.holds(0, 2), end.holds(0, 3), end.unused
    (5, True, False, 3)
    >>> LaneEnd("drop", (3, 5, 4)).steps, LaneEnd("drop", (3, 5, 4)).unused
    (3, 3)
    >>> LaneEnd.from_json(end.to_json(), lanes=3) == end
    True
    """

    mode: str
    lane_steps: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.mode not in END_MODES:
            raise ValueError(f"end mode must be one of {END_MODES}, got {self.mode!r}")
        if not self.lane_steps or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.lane_steps):
            raise ValueError(f"lane_steps must be non-negative integers, one per lane, got {self.lane_steps!r}")

    @property
    def lanes(self) -> int:
        """The lane count these counts are for."""
        return len(self.lane_steps)

    @property
    def steps(self) -> int:
        """Global steps the run has (the same on every world size)."""
        return min(self.lane_steps) if self.mode == "drop" else max(self.lane_steps)

    def holds(self, lane: int, step: int) -> bool:
        """Whether lane ``lane`` has a micro-batch of its own at (0-based) step ``step``."""
        return step < self.lane_steps[lane]

    @property
    def unused(self) -> int:
        """Lane micro-batches that are never delivered ("drop") or padding items ("pad")."""
        if self.mode == "drop":
            return sum(n - self.steps for n in self.lane_steps)
        return sum(self.steps - n for n in self.lane_steps)

    def describe(self) -> str:
        """One line: where the data ended and what the end mode did with the lanes' tails."""
        lo, hi = min(self.lane_steps), max(self.lane_steps)
        what = (
            f"{self.unused} lane micro-batches after the shortest lane's end were not delivered"
            if self.mode == "drop"
            else f"{self.unused} lane micro-batches of padding (labels -100) filled the shorter lanes"
        )
        return (
            f"the data ended after {self.steps} steps (end = {self.mode!r}; lanes hold {lo}..{hi} micro-batches; "
            f"{what})"
        )

    def to_json(self) -> dict[str, Any]:
        """The checkpoint form (``shared.end``)."""
        return {"mode": self.mode, "lane_steps": list(self.lane_steps)}

    @staticmethod
    def uncounted_json(mode: str) -> dict[str, Any]:
        """The checkpoint form of a finite run whose lanes are not counted yet: ``lane_steps``
        empty. Why: a state has the same keys at every step, and a state taken before the first
        step (DCP asks for one to load into) must not start a count (a pass over the data).

        >>> LaneEnd.uncounted_json("pad")
        {'mode': 'pad', 'lane_steps': []}
        """
        return {"mode": mode, "lane_steps": []}

    @staticmethod
    def is_uncounted(value: Any) -> bool:
        """Whether ``value`` is :meth:`uncounted_json`'s form (a real end counts at least one lane)."""
        return isinstance(value, dict) and value.get("lane_steps") == [] and value.get("mode") in END_MODES

    @classmethod
    def from_json(cls, value: Any, lanes: int | None = None) -> LaneEnd:
        """Parse :meth:`to_json`'s form, refusing a malformed one (or one for another lane
        count) with a :class:`StateError`."""
        try:
            end = cls(str(value["mode"]), tuple(value["lane_steps"]))
        except (TypeError, KeyError, ValueError) as e:
            raise StateError(f"checkpoint 'shared.end' must be {{'mode', 'lane_steps'}}, got {value!r} ({e})") from None
        if lanes is not None and end.lanes != lanes:
            raise StateError(f"checkpoint 'shared.end' counts {end.lanes} lanes, the pipeline has {lanes}")
        return end
