"""Batch-size and sequence-length schedules of a lane: rows per step and row length by step.

A :class:`BatchSchedule` says, from each phase's first step on, how many rows a lane contributes
to a step and how long they are. Both follow from the step alone, so every lane (and so every
rank, whatever the world size) agrees on the shape of global batch t without talking to the
others.

- **Batch size.** :class:`ScheduledBatch` groups a lane's stream of rows into micro-batches of
  ``rows_at(step)`` rows. The stream of rows is the same whatever the batch sizes: a ramp only
  changes where the micro-batch boundaries fall. Its state is the usual anchor plus the step.
- **Sequence length.** The rows of a lane change length at a *segment* boundary (a step where
  ``seq_len`` changes). :class:`PhasedLane` runs one pipeline (pack -> shuffle -> batch) per
  segment. **The carry-over rule**: at the first step of a new segment, the previous segment's
  pipeline is cut at its input (it reads no new document) and emptied: its packer flushes its
  open rows and its shuffle window delivers what it holds, in its own seeded order. The
  document pieces of every row it had not delivered are re-packed, in that order and ahead of
  any new document, into rows of the new length (:class:`Carry`); then the new segment reads on
  from the document where the previous one stopped. Nothing is dropped or read twice, and the
  rule is a function of the lane's state at the change alone (the previous pipeline's state, a
  few integers): a restore rebuilds the previous pipeline from it and replays. A document
  already split over two old rows (greedy packing) stays as two pieces (positions restart).

    >>> s = BatchSchedule([(0, 2, 64), (10, 4, 64), (20, 4, 128)])
    >>> s.rows_at(9), s.rows_at(10), s.seq_len_at(25), s.segments()
    (2, 4, 128, [(0, 64), (20, 128)])
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from zephon.engine import StateError, ZNode
from zephon.engine.node import check_state_keys, state_int

from .batch import Batch
from .pack import Pack
from .rows import PartProvenance
from .tokenize import TokDoc
from .worksource import WorkItem

__all__ = ["BatchSchedule", "Carry", "CutSource", "PhasedLane", "ScheduledBatch", "SegmentPack"]


class BatchSchedule:
    """Piecewise-constant ``(first_step, rows_per_lane, seq_len)`` phases, the first at step 0."""

    def __init__(self, phases: Sequence[tuple[int, int, int]]) -> None:
        phases = [(int(s), int(r), int(n)) for s, r, n in phases]
        if not phases or phases[0][0] != 0:
            raise ValueError("a batch schedule must start at step 0")
        steps = [s for s, _, _ in phases]
        if steps != sorted(set(steps)):
            raise ValueError(f"batch schedule steps must be strictly increasing, got {steps}")
        if any(r < 1 or n < 2 for _, r, n in phases):
            raise ValueError(f"every phase needs rows >= 1 and seq_len >= 2, got {phases}")
        self.phases: list[tuple[int, int, int]] = phases

    def phase_at(self, step: int) -> int:
        """Index of the phase in force at ``step``."""
        i = 0
        for j, (s, _, _) in enumerate(self.phases):
            if step >= s:
                i = j
        return i

    def rows_at(self, step: int) -> int:
        """Rows a lane contributes to ``step``."""
        return self.phases[self.phase_at(step)][1]

    def seq_len_at(self, step: int) -> int:
        """Tokens per row at ``step``."""
        return self.phases[self.phase_at(step)][2]

    def segments(self) -> list[tuple[int, int]]:
        """``(first_step, seq_len)`` of each run of phases with one row length."""
        out: list[tuple[int, int]] = []
        for s, _, n in self.phases:
            if not out or out[-1][1] != n:
                out.append((s, n))
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchSchedule) and other.phases == self.phases

    def __hash__(self) -> int:
        return hash(tuple(self.phases))

    def __repr__(self) -> str:
        return f"BatchSchedule({self.phases})"


class ScheduledBatch(Batch):
    """:class:`Batch` whose micro-batch ``t`` has ``schedule.rows_at(t)`` rows (``t`` counted
    from ``first_step``, the step its first micro-batch is). State: the anchor and the step."""

    node_type = "batch"

    def __init__(self, source: BaseNode, *, schedule: BatchSchedule, first_step: int = 0) -> None:
        super().__init__(source, batch_size=schedule.rows_at(first_step))
        self.schedule, self.first_step = schedule, first_step
        self.step = first_step  # the step of the next micro-batch

    def _repr_args(self):
        yield f"schedule={self.schedule.phases}"

    def clear(self) -> None:
        super().clear()
        self.step = self.first_step
        self.batch_size = self.schedule.rows_at(self.step)

    def extra_state(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        check_state_keys(self, extra, ["step"], tagged=False)
        self.step = state_int(self, "extra.step", extra["step"], self.first_step)
        self.batch_size = self.schedule.rows_at(self.step)

    def flush(self) -> None:
        super().flush()
        self.step += 1
        self.batch_size = self.schedule.rows_at(self.step)


class SegmentPack(Pack):
    """:class:`Pack` whose rows are their segments ``[(tokens, dataset, provenance), ...]``: what
    :class:`Carry` re-packs. Same decisions, so the same state, as the Pack it stands in for."""

    def _emit_row(self, segments: list[Any], used: int) -> None:
        self.rows_out += 1
        self.emit(list(segments))


class CutSource(BaseNode):
    """Its source, until :meth:`cut`: then the end of the stream. Transparent in the state (its
    state is its source's), and it does not close its source (whoever built that does)."""

    def __init__(self, source: BaseNode) -> None:
        super().__init__()
        self._inner, self._cut = source, False  # not "source": closing the pipeline leaves it open

    def cut(self) -> None:
        """From now on: the end of the stream."""
        self._cut = True

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._cut = False
        self._inner.reset(initial_state)

    def next(self) -> Any:
        if self._cut:
            raise StopIteration
        return next(self._inner)

    def get_state(self) -> dict[str, Any]:
        return self._inner.state_dict()


def _carried_doc(seg: tuple[np.ndarray, int, Any]) -> TokDoc:
    tokens, dataset, prov = seg
    parts = (int(prov.part), int(prov.parts)) if isinstance(prov, PartProvenance) else (0, 1)
    item = WorkItem(int(prov.dataset), int(prov.shard), int(prov.record), int(prov.epoch), 0, *parts)
    return TokDoc(tokens, dataset, item, offset=int(prov.tok_start), text_part=isinstance(prov, PartProvenance))


class Carry(ZNode[Any]):
    """The input of a new segment's packer: the document pieces the previous segment's pipeline
    still held at the change (the carry-over rule of :mod:`zephon.nodes.phases`), then ``front``.

    ``make_old(source)`` builds the previous segment's pack -> shuffle over ``source`` (with a
    :class:`SegmentPack`); ``old_state`` is its state at the change (when starting fresh).
    State: that state (as JSON text) and the pieces delivered while carrying; once all are
    delivered, ``front``'s state (as JSON text; "" before) and "" for the previous state, so the
    lane's state is small again.
    """

    node_type = "carry"

    def __init__(
        self, front: BaseNode, make_old: Callable[[BaseNode], BaseNode], old_state: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.front, self.make_old = front, make_old
        self._first_old = "" if old_state is None else json.dumps(old_state, sort_keys=True)
        self._old_json, self._drained, self._live = self._first_old, 0, False
        self._old: BaseNode | None = None
        self._pending: list[Any] = []

    def _repr_args(self):
        yield f"carried={self._drained}"

    def upstreams(self) -> list[BaseNode]:
        return [self.front] + ([self._old] if self._old is not None else [])

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._close_old()
        if initial_state is None:
            old, drained, upstream = self._first_old, 0, ""
        else:
            check_state_keys(self, initial_state, ("old", "drained", "upstream"))
            old, upstream = initial_state["old"], initial_state["upstream"]
            if not isinstance(old, str) or not isinstance(upstream, str):
                raise StateError(f"{self!r}: state fields 'old' and 'upstream' must be JSON text")
            drained = state_int(self, "drained", initial_state["drained"])
        self._drained, self._pending = drained, []
        self._live = bool(upstream)
        if self._live:  # everything carried: the previous segment's state is no longer needed
            self._old_json = ""
            self.front.reset(_loads(self, upstream))
            return
        if not old:
            raise StateError(f"{self!r}: no state of the previous segment to carry over")
        self._old_json = old
        cut = CutSource(self.front)
        self._old = self.make_old(cut)
        self._old.reset(_loads(self, old))
        cut.cut()
        for i in range(drained):
            if self._next_carried() is None:
                raise StateError(f"{self!r}: state says {drained} pieces were carried, the change held {i}")

    def _next_carried(self) -> TokDoc | None:
        while not self._pending:
            assert self._old is not None
            try:
                self._pending = list(next(self._old))[::-1]
            except StopIteration:
                return None
        return _carried_doc(self._pending.pop())

    def _close_old(self) -> None:
        if self._old is not None:
            close = getattr(self._old, "close", None)
            if close is not None:
                close()
            self._old = None

    def next(self) -> Any:
        if not self._live:
            doc = self._next_carried()
            if doc is not None:
                self._drained += 1
                return doc
            self._close_old()
            self._live, self._old_json = True, ""
        return next(self.front)

    def get_state(self) -> dict[str, Any]:
        upstream = json.dumps(self.front.state_dict(), sort_keys=True) if self._live else ""
        return self._tagged({"old": self._old_json, "drained": self._drained, "upstream": upstream})

    def _close_own(self) -> None:
        self._close_old()


def _loads(node: Any, text: str) -> dict[str, Any]:
    try:
        out = json.loads(text)
    except ValueError as e:
        raise StateError(f"{node!r}: a state field is not JSON text: {e}") from None
    if not isinstance(out, dict):
        raise StateError(f"{node!r}: a state field must hold a JSON object")
    return out


class PhasedLane(ZNode[Any]):
    """A lane whose row length changes at steps: one pipeline per segment of the schedule.

    ``build(k, old_state)`` returns segment ``k``'s pipeline, a :class:`ScheduledBatch` (for
    ``k > 0`` over a :class:`Carry` of ``old_state``, the previous segment's state under its
    batch node at the change). State: the segment and its pipeline's state (JSON text, so the
    keys are the same in every segment).
    """

    node_type = "phased_lane"

    def __init__(self, schedule: BatchSchedule, build: Callable[[int, dict[str, Any] | None], ScheduledBatch]) -> None:
        super().__init__()
        self.schedule, self.build = schedule, build
        self.starts = [s for s, _ in schedule.segments()]
        self._segment = 0
        self._pipe: ScheduledBatch | None = None

    def _repr_args(self):
        yield f"segment={self._segment}/{len(self.starts)}"

    def upstreams(self) -> list[BaseNode]:
        return [self._pipe] if self._pipe is not None else []

    @property
    def step(self) -> int:
        """The step of the lane's next micro-batch."""
        return self._pipe.step if self._pipe is not None else 0

    def _open(self, k: int, old: dict[str, Any] | None, state: dict[str, Any] | None) -> None:
        self._close_pipe()
        self._segment = k
        self._pipe = self.build(k, old)
        self._pipe.reset(state)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self._open(0, None, None)
            return
        check_state_keys(self, initial_state, ("segment", "inner"))
        k = state_int(self, "segment", initial_state["segment"], 0, len(self.starts) - 1)
        inner = initial_state["inner"]
        if not isinstance(inner, str):
            raise StateError(f"{self!r}: state field 'inner' must be JSON text")
        self._open(k, None, _loads(self, inner))

    def next(self) -> Any:
        assert self._pipe is not None
        k = self._segment
        if k + 1 < len(self.starts) and self._pipe.step >= self.starts[k + 1]:
            self._open(k + 1, self._pipe.source.state_dict(), None)
        return next(self._pipe)

    def get_state(self) -> dict[str, Any]:
        assert self._pipe is not None
        inner = json.dumps(self._pipe.state_dict(), sort_keys=True)
        return self._tagged({"segment": self._segment, "inner": inner})

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None

    def _close_own(self) -> None:
        self._close_pipe()
