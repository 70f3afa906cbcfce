"""Skip budgets mean what they say: a run-wide max_skipped split exactly over the lanes, a bad
record counted once however many parts it was planned as, and a guard that stops skip mode
before it spins through a dataset that cannot deliver."""

from __future__ import annotations

import numpy as np
import pytest

from zephon.data.datasets import DataError
from zephon.engine.testing import ListSource, check_node
from zephon.nodes import SkipCounter, TokDoc, WorkItem, lane_share


@pytest.mark.parametrize("lanes", [1, 3, 8, 64])
@pytest.mark.parametrize("total", [0, 1, 2, 7, 100, 1001])
def test_lane_shares_add_up_exactly(lanes, total):
    shares = [lane_share(total, lanes, l) for l in range(lanes)]
    assert sum(shares) == total and max(shares) - min(shares) <= 1


def doc(record, bad=False, part=0, parts=1, dataset=0):
    item = WorkItem(dataset, 0, record, 0, record, part, parts)
    return TokDoc(np.zeros(0 if bad else 3, np.int32), dataset, item, "invalid JSON (column 3)" if bad else None)


def test_budget_is_the_lanes_share_and_the_record_over_it_is_not_skipped():
    docs = [doc(0, bad=True), doc(1), doc(2, bad=True), doc(3)]
    # max_skipped = 2 over 4 lanes: lanes 0 and 1 may skip one record each, lanes 2 and 3 none
    ok = SkipCounter(ListSource(docs[:2]), dataset_names=["web"], lanes=4, lane=1, max_skipped=[2])
    assert len(list(ok)) == 1 and ok.skipped == [1]
    over = SkipCounter(ListSource(docs), dataset_names=["web"], lanes=4, lane=1, max_skipped=[2])
    with pytest.raises(DataError, match=r"max_skipped = 2 is a run-wide budget split exactly over the 4 lanes"):
        list(over)
    assert over.skipped == [1]  # the record that would exceed the share was not counted as skipped
    none = SkipCounter(ListSource(docs), dataset_names=["web"], lanes=4, lane=3, max_skipped=[2])
    with pytest.raises(DataError, match="lane 3 has used its share of 0"):
        list(none)


def test_a_bad_record_planned_as_parts_counts_once():
    parts = [doc(7, bad=True, part=i, parts=5) for i in range(5)]
    node = SkipCounter(ListSource([*parts, doc(8)]), dataset_names=["web"], max_skipped=[1])
    assert len(list(node)) == 1
    assert node.skipped == [1] and node.seen == [2]
    good_parts = [doc(9, part=i, parts=3) for i in range(3)]
    node = SkipCounter(ListSource(good_parts), dataset_names=["web"])
    assert len(list(node)) == 3 and node.seen == [1]  # documents, not parts


def test_a_dataset_that_cannot_deliver_stops_skip_mode():
    """5 records, all bad, repeated: skip mode would spin forever; it stops after 2 x 5 + 64 bad
    records in a row, naming the most common reason."""
    endless = [doc(i % 5, bad=True) for i in range(500)]
    node = SkipCounter(ListSource(endless), dataset_names=["web"], records=[5])
    with pytest.raises(DataError, match=r"cannot deliver this dataset: 74 of its records in a row .*'invalid JSON'"):
        next(node)
    assert node.skipped == [74]


def test_good_records_reset_the_streak():
    mostly_bad = [doc(i, bad=i % 50 != 49) for i in range(1000)]  # 2% good: slow, but it delivers
    node = SkipCounter(ListSource(mostly_bad), dataset_names=["web"], records=[5])
    assert len(list(node)) == 20 and node.streak == [0]


def test_counts_and_streak_restore_at_every_step():
    docs = [doc(i % 5, bad=i % 3 == 0, part=0) for i in range(60)]
    res = check_node(lambda: SkipCounter(ListSource(docs), dataset_names=["web"], records=[5]), max_steps=60)
    assert res.states[-1]["skipped"] == [20] and res.states[-1]["version"] == 2


def test_reason_rows_are_capped():
    from zephon.nodes import MAX_DETAIL_ROWS

    many = [
        TokDoc(np.zeros(0, np.int32), 0, WorkItem(0, 0, i, 0, i), f"reason number {i}")
        for i in range(MAX_DETAIL_ROWS + 50)
    ]
    node = SkipCounter(ListSource(many), dataset_names=["web"])
    list(node)
    assert len(node.detail) == MAX_DETAIL_ROWS + 1
    assert node.detail[(0, -1, "other reasons")] == 50
    assert sum(node.detail.values()) == node.skipped[0]
