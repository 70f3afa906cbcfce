"""Worker settings mean what they say: one rule (``WorkersSpec.for_stage``) decides which setting
wins, and an override given when a loader is built (``zephon hashes --workers/--backend``,
``ZephonDataLoader.Config``, ``recipe.global_loader(workers=...)``) reaches every pool."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from toml_writer import to_toml
from vl_fixtures import vl_config, write_vl_root

from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.tools.cli import main


@pytest.fixture(scope="module")
def vl_root(tmp_path_factory):
    return write_vl_root(
        tmp_path_factory.mktemp("vlw"), seed=1, text_scale=0.01, n_wds=16, n_parquet=8, n_interleaved=4
    )


def _recipe(root):
    cfg = vl_config(root)
    cfg["vision"] = dict(cfg["vision"], workers=2, backend="process")
    return Recipe.from_dict(cfg, root)


def _children_after_one_batch(recipe, workers):
    with recipe.global_loader(1, workers=workers) as g:
        h = batch_sha256(next(g))
        return h, len(multiprocessing.active_children())


def test_stage_setting_wins_over_workers_but_an_override_wins_over_both(vl_root):
    r = _recipe(vl_root)
    assert r.spec.workers.for_stage("vision").backend == "process"
    h_stage, procs = _children_after_one_batch(r, None)
    assert procs >= 2  # [vision].workers = 2, backend = "process" is used
    h_inline, procs = _children_after_one_batch(r, WorkerConfig(0))
    assert procs == 0  # --workers 0 reaches the vision pool too: nothing started
    assert h_stage == h_inline  # and the data is the same


def test_cli_workers_zero_starts_no_worker_process(vl_root, monkeypatch, capsys):
    cfg = vl_config(vl_root)
    cfg["vision"] = dict(cfg["vision"], workers=2, backend="process")
    path = os.path.join(vl_root, "vl_process.toml")  # relative paths resolve against the recipe's folder
    with open(path, "w") as f:
        f.write(to_toml(cfg))
    started = []
    cls = multiprocessing.get_context("forkserver").Process
    real = cls.start
    monkeypatch.setattr(cls, "start", lambda self: (started.append(self), real(self))[1])
    assert main(["hashes", path, "--steps", "1", "--workers", "0"]) == 0
    assert capsys.readouterr().out.startswith("step 0 ")
    assert started == []  # no worker process, no fork server
    assert main(["hashes", path, "--steps", "1"]) == 0  # without the flag the recipe's process pool runs
    assert len(started) >= 2
