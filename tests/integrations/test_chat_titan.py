"""TorchTitan's trainer on a chat recipe (CPU, gloo): the llama3 debug model trains on packed
conversations whose labels are -100 except on assistant tokens, with ``positions`` restarting per
conversation; saved at W=2 and resumed at W=1, every lane's batches (input, labels, positions,
document ids, dataset) equal an uninterrupted single-process run's."""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")

from test_titan import HERE, _env, _read_hashes, _read_losses, _reference, _torchrun

from zephon import Recipe
from zephon.tools.chat_demo import write_chat_recipe

FIELDS = ("dataset", "document_ids", "input", "labels", "positions")


def test_chat_batches_carry_what_the_trainer_consumes(tmp_path):
    """In-process: the loader's (input_dict, labels) for TorchTitan: int64, labels -100 outside
    assistant tokens, positions restarting at each conversation."""
    import zephon.integrations.torchtitan as zt

    path = write_chat_recipe(str(tmp_path), lanes=4, seq_len=128, global_batch_size=8, long="truncate_turns")
    loader = zt.ZephonDataLoader.Config(recipe=path).build(
        dp_world_size=2, dp_rank=0, tokenizer=None, seq_len=128, local_batch_size=4
    )
    inputs, labels = next(loader)
    loader.close()
    assert set(inputs) == {"input", "positions"} and labels.dtype.is_floating_point is False
    assert inputs["input"].shape == labels.shape == (4, 128)
    supervised = (labels != -100).float().mean().item()
    assert 0.05 < supervised < 0.95  # prompts, system and tool tokens are not trained on
    assert (inputs["positions"] == 0).sum().item() > 4  # several conversations per row


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_trainer_on_chat_data_resumes_on_another_dp_degree(tmp_path):
    recipe_path = write_chat_recipe(
        str(tmp_path / "data"), lanes=4, seq_len=256, global_batch_size=8, long="truncate_turns"
    )
    launcher = os.path.join(HERE, "titan_launcher.py")
    base = [launcher, "--module", "titan_launcher", "--config", "zephon_chat_cpu"]
    dump, out = tmp_path / "run", tmp_path / "out"
    env = _env(tmp_path, ZEPHON_TEST_RECIPE=recipe_path, ZEPHON_TEST_OUT=out)
    _torchrun(2, base + ["--dump_folder", str(dump), "--training.steps", "3"], env, timeout=900)
    _torchrun(1, base + ["--dump_folder", str(dump), "--training.steps", "5"], env, timeout=900)
    got, owners = _read_hashes(str(out))
    ref = _reference(recipe_path, 5, fields=FIELDS)
    assert got == ref
    assert {owners[(1, 0)][0], owners[(5, 0)][0]} == {2, 1}
    losses = _read_losses(str(out))
    assert sorted(losses) == [1, 2, 3, 4, 5] and all(math.isfinite(v) for v in losses.values())
    assert Recipe.from_toml(recipe_path).rows_per_lane == 2
