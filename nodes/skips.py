"""Counted, deterministic skips of bad records, with budgets that mean what they say."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from torchdata.nodes import BaseNode

from zephon.data.datasets import DataError
from zephon.engine import StateError, ZNode
from zephon.engine.node import UPSTREAM, check_state_keys, state_int, state_ints, state_node

__all__ = ["MAX_DETAIL_ROWS", "SKIP_SHARE_WARNING", "SkipCounter", "SkipShareWarning", "lane_share", "reason_class"]

#: once a lane has seen ``min_seen`` records of a dataset, skipping this share of them is said
#: (once per lane and dataset): skipped records deliver no tokens, so the dataset's realized
#: share of the batches falls below its declared weight
SKIP_SHARE_WARNING = 0.05


class SkipShareWarning(UserWarning):
    """A dataset's skipped records pull its realized share below its declared weight."""


#: (dataset, shard, reason) rows a lane's state keeps; later new ones are counted per dataset
#: under the reason "other reasons" (shard -1), so a lane's state stays small whatever the data
MAX_DETAIL_ROWS = 256
_OTHER = "other reasons"
_REASON_CHARS = 60


def reason_class(reason: str) -> str:
    """A short, stable class of a skip reason (the part before details), for counting.

    >>> reason_class("missing field 'body' (fields present: 'text', 'id')")
    "missing field 'body'"
    """
    cut = len(reason)
    for sep in (" (", ":", ";"):
        i = reason.find(sep)
        if i > 0:
            cut = min(cut, i)
    return reason[:cut].strip()[:_REASON_CHARS]


def lane_share(total: int, lanes: int, lane: int) -> int:
    """Lane ``lane``'s share of a run-wide count split exactly over ``lanes`` lanes: ``total //
    lanes``, plus one for the first ``total % lanes`` lanes. The shares add up to ``total``.

    >>> [lane_share(10, 4, l) for l in range(4)], sum(lane_share(2, 8, l) for l in range(8))
    ([3, 3, 2, 2], 2)
    """
    return total // lanes + (1 if lane < total % lanes else 0)


class SkipCounter(ZNode[Any]):
    """Drop skipped documents (``doc.skipped`` set), count them, and enforce skip budgets.

    Counts are kept per (dataset, shard, reason class) and per dataset (documents seen and
    skipped); they are part of the lane's state, so they survive checkpoints and are the same
    on every world size. A long record planned as several parts counts once (at its first part;
    its later parts are dropped without counting).

    Budgets, checked before a record is skipped (the record that would exceed one stops the run
    instead of being skipped):

    * ``max_skipped[d]``: a run-wide count split exactly over the lanes (:func:`lane_share`), so
      the run as a whole never skips more than it on any number of ranks; a lane whose share is
      used up stops the run even if other lanes have room left.
    * ``max_fraction[d]``: once a lane has seen ``min_seen`` documents of the dataset, at most
      this share of them may be skipped.
    * always: ``2 * records[d] + 64`` bad records of a dataset in a row in one lane (without one
      good record) stop the run: skip mode then cannot deliver the dataset, and would otherwise
      spin through it forever.

    The state is this node's counters plus its upstream's state at the same point: restore
    needs no replay.

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
    state_version = 2  # 2: "streak" (bad records in a row per dataset); one count per record, not per part

    def __init__(
        self,
        source: BaseNode,
        *,
        dataset_names: Sequence[str],
        lanes: int = 1,
        lane: int = 0,
        max_skipped: Sequence[int | None] | None = None,
        max_fraction: Sequence[float | None] | None = None,
        min_seen: int = 100,
        shard_names: Sequence[Sequence[str]] | None = None,
        records: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        self.names = list(dataset_names)
        n = len(self.names)
        if not 0 <= lane < lanes:
            raise ValueError(f"lane must be in [0, {lanes}), got {lane}")
        self.lane, self.lanes = lane, lanes
        self.max_skipped = list(max_skipped or [None] * n)
        self.lane_budget = [None if m is None else lane_share(m, lanes, lane) for m in self.max_skipped]
        self.max_fraction = list(max_fraction or [None] * n)
        self.min_seen = min_seen
        self.shard_names = shard_names
        # bad records in a row (one lane, one dataset) after which skip mode has failed
        counts: Sequence[int | None] = list(records) if records is not None else [None] * n
        self.streak_limit = [None if r is None else 2 * int(r) + 64 for r in counts]
        self._warned = [False] * n  # observability only, not in the state
        self._example: list[str | None] = [None] * n  # the first skip reason this lane saw, per dataset
        self._clear()

    def _clear(self) -> None:
        n = len(self.names)
        self.seen = [0] * n
        self.skipped = [0] * n
        self.streak = [0] * n
        self.detail: dict[tuple[int, int, str], int] = {}

    def _repr_args(self):
        yield f"datasets={self.names}"
        yield f"lane={self.lane}/{self.lanes}"
        yield f"skipped={sum(self.skipped)}"

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is None:
            self.source.reset(None)
            return
        st = initial_state
        check_state_keys(self, st, (UPSTREAM, "seen", "skipped", "streak", "detail"))
        n = len(self.names)
        seen = state_ints(self, "seen", st["seen"], n)
        skipped = state_ints(self, "skipped", st["skipped"], n)
        streak = state_ints(self, "streak", st["streak"], n)
        for d in range(n):
            if not streak[d] <= skipped[d] <= seen[d]:
                raise StateError(
                    f"{self!r}: state fields of dataset {self.names[d]!r} must satisfy streak <= skipped <= seen, "
                    f"got {streak[d]}, {skipped[d]}, {seen[d]}: the state is corrupt or edited"
                )
        detail = self._load_detail(st["detail"], skipped)
        upstream = state_node(self, UPSTREAM, st[UPSTREAM])
        self.source.reset(upstream)
        self.seen, self.skipped, self.streak, self.detail = seen, skipped, streak, detail

    def _load_detail(self, rows: Any, skipped: list[int]) -> dict[tuple[int, int, str], int]:
        n = len(self.names)
        if not isinstance(rows, list) or len(rows) > MAX_DETAIL_ROWS + n:
            got = f"{len(rows)} rows" if isinstance(rows, list) else repr(rows)[:80]
            raise StateError(f"{self!r}: state field 'detail' must list at most {MAX_DETAIL_ROWS + n} rows, got {got}")
        out: dict[tuple[int, int, str], int] = {}
        sums = [0] * n
        for i, row in enumerate(rows):
            where = f"detail[{i}]"
            if not isinstance(row, list) or len(row) != 4:
                raise StateError(
                    f"{self!r}: state field {where!r} must be [dataset, shard, reason, count], got {row!r}"
                )
            d = state_int(self, f"{where}[0]", row[0], 0, n - 1)
            shards = len(self.shard_names[d]) - 1 if self.shard_names else 1 << 31
            s = state_int(self, f"{where}[1]", row[1], -1, shards)
            r = row[2]
            if not isinstance(r, str) or len(r) > max(_REASON_CHARS, len(_OTHER)):
                raise StateError(f"{self!r}: state field '{where}[2]' must be a short reason string, got {r!r}")
            c = state_int(self, f"{where}[3]", row[3], 1)
            if (d, s, r) in out:
                raise StateError(f"{self!r}: state field {where!r} repeats the row {[d, s, r]}")
            out[(d, s, r)] = c
            sums[d] += c
        for d in range(n):
            if sums[d] != skipped[d]:
                raise StateError(
                    f"{self!r}: state field 'detail' counts {sums[d]} skips of dataset {self.names[d]!r} but "
                    f"'skipped' says {skipped[d]}: the state is corrupt or edited"
                )
        return out

    def get_state(self) -> dict[str, Any]:
        detail = [[d, s, r, c] for (d, s, r), c in sorted(self.detail.items())]
        return self._tagged(
            {
                UPSTREAM: self.source.state_dict(),
                "seen": list(self.seen),
                "skipped": list(self.skipped),
                "streak": list(self.streak),
                "detail": detail,
            }
        )

    def next(self) -> Any:
        while True:
            doc = next(self.source)
            d = doc.dataset
            first = getattr(getattr(doc, "item", None), "part", 0) == 0
            if not getattr(doc, "skipped", None):
                if first:
                    self.seen[d] += 1
                    self.streak[d] = 0
                return doc
            if not first:
                continue  # a later part of a bad record: the record was counted at its first part
            self._check_budget(d, doc)
            self.seen[d] += 1
            self.skipped[d] += 1
            self.streak[d] += 1
            key = (d, doc.item.shard, reason_class(doc.skipped))
            if key not in self.detail and len(self.detail) >= MAX_DETAIL_ROWS:
                key = (d, -1, _OTHER)
            self.detail[key] = self.detail.get(key, 0) + 1
            if self._example[d] is None:
                self._example[d] = str(doc.skipped)[:200]
            if not self._warned[d] and self.seen[d] >= self.min_seen:
                self._warn_share(d)

    def _warn_share(self, d: int) -> None:
        """Say once when skips take :data:`SKIP_SHARE_WARNING` or more of a dataset's records."""
        share = self.skipped[d] / self.seen[d]
        if share < SKIP_SHARE_WARNING:
            return
        self._warned[d] = True
        warnings.warn(
            f"dataset {self.names[d]!r}: lane {self.lane} skipped {self.skipped[d]} of its {self.seen[d]} records "
            f"({share:.0%}; e.g. {self._example[d]!r}); skipped records deliver no tokens: the plan makes up for "
            "the share of bad records its token estimate sampled (data version 5), or, under an older data version, "
            "its realized share of the batches falls below its declared weight by about as much. Fix the data or the "
            "dataset's settings (text_field, format); the skip counts are in the loader's metrics",
            SkipShareWarning,
            stacklevel=2,
        )

    def most_common_reason(self, d: int) -> str | None:
        """The reason class this lane skipped dataset ``d``'s records for most often."""
        by: dict[str, int] = {}
        for (dd, _s, r), c in self.detail.items():
            if dd == d:
                by[r] = by.get(r, 0) + c
        return max(sorted(by), key=by.__getitem__) if by else None

    def _check_budget(self, d: int, doc: Any) -> None:
        """Raise if skipping ``doc`` (dataset ``d``) would exceed a budget; nothing is counted then."""
        name = self.names[d]
        last = f"the record: {doc.skipped} ({doc.item.provenance})"
        budget, frac, limit = self.lane_budget[d], self.max_fraction[d], self.streak_limit[d]
        if budget is not None and self.skipped[d] + 1 > budget:
            m, L = int(self.max_skipped[d] or 0), self.lanes
            split = f"{m} // {L} = {m // L} each" + (f", one more for lanes 0..{m % L - 1}" if m % L else "")
            raise DataError(
                f"too many bad records: max_skipped = {m} is a run-wide budget split exactly over the {L} lanes "
                f"({split}), and lane {self.lane} has used its share of {budget} (the run as a whole never skips "
                f"more than {m} records, on any number of ranks); {last}",
                dataset=name,
                fix="Fix the data, raise max_skipped, or set max_skipped_fraction (a share of each lane's records) "
                "for this dataset in the recipe.",
            )
        seen, skipped = self.seen[d] + 1, self.skipped[d] + 1
        if frac is not None and seen >= self.min_seen and skipped / seen > frac:
            raise DataError(
                f"too many bad records: {skipped} of {seen} documents of this lane (lane {self.lane}) would be "
                f"skipped, more than max_skipped_fraction = {frac}; {last}",
                dataset=name,
                fix="Fix the data, or raise max_skipped_fraction for this dataset in the recipe.",
            )
        if limit is not None and self.streak[d] + 1 > limit:
            reason = self.most_common_reason(d)
            raise DataError(
                f"skip mode cannot deliver this dataset: {limit} of its records in a row were bad in lane "
                f"{self.lane} (twice the dataset's records, plus 64) and none was good; most common reason: "
                f"{reason!r}; {last}",
                dataset=name,
                fix="Fix the data or the recipe (text_field, format, path), or remove the dataset.",
            )

    def counts(self) -> dict[str, Any]:
        """Skipped records by dataset, and by (dataset, shard, reason)."""
        by = []
        for (d, s, r), c in sorted(self.detail.items()):
            shard = self.shard_names[d][s] if self.shard_names and s >= 0 else s
            by.append({"dataset": self.names[d], "file": shard, "reason": r, "count": c})
        return {"seen": dict(zip(self.names, self.seen)), "skipped": dict(zip(self.names, self.skipped)), "by_file": by}

    def extra_metrics(self) -> dict[str, Any]:
        """:meth:`counts`, reported with the node's metrics."""
        return self.counts()
