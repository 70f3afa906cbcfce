"""Counted, deterministic skips of bad records, with budgets."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torchdata.nodes import BaseNode

from zephon.data.datasets import DataError
from zephon.engine import UPSTREAM, StateError, ZNode

__all__ = ["SkipCounter"]


def _reason_class(reason: str) -> str:
    """A short, stable class of a skip reason (the part before details), for counting."""
    cut = len(reason)
    for sep in (" (", ":", ";"):
        i = reason.find(sep)
        if i > 0:
            cut = min(cut, i)
    return reason[:cut].strip()[:60]


class SkipCounter(ZNode[Any]):
    """Drop skipped documents (``doc.skipped`` set), count them, and enforce skip budgets.

    Counts are kept per (dataset, shard, reason class) and per dataset (documents seen and
    skipped); they are part of the lane's state, so they survive checkpoints and are the same
    on every world size. Budgets are per lane: ``max_skipped[d]`` is a run-wide count divided
    over the lanes (rounded up), ``max_fraction[d]`` applies once a lane has seen
    ``min_seen`` documents of the dataset. The state is this node's counters plus its
    upstream's state at the same point: restore needs no replay.

    >>> import numpy as np
    >>> from zephon.nodes import TokDoc
    >>> from zephon.engine.testing import ListSource
    >>> from zephon.nodes.worksource import WorkItem
    >>> docs = [TokDoc(np.arange(3), 0, WorkItem(0, 0, 0, 0, 0)),
    ...         TokDoc(np.zeros(0), 0, WorkItem(0, 0, 1, 0, 1), skipped="unreadable caption (bad UTF-8)")]
    >>> node = SkipCounter(ListSource(docs), dataset_names=["web"])
    >>> len(list(node)), node.counts()["skipped"], node.counts()["by_file"][0]["reason"]
    (1, {'web': 1}, 'unreadable caption')
    """

    node_type = "skip_counter"

    def __init__(
        self,
        source: BaseNode,
        *,
        dataset_names: Sequence[str],
        lanes: int = 1,
        max_skipped: Sequence[int | None] | None = None,
        max_fraction: Sequence[float | None] | None = None,
        min_seen: int = 100,
        shard_names: Sequence[Sequence[str]] | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        self.names = list(dataset_names)
        n = len(self.names)
        self.lane_budget = [None if m is None else math.ceil(m / lanes) for m in (max_skipped or [None] * n)]
        self.max_fraction = list(max_fraction or [None] * n)
        self.min_seen = min_seen
        self.shard_names = shard_names
        self._clear()

    def _clear(self) -> None:
        n = len(self.names)
        self.seen = [0] * n
        self.skipped = [0] * n
        self.detail: dict[tuple, int] = {}

    def _repr_args(self):
        yield f"datasets={self.names}"
        yield f"skipped={sum(self.skipped)}"

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is None:
            self.source.reset(None)
            return
        try:
            seen, skipped, detail = initial_state["seen"], initial_state["skipped"], initial_state["detail"]
            upstream = initial_state[UPSTREAM]
        except KeyError as e:
            raise StateError(f"{self!r}: state lacks {e}; it is truncated or from another version") from None
        n = len(self.names)
        for name, v in (("seen", seen), ("skipped", skipped)):
            if not (isinstance(v, list) and len(v) == n and all(isinstance(x, int) and x >= 0 for x in v)):
                raise StateError(f"{self!r}: state field {name!r} must list {n} counts, got {v!r}")
        self.source.reset(upstream)
        self.seen, self.skipped = list(seen), list(skipped)
        self.detail = {(int(d), int(s), str(r)): int(c) for d, s, r, c in detail}

    def get_state(self) -> dict[str, Any]:
        detail = [[d, s, r, c] for (d, s, r), c in sorted(self.detail.items())]
        return self._tagged(
            {
                UPSTREAM: self.source.state_dict(),
                "seen": list(self.seen),
                "skipped": list(self.skipped),
                "detail": detail,
            }
        )

    def next(self) -> Any:
        while True:
            doc = next(self.source)
            d = doc.dataset
            self.seen[d] += 1
            if not getattr(doc, "skipped", None):
                return doc
            self.skipped[d] += 1
            key = (d, doc.item.shard, _reason_class(doc.skipped))
            self.detail[key] = self.detail.get(key, 0) + 1
            self._check_budget(d, doc)

    def _check_budget(self, d: int, doc: Any) -> None:
        budget, frac = self.lane_budget[d], self.max_fraction[d]
        over = budget is not None and self.skipped[d] > budget
        if not over and frac is not None and self.seen[d] >= self.min_seen:
            over = self.skipped[d] / self.seen[d] > frac
        if over:
            raise DataError(
                f"too many bad records: {self.skipped[d]} of {self.seen[d]} documents skipped in this lane "
                f"(budget: {self.lane_budget[d]} per lane, max fraction {frac}); the last one: {doc.skipped} "
                f"({doc.item.provenance})",
                dataset=self.names[d],
                fix="Fix the data, or raise max_skipped / max_skipped_fraction for this dataset in the recipe.",
            )

    def counts(self) -> dict[str, Any]:
        """Skipped records by dataset, and by (dataset, shard, reason)."""
        by = []
        for (d, s, r), c in sorted(self.detail.items()):
            shard = self.shard_names[d][s] if self.shard_names else s
            by.append({"dataset": self.names[d], "file": shard, "reason": r, "count": c})
        return {"seen": dict(zip(self.names, self.seen)), "skipped": dict(zip(self.names, self.skipped)), "by_file": by}

    def extra_metrics(self) -> dict[str, Any]:
        """:meth:`counts`, reported with the node's metrics."""
        return self.counts()
