"""Read once per DP rank, in one process: a leader's :class:`LeaderBatches` sends, a follower's
:class:`FollowerBatches` receives through an in-memory link (the gloo link is tested with real
processes in tests/integrations/test_read_once.py)."""

from __future__ import annotations

import collections
import os
import sys

import numpy as np
import pytest

from zephon import Recipe, WorkerConfig
from zephon.engine import PipelineError
from zephon.recipe import RankBatches
from zephon.recipe.peers import FollowerBatches, LeaderBatches

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from text_fixtures import write_corpus, write_recipe


class QueueLink:
    """Both ends of a link in one process: what the leader sends, the follower receives, in order."""

    def __init__(self, queue: collections.deque, leader: bool) -> None:
        self.queue, self.leader = queue, leader

    def send(self, message):
        self.queue.append(message)

    def recv(self):
        return self.queue.popleft()


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("peers"))
    write_corpus(root)
    return Recipe.from_toml(write_recipe(root))


def _pair(recipe, **kw):
    q: collections.deque = collections.deque()
    lead = LeaderBatches(recipe, 2, 1, link=QueueLink(q, True), local_batch_size=2, workers=WorkerConfig(0), **kw)
    follow = FollowerBatches(recipe, 2, 1, link=QueueLink(q, False), local_batch_size=2, **kw)
    return lead, follow


def test_follower_hands_out_the_leaders_slices_and_holds_no_state(recipe):
    lead, follow = _pair(recipe, digests=True)
    alone = RankBatches(recipe, 2, 1, local_batch_size=2, workers=WorkerConfig(0))
    for _ in range(3 * lead.microbatches_per_step):
        a, lo, hi = alone.next_slice()
        b, lo2, hi2 = lead.next_slice()
        c, lo3, hi3 = follow.next_slice()
        assert (lo, hi) == (lo2, hi2) == (lo3, hi3)
        for k in ("input", "labels", "positions", "document_ids"):
            assert np.array_equal(a[k][lo:hi], c[k][lo:hi]) and np.array_equal(b[k], c[k])
    assert follow.step == lead.step == 3 and follow.received == 3
    assert follow.lane_digests() == lead.lane_digests()
    assert follow.state_dict() == {} and lead.state_dict() == alone.state_dict()
    assert follow.router.summary_metrics()["peer"]["items"] == 3
    for b in (lead, follow, alone):
        b.close()


def test_a_follower_with_another_recipe_is_refused(recipe):
    q: collections.deque = collections.deque()
    lead = LeaderBatches(recipe, 1, 0, link=QueueLink(q, True), workers=WorkerConfig(0))
    other = FollowerBatches(recipe.replace(seed=recipe.seed + 1), 1, 0, link=QueueLink(q, False))
    lead.next_step()
    with pytest.raises(PipelineError, match="data definition"):
        other.next_step()
    lead.close()


def test_the_leaders_failure_reaches_the_follower(recipe):
    lead, follow = _pair(recipe)

    def boom():
        raise RuntimeError("disk gone")

    # the leader's pipeline fails on its next step
    failing = {"__next__": lambda self: boom(), "close": lambda self: None, "step": 0, "end": None}
    lead.close()
    lead._source = type("Failing", (), failing)()
    with pytest.raises(RuntimeError, match="disk gone"):
        lead.next_step()
    with pytest.raises(PipelineError, match="leader of DP rank 1 failed.*disk gone"):
        follow.next_step()
