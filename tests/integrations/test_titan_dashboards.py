"""zephon's loader metrics reach TorchTitan's metrics logger (TensorBoard), and a plain loop's callback.

The slow test runs TorchTitan 0.3.0's real trainer (llama3 debug model, gloo on CPU, 2 ranks) with
``--metrics.enable_tensorboard`` and reads the event files back: every logged step carries
zephon's metrics next to the loss, and the tokens per dataset are exactly those of rank 0's
batches (recomputed from the recipe alone).
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

pytest.importorskip("torchtitan")

from zephon import Recipe, WorkerConfig
from zephon.recipe import LoaderMetrics, RankBatches
from zephon.recipe.loader_metrics import metered

zt = pytest.importorskip("zephon.integrations.torchtitan")
tm = pytest.importorskip("zephon.integrations.titan_metrics")

from test_titan import GBS, HERE, SEQ, _build, _env, _torchrun, _write_small_recipe  # noqa: E402


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory):
    return _write_small_recipe(str(tmp_path_factory.mktemp("dash_data")))


def _rank_tokens(recipe_path, W, rank, steps):
    """Per step, rank ``rank``'s non-padding tokens per dataset, from the recipe alone."""
    r = Recipe.from_toml(recipe_path)
    with RankBatches(r, W, rank, workers=WorkerConfig(0)) as rb:
        out = []
        for _ in range(steps):
            ds = rb.next_step()["dataset"].ravel()
            out.append(np.bincount(ds[ds >= 0].astype(np.int64), minlength=len(r.datasets)).tolist())
    return r, out


def test_loader_dashboard_metrics_are_its_batches(recipe_path):
    ld = _build(recipe_path, W=2, rank=1, lbs=4)
    try:
        for _ in range(2 * (GBS // 2 // 4)):  # two recipe steps, two slices each
            next(ld)
        m = ld.dashboard_metrics()
        again = ld.dashboard_metrics()  # a new interval: nothing fetched since
    finally:
        ld.close()
    r, per_step = _rank_tokens(recipe_path, 2, 1, 2)
    names = [d.name for d in r.datasets]
    assert m["zephon/steps"] == 2 and again["zephon/steps"] == 0
    assert [m[f"zephon/tokens/{n}"] for n in names] == np.sum(per_step, axis=0).tolist()
    assert [again[f"zephon/tokens/{n}"] for n in names] == [0] * len(names)
    total = np.sum(per_step)
    for i, n in enumerate(names):
        assert m[f"zephon/realized_share/{n}"] == pytest.approx(np.sum(per_step, axis=0)[i] / total)
        assert m[f"zephon/declared_share/{n}"] == pytest.approx(
            r.datasets[i].weight / sum(d.weight for d in r.datasets)
        )
        assert m[f"zephon/records/{n}"] > 0 and m[f"zephon/skipped/{n}"] == 0
    assert 0 < m["zephon/packing_efficiency"] <= 1 and m["zephon/data_loading_s"] > 0


def test_with_zephon_puts_zephon_metrics_in_titans_processor(recipe_path, tmp_path):
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.metrics.log_freq = 7
    zt.with_zephon(config, recipe_path, local_batch_size=4)
    assert isinstance(config.metrics, tm.ZephonMetricsProcessor.Config) and config.metrics.log_freq == 7
    assert config.metrics._owner is tm.ZephonMetricsProcessor and issubclass(
        tm.ZephonMetricsProcessor, MetricsProcessor
    )


def test_metered_calls_back_with_the_plain_loops_metrics(recipe_path):
    r = Recipe.from_toml(recipe_path)
    logged = []
    with r.router(world_size=2, rank=0, workers=WorkerConfig(0)) as router:
        batches = [b for _, b in zip(range(4), metered(router, r, lambda m, s: logged.append((s, m)), every=2))]
    _, per_step = _rank_tokens(recipe_path, 2, 0, 4)
    names = [d.name for d in r.datasets]
    assert [s for s, _ in logged] == [2, 4] and len(batches) == 4
    for k, (_, m) in enumerate(logged):
        assert [m[f"zephon/tokens/{n}"] for n in names] == np.sum(per_step[2 * k : 2 * k + 2], axis=0).tolist()
    with pytest.raises(ValueError, match="every N >= 1"):
        next(metered(iter([]), r, print, every=0))
    assert LoaderMetrics(r, prefix="data/").collect()["data/steps"] == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_tensorboard_event_files_carry_zephon_metrics(recipe_path, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    launcher = os.path.join(HERE, "titan_launcher.py")
    dump = tmp_path / "run"
    args = ["--module", "titan_launcher", "--config", "zephon_llama3_cpu", "--dump_folder", str(dump)]
    args += ["--training.steps", "3", "--metrics.enable_tensorboard", "--training.seq_len", str(SEQ)]
    _torchrun(2, [launcher, *args], _env(tmp_path, ZEPHON_TEST_RECIPE=recipe_path))
    events = glob.glob(str(dump / "tb" / "*" / "events.out.tfevents.*"))
    assert len(events) == 1, events  # rank 0 logs
    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    r, per_step = _rank_tokens(recipe_path, 2, 0, 3)
    names = [d.name for d in r.datasets]
    assert "loss_metrics/global_avg_loss" in tags  # the trainer's own, in the same file
    for i, n in enumerate(names):
        got = {e.step: e.value for e in acc.Scalars(f"zephon/tokens/{n}")}
        assert got == {s + 1: float(per_step[s][i]) for s in range(3)}, n  # log_freq 1: each step's tokens
        declared = acc.Scalars(f"zephon/declared_share/{n}")[-1].value
        assert declared == pytest.approx(r.datasets[i].weight / sum(d.weight for d in r.datasets), abs=1e-6)
        assert f"zephon/realized_share/{n}" in tags and f"zephon/skipped/{n}" in tags
    eff = [e.value for e in acc.Scalars("zephon/packing_efficiency")]
    assert len(eff) == 3 and all(0 < v <= 1 for v in eff)
    assert [e.step for e in acc.Scalars("zephon/data_loading_s")] == [1, 2, 3]
