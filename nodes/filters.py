"""Filters on the lane: :class:`FilterCounter` counts what the rules dropped, and runs the
``stateful`` rules in lane order.

A recipe's ``[[filters]]`` are rules of the record pipeline (:mod:`zephon.nodes.stages`), decided
by the workers between the read and the encoder; a dropped record travels on as a
:class:`~zephon.nodes.stages.FilteredDoc` (no tokens) and :class:`FilterCounter`, right after the
mapper, counts it per (rule, dataset) in the lane's state and drops it.

Why this is elastic and resumable without new machinery: every worker-side decision is a
function of the record (its text, its dataset, its (shard, record) id) and of the recipe alone,
never of what a lane saw before (exact duplicates too: :mod:`zephon.nodes.stages.dedup`). The
parts of a long document (``[mixing] split_tokens``) are decided on the whole record, so they
are kept or dropped together; the counter counts a dropped record once. A ``stateful`` rule
keeps state across its lane's documents: it runs here, in lane order, its state in the lane's
checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torchdata.nodes import BaseNode

from zephon.engine import StateError, ZNode
from zephon.engine.node import UPSTREAM, check_state_keys, state_ints, state_node

from .stages import Carried, FilteredDoc, RuleStage
from .tokenize import TokDoc
from .userfn import FilterError, StatefulFunction
from .worksource import WorkItem

__all__ = ["FILTER_KINDS", "FilterCounter"]

#: the kinds of a ``[[filters]]`` entry: built-in rules, and user code (``function``: keep or
#: drop; ``transform``: a new text; ``stateful``: a class run on the lane; ``stage``: a rule class)
FILTER_KINDS = ("length", "regex", "dedup", "field", "function", "transform", "stateful", "stage", "image_size")


class FilterCounter(ZNode[Any]):
    """Drop :class:`FilteredDoc` s, counting them per (rule, dataset) once per record (at its
    first part), and run the ``stateful`` rules on the lane's kept documents, in lane order
    (their instances' states travel in this node's state; a multi-part record's verdict, made
    at its first part, holds for its other parts). State: the counts, the stateful rules' states
    and verdicts in progress, and the upstream's state at the same point (no replay)."""

    node_type = "filter_counter"

    def __init__(
        self,
        source: BaseNode,
        *,
        rules: Sequence[str],
        dataset_names: Sequence[str],
        stateful: Sequence[RuleStage] = (),
        locate: Callable[[int, int, int], str] | None = None,
    ) -> None:
        super().__init__()
        self.source, self.rules, self.names = source, list(rules), list(dataset_names)
        self.stateful, self.locate = list(stateful), locate
        self.dropped = [[0] * len(self.names) for _ in self.rules]
        self.users = [StatefulFunction(r.name, str(r.function), r.params) for r in self.stateful]
        self.held = [[-1, -1, -1] for _ in self.names]  # per dataset: shard, record, dropping rule (-1 keeps)

    def _repr_args(self):
        yield f"rules={self.rules}"
        yield f"dropped={sum(map(sum, self.dropped))}"

    def _keys(self) -> tuple[str, ...]:
        return (UPSTREAM, "dropped", "users", "held") if self.stateful else (UPSTREAM, "dropped")

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.dropped = [[0] * len(self.names) for _ in self.rules]
        self.users = [StatefulFunction(r.name, str(r.function), r.params) for r in self.stateful]
        self.held = [[-1, -1, -1] for _ in self.names]
        if initial_state is None:
            self.source.reset(None)
            return
        check_state_keys(self, initial_state, self._keys())
        rows = initial_state["dropped"]
        if not isinstance(rows, list) or len(rows) != len(self.rules):
            raise StateError(f"{self!r}: state field 'dropped' must hold one row per filter ({len(self.rules)})")
        dropped = [state_ints(self, "dropped", row, len(self.names)) for row in rows]
        if self.stateful:
            users, held = initial_state["users"], initial_state["held"]
            if (
                not isinstance(users, list)
                or len(users) != len(self.users)
                or not all(isinstance(u, dict) for u in users)
            ):
                raise StateError(f"{self!r}: state field 'users' must hold one dict per stateful filter")
            if not isinstance(held, list) or len(held) != len(self.names):
                raise StateError(f"{self!r}: state field 'held' must hold one entry per dataset")
            self.held = [[int(x) for x in state_ints(self, "held", h, 3, lo=-1)] for h in held]
            for u, st in zip(self.users, users):
                u.load(st)
        self.source.reset(state_node(self, UPSTREAM, initial_state[UPSTREAM]))
        self.dropped = dropped

    def get_state(self) -> dict[str, Any]:
        st: dict[str, Any] = {UPSTREAM: self.source.state_dict(), "dropped": [list(r) for r in self.dropped]}
        if self.stateful:
            st.update(users=[u.state() for u in self.users], held=[list(h) for h in self.held])
        return self._tagged(st)

    def _judge(self, doc: TokDoc, text: str) -> int:
        """The index (in :attr:`rules`) of the stateful rule that drops ``doc``, or -1."""
        it = doc.item
        for rule, user in zip(self.stateful, self.users):
            if not rule.applies(doc.dataset):
                continue
            try:
                keep = user(text)
            except FilterError as e:
                rec = self.locate(it.dataset, it.shard, it.record) if self.locate else it.provenance
                raise FilterError(str(e).replace("{record}", rec)) from e.__cause__
            if not keep:
                return self.rules.index(rule.name)
        return -1

    def next(self) -> Any:
        while True:
            doc = next(self.source)
            if isinstance(doc, FilteredDoc):
                if getattr(doc.item, "part", 0) == 0:
                    self.dropped[self.rules.index(str(doc.skipped))][doc.dataset] += 1
                continue
            if isinstance(doc, Carried):
                doc, text = doc
                it = doc.item
                verdict = self._judge(doc, text)
                if it.parts > 1:
                    self.held[it.dataset] = [it.shard, it.record, verdict]
                if verdict < 0:
                    return doc
                self.dropped[verdict][doc.dataset] += 1
                continue
            if self.stateful and isinstance(doc, TokDoc) and self._later_part_dropped(doc.item):
                continue
            return doc

    def _later_part_dropped(self, it: WorkItem) -> bool:
        """Whether ``it``, a later part of a record a stateful rule judged, goes with its first part."""
        h = self.held[it.dataset]
        if it.part == 0 or h[0] != it.shard or h[1] != it.record:
            return False
        if it.part == it.parts - 1:
            self.held[it.dataset] = [-1, -1, -1]
        return h[2] >= 0

    def counts(self) -> dict[str, dict[str, int]]:
        """Documents dropped, by filter and dataset."""
        return {r: dict(zip(self.names, row)) for r, row in zip(self.rules, self.dropped)}

    def ledger_counts(self) -> dict[str, int]:
        """The documents dropped so far, ``{"rule/dataset": n}`` (non-zero ones): what the batch
        ledger records per lane and step (:func:`zephon.engine.router.lane_counts`)."""
        return {f"{r}/{d}": n for r, row in zip(self.rules, self.dropped) for d, n in zip(self.names, row) if n}

    def extra_metrics(self) -> dict[str, Any]:
        """Documents dropped as ``{"rule/dataset": n}`` (flat, so a rank's summary sums them over lanes)."""
        return {"filtered": {f"{r}/{d}": n for r, row in self.counts().items() for d, n in row.items()}}
