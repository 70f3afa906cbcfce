"""A batch-size schedule in TorchTitan: the loader's gradient-accumulation steps follow the
recipe step, ``with_zephon`` returns a ZephonTrainer config, and (slow, real ``torchrun``) a ramp
run resumed across the change on other DP degrees gives the uninterrupted run's batches and losses."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("torchtitan")
torch = pytest.importorskip("torch")

from test_titan import (  # noqa: E402
    HERE,
    LANES,
    SEQ,
    _dcp_merge,
    _env,
    _lane_hashes,
    _read_hashes,
    _read_losses,
    _torchrun,
    _write_small_recipe,
)

from zephon import Recipe  # noqa: E402

zt = pytest.importorskip("zephon.integrations.torchtitan")

RAMP_AT = 3  # recipe step (0-based) of the ramp: trainer step 4 is the first of 32 rows
RAMP = f"\n[[batch_schedule]]\nstep = {RAMP_AT}\nglobal_batch_size = 32\n"


@pytest.fixture(scope="module")
def ramp_path(tmp_path_factory):
    path = _write_small_recipe(str(tmp_path_factory.mktemp("titan_ramp")))
    with open(path, "a", encoding="utf-8") as f:
        f.write(RAMP)
    return path


def _loader(path, W, rank, lbs=2):
    return zt.ZephonDataLoader.Config(recipe=path, ledger=False).build(
        dp_world_size=W, dp_rank=rank, tokenizer=None, seq_len=SEQ, local_batch_size=lbs
    )


def _steps(loader, n):
    """n optimizer steps as the trainer takes them: accumulation_steps() next() calls each."""
    out = []
    for _ in range(n):
        k = loader.accumulation_steps()
        parts = [next(loader) for _ in range(k)]
        out.append((k, torch.cat([p[0]["input"] for p in parts])))
    return out


def test_accumulation_follows_the_schedule_and_resumes_across_the_change(ramp_path):
    whole = _steps(_loader(ramp_path, 2, 0), 6)
    assert [k for k, _ in whole] == [4] * RAMP_AT + [8] * (6 - RAMP_AT)  # 8 then 16 rows on rank 0 of 2
    # saved on 4 ranks just before the change, resumed on 2
    four = [_loader(ramp_path, 4, r) for r in range(4)]
    for ld in four:
        assert [k for k, _ in _steps(ld, RAMP_AT - 1)] == [2] * (RAMP_AT - 1)
    state = _dcp_merge([ld.state_dict() for ld in four])
    again = _loader(ramp_path, 2, 0)
    again.load_state_dict(state)
    rest = _steps(again, 6 - RAMP_AT + 1)
    assert [k for k, _ in rest] == [k for k, _ in whole[RAMP_AT - 1 :]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(rest, whole[RAMP_AT - 1 :]))


def test_with_zephon_returns_a_zephon_trainer_config(ramp_path, recipe_path=None):
    from torchtitan.trainer import Trainer

    from zephon.integrations.titan_schedule import ZephonTrainer
    from zephon.integrations.torchtitan_demo import zephon_llama3_debug

    base = zephon_llama3_debug()
    cfg = zt.with_zephon(base, ramp_path, local_batch_size=2)
    assert isinstance(cfg, ZephonTrainer.Config) and isinstance(cfg, Trainer.Config)
    assert cfg.training.global_batch_size == 16 and cfg.training.seq_len == SEQ
    assert cfg.dataloader.recipe == ramp_path


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_trainer_ramp_resumed_across_the_change_on_other_dp_degrees(ramp_path, tmp_path):
    """TorchTitan's trainer (llama3 debug model) on a ramp from 16 to 32 rows at trainer step 4:
    W=2 uninterrupted; the elastic run takes its step-2 checkpoint to W=1 (steps 3-4, across the
    change), then W=4 (steps 5-6). Batches equal, losses to float rounding."""
    launcher = os.path.join(HERE, "titan_launcher.py")
    base = ["--module", "titan_launcher", "--config", "zephon_ramp_cpu"]
    ref_dump, ref_out = tmp_path / "ref", tmp_path / "ref_out"
    env = dict(ZEPHON_TEST_RECIPE=ramp_path, ZEPHON_TEST_LBS=2)
    _torchrun(
        2,
        [launcher] + base + ["--dump_folder", str(ref_dump), "--training.steps", "6"],
        _env(tmp_path, ZEPHON_TEST_OUT=ref_out, **env),
        timeout=900,
    )
    el_dump, el_out = tmp_path / "elastic", tmp_path / "el_out"
    shutil.copytree(ref_dump / "checkpoint" / "step-2", el_dump / "checkpoint" / "step-2")
    el_env = _env(tmp_path, ZEPHON_TEST_OUT=el_out, **env)
    _torchrun(1, [launcher] + base + ["--dump_folder", str(el_dump), "--training.steps", "4"], el_env, timeout=900)
    _torchrun(4, [launcher] + base + ["--dump_folder", str(el_dump), "--training.steps", "6"], el_env, timeout=900)

    ref_hashes, _ = _read_hashes(str(ref_out))
    el_hashes, owners = _read_hashes(str(el_out))
    rec = Recipe.from_toml(ramp_path)
    want = {}
    with rec.global_loader(1) as g:
        for step in range(1, 7):
            fields = ("dataset", "document_ids", "input", "labels", "positions")
            want.update(
                {(step, k): v for k, v in _lane_hashes(next(g), 0, rec.rows_per_lane_at(step - 1), fields).items()}
            )
    assert ref_hashes == want  # the trainer drew the recipe's batches, 16 rows then 32
    assert set(el_hashes) == {(s, l) for s in range(3, 7) for l in range(LANES)}
    assert all(el_hashes[k] == ref_hashes[k] for k in el_hashes)
    assert {owners[(3, 0)][0], owners[(5, 0)][0]} == {1, 4}
    ref_loss, el_loss = _read_losses(str(ref_out)), _read_losses(str(el_out))
    diffs = {s: abs(el_loss[s] - ref_loss[s]) for s in range(3, 7)}
    print("ramp: loss diffs vs uninterrupted W=2:", diffs)
    assert max(diffs.values()) < 1e-3, diffs
