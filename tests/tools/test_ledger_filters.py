"""Filtered documents in the batch ledger: per lane, filter and dataset, the same on every W and
after a resume; ``zephon ledger diff`` of two recipes that differ in one filter names them."""

from __future__ import annotations

import io
import json
import os

import pytest
from text_fixtures import write_corpus, write_recipe

from zephon import Recipe, WorkerConfig
from zephon.tools.cli import run_hashes
from zephon.tools.ledger import read_ledger
from zephon.tools.ledger_diff import run_ledger_diff

ONE_FILTER = """
[[filters]]
name = "no-the"
kind = "regex"
pattern = "\\\\bthe\\\\b"
datasets = ["web"]
"""
STEPS = 8


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    root = tmp_path_factory.mktemp("ledger_filters")
    write_corpus(str(root))
    return write_recipe(str(root), "base.toml"), write_recipe(str(root), "filtered.toml", extra=ONE_FILTER)


def _filtered(folder):
    led = read_ledger(folder)
    return {(b, l): led.filtered(b, l) for b in led.batches() for l in range(led.lanes)}


def test_ledger_records_filtered_documents_the_same_on_every_w_and_after_a_resume(recipes, tmp_path):
    r = Recipe.from_toml(recipes[1])
    for W in (1, 4):
        run_hashes(r, world_size=W, steps=STEPS, out=io.StringIO(), ledger=str(tmp_path / f"w{W}"))
    ref = _filtered(str(tmp_path / "w1"))
    assert ref == _filtered(str(tmp_path / "w4"))
    last = [ref[(STEPS - 1, l)] for l in range(r.lanes)]
    assert sum(c.get("no-the/web", 0) for c in last) > 0 and all(set(c) <= {"no-the/web"} for c in last)
    # counts grow with the steps, lane by lane
    assert all(
        ref[(b, l)].get("no-the/web", 0) <= ref[(b + 1, l)].get("no-the/web", 0) for b, l in ref if b + 1 < STEPS
    )

    # a run resumed on another W, with thread workers, appends the same counts
    folder, ck = str(tmp_path / "resumed"), str(tmp_path / "ck")
    run_hashes(r, world_size=2, steps=3, save_at=3, checkpoint=ck, out=io.StringIO(), err=io.StringIO(), ledger=folder)
    run_hashes(
        r,
        world_size=4,
        steps=STEPS - 3,
        resume=ck,
        workers=WorkerConfig(2, "thread"),
        out=io.StringIO(),
        err=io.StringIO(),
        ledger=folder,
    )
    assert _filtered(folder) == ref


def test_ledger_of_an_unfiltered_recipe_has_no_filtered_field(recipes, tmp_path):
    run_hashes(Recipe.from_toml(recipes[0]), steps=2, out=io.StringIO(), ledger=str(tmp_path / "l"))
    with open(os.path.join(tmp_path / "l", "rank_00000.jsonl")) as f:
        assert all("filtered" not in json.loads(line) for line in f)


def test_ledger_diff_of_two_recipes_differing_in_one_filter(recipes, tmp_path):
    """Two recipes (or their ledgers) that differ in one filter: the diff names the filter, the
    documents only in A and only in B, and the documents the filter dropped."""
    run_hashes(Recipe.from_toml(recipes[1]), steps=STEPS, out=io.StringIO(), ledger=str(tmp_path / "b"))
    out = io.StringIO()
    assert run_ledger_diff(recipes[0], str(tmp_path / "b"), steps=STEPS, recipe_b=recipes[1], out=out) == 1
    text = out.getvalue()
    assert "recipe difference: filters: (absent) -> [{" in text and "'no-the'" in text
    assert "    only in A: web " in text and "    only in B: " in text
    assert "documents filtered so far (A/B): no-the/web 0/" in text
