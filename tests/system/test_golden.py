"""Golden hashes: batches of the recorded recipes never change silently, in any data version.

Per data version N, ``tests/golden/golden.json`` (N = 1, recorded at commit e426d1f, before the
round-3 re-partition) or ``golden_vN.json`` (recorded when version N was declared) holds, per
case, the digest of its synthetic corpus, the recipe fingerprint and the SHA-256 of every global
batch on one rank without workers; ``tests/golden/checkpoints/`` (``checkpoints/vN/``) holds
checkpoints written mid-run on W = 2 or 4. A recipe pinned to ``data_version = N`` must give
exactly those batches and resume those checkpoints exactly, on every world size and worker
mode; a change that alters them declares a new data version (``zephon.recipe.DATA_VERSION``).
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

#: every data version with recorded goldens
VERSIONS = [v for v in range(1, DATA_VERSION + 1) if os.path.exists(gc.golden_path(v))]
GOLDEN = {}
for _v in VERSIONS:
    with open(gc.golden_path(_v)) as _f:
        GOLDEN[_v] = json.load(_f)

#: (world size, workers) runs compared against the single-rank golden, per case
RUNS = {
    "demo": [(2, WorkerConfig(2, "thread")), (8, WorkerConfig(2, "process"))],
    "text_greedy": [(4, WorkerConfig(2, "thread"))],
    "text_best_fit_schedule": [(2, WorkerConfig(1, "process"))],
    "text_finite_pad": [(4, WorkerConfig(2, "thread"))],
    "vl": [(4, WorkerConfig(2, "process"))],
    "text_skips": [(4, WorkerConfig(2, "thread"))],
    "vl_chat": [(2, WorkerConfig(2, "process")), (4, WorkerConfig(2, "thread"))],
}
CASES = [(v, n) for v in VERSIONS for n in gc.cases(v)]


@pytest.fixture(scope="module")
def corpora():
    """The corpora at their fixed place, held under a lock (two checkouts may run this at once)."""
    os.makedirs(gc.ROOT, exist_ok=True)
    with open(gc.ROOT + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield {name: gc.build_case(name, gc.case_root(name), data_version=None) for name in gc.CASES}


def _recipe(corpora, name, version):
    return corpora[name].replace(data_version=version)


def test_every_declared_version_has_goldens():
    assert list(range(1, DATA_VERSION + 1)) == VERSIONS, (
        f"data version {DATA_VERSION} is declared but has no goldens: run "
        f"python tests/golden/golden_cases.py --write {DATA_VERSION}"
    )


@pytest.mark.parametrize("version,name", CASES)
def test_corpus_and_fingerprint_are_the_recorded_ones(corpora, version, name):
    recipe = _recipe(corpora, name, version)
    assert gc.corpus_digest(recipe.base_dir) == GOLDEN[version][name]["corpus"], "the corpus generators changed"
    assert recipe.fingerprint == GOLDEN[version][name]["fingerprint"]


@pytest.mark.parametrize("version,name", CASES)
def test_batches_are_the_recorded_ones(corpora, version, name):
    steps = gc.CASES[name][1]
    assert gc.hashes(_recipe(corpora, name, version), steps, 1, WorkerConfig(0)) == GOLDEN[version][name]["hashes"]


@pytest.mark.parametrize(
    "version,name,world,workers",
    [(v, n, w, k) for v in VERSIONS for n, runs in RUNS.items() if n in gc.cases(v) for w, k in runs],
)
def test_every_world_size_and_worker_mode_gives_the_recorded_batches(corpora, version, name, world, workers):
    steps = min(gc.CASES[name][1], 12)
    got = gc.hashes(_recipe(corpora, name, version), steps, world, workers)
    assert got == GOLDEN[version][name]["hashes"][:steps]


@pytest.mark.parametrize("version,name", CASES)
@pytest.mark.parametrize("world", [1, 4])
def test_recorded_checkpoints_resume_exactly(corpora, version, name, world):
    _, steps, at, _ = gc.CASES[name]
    state = gc.load_checkpoint(name, version)
    rest = gc.hashes(_recipe(corpora, name, version), steps - at, world, WorkerConfig(0), state=state)
    assert rest == GOLDEN[version][name]["hashes"][at:]


@pytest.mark.parametrize("version,name", CASES)
def test_another_version_refuses_a_checkpoint_naming_the_setting(corpora, version, name):
    """A checkpoint of version N, resumed with a recipe of another version (the newest, or 1 for
    the newest's checkpoints), is refused with the line that resumes it: ``data_version = N``."""
    other = DATA_VERSION if version != DATA_VERSION else 1
    recipe = _recipe(corpora, name, other)
    if recipe.fingerprint == GOLDEN[version][name]["fingerprint"]:
        pytest.skip(f"{name}: versions {version} and {other} define the same data")
    with (
        recipe.global_loader(1, workers=WorkerConfig(0)) as g,
        pytest.raises(StateError, match=f"data_version = {version}"),
    ):
        g.load_state_dict(gc.load_checkpoint(name, version))
