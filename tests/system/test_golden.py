"""Golden hashes: batches of the recorded recipes never change silently.

``tests/golden/golden.json`` holds, per case, the digest of its synthetic corpus, the recipe
fingerprint and the SHA-256 of every global batch on one rank without workers, as recorded by
``tests/golden/golden_cases.py --write`` at commit e426d1f (before the round-3 re-partition).
``tests/golden/checkpoints/`` holds checkpoints that commit wrote mid-run on W = 2 or 4. A change
that alters batches or refuses those checkpoints fails here; if it is meant, it is declared (a
data-definition version in the fingerprint) and the goldens are re-recorded in the same commit.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "golden"))

import golden_cases as gc

from zephon.engine import StateError, WorkerConfig
from zephon.recipe import DATA_VERSION

with open(gc.GOLDEN) as _f:
    GOLDEN = json.load(_f)

#: (world size, workers) runs compared against the single-rank golden, per case
RUNS = {
    "demo": [(2, WorkerConfig(2, "thread")), (8, WorkerConfig(2, "process"))],
    "text_greedy": [(4, WorkerConfig(2, "thread"))],
    "text_best_fit_schedule": [(2, WorkerConfig(1, "process"))],
    "text_finite_pad": [(4, WorkerConfig(2, "thread"))],
    "vl": [(4, WorkerConfig(2, "process"))],
}


@pytest.fixture(scope="module")
def recipes():
    """The corpora at their fixed place, held under a lock (two checkouts may run this at once)."""
    os.makedirs(gc.ROOT, exist_ok=True)
    with open(gc.ROOT + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield {name: gc.build_case(name, gc.case_root(name)) for name in gc.CASES}


@pytest.mark.parametrize("name", sorted(gc.CASES))
def test_corpus_and_fingerprint_are_the_recorded_ones(recipes, name):
    recipe = recipes[name]
    assert gc.corpus_digest(recipe.base_dir) == GOLDEN[name]["corpus"], "the synthetic corpus generators changed"
    assert recipe.fingerprint == GOLDEN[name]["fingerprint"]


@pytest.mark.parametrize("name", sorted(gc.CASES))
def test_batches_are_the_recorded_ones(recipes, name):
    steps = gc.CASES[name][1]
    assert gc.hashes(recipes[name], steps, 1, WorkerConfig(0)) == GOLDEN[name]["hashes"]


@pytest.mark.parametrize("name,world,workers", [(n, w, k) for n, runs in RUNS.items() for w, k in runs])
def test_every_world_size_and_worker_mode_gives_the_recorded_batches(recipes, name, world, workers):
    steps = min(gc.CASES[name][1], 12)
    assert gc.hashes(recipes[name], steps, world, workers) == GOLDEN[name]["hashes"][:steps]


@pytest.mark.parametrize("name", sorted(gc.CASES))
@pytest.mark.parametrize("world", [1, 4])
def test_checkpoints_of_the_starting_commit_resume_exactly(recipes, name, world):
    _, steps, at, _ = gc.CASES[name]
    rest = gc.hashes(recipes[name], steps - at, world, WorkerConfig(0), state=gc.load_checkpoint(name))
    assert rest == GOLDEN[name]["hashes"][at:]


@pytest.mark.parametrize("name", sorted(gc.CASES))
def test_the_newest_data_version_resumes_or_names_the_setting(recipes, name):
    """Unpinned, a recipe makes the newest version's batches: the same as the goldens while the
    version is 1; after a declared change, the old checkpoint is refused naming what resumes it."""
    newest = recipes[name].replace(data_version=DATA_VERSION)
    if DATA_VERSION == 1:
        assert newest.fingerprint == GOLDEN[name]["fingerprint"]
        return
    with newest.global_loader(1, workers=WorkerConfig(0)) as g, pytest.raises(StateError, match="data_version = 1"):
        g.load_state_dict(gc.load_checkpoint(name))
