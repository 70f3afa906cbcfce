"""HF Trainer's own loop on CPU with zephon's dataset: a tiny Llama trained on the native batches,
checkpointed, and resumed (also with loader workers) on exactly the batches it would have seen."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from test_torch_data import native, write_small_recipe  # noqa: E402

from zephon import Recipe, StateError  # noqa: E402
from zephon.integrations.hf import STATE_FILE, ZephonCheckpointCallback  # noqa: E402
from zephon.integrations.torch_data import ZephonIterableDataset  # noqa: E402

LBS, GA = 4, 4  # one Trainer step = 16 rows = one recipe step at W = 1


class Recording(transformers.Trainer):
    """A Trainer that records the batches its training step gets."""

    seen: list

    def training_step(self, model, inputs, *args, **kw):
        self.seen.append({k: v.detach().cpu().numpy().copy() for k, v in inputs.items()})
        return super().training_step(model, inputs, *args, **kw)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    r = Recipe.from_toml(write_small_recipe(str(tmp_path_factory.mktemp("hf_data"))))
    r.prepare()
    return r


def train(recipe, out, steps, resume=False, workers=0, save_steps=3):
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=recipe.tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(cfg)
    ds = ZephonIterableDataset(recipe, world_size=1, rank=0, local_batch_size=LBS, style="hf")
    args = transformers.TrainingArguments(
        str(out),
        per_device_train_batch_size=LBS,
        gradient_accumulation_steps=GA,
        max_steps=steps,
        save_steps=save_steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=workers,
        ignore_data_skip=True,
        remove_unused_columns=False,
        save_only_model=False,
    )
    trainer = Recording(model=model, args=args, train_dataset=ds, callbacks=[ZephonCheckpointCallback(ds)])
    trainer.seen = []
    trainer.train(resume_from_checkpoint=True if resume else None)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ds.close()
    return trainer.seen, losses


def test_trainer_resumes_on_the_native_batches(recipe, tmp_path):
    """Trainer's loop to step 3 (a checkpoint), then resumed from it to step 6: the 24 batches its
    training step got are the native loader's, byte for byte; the losses are finite."""
    ref = native(recipe, 1, 0, 6, LBS)
    first, losses = train(recipe, tmp_path / "run", 3)
    assert all(np.isfinite(losses)) and len(losses) == 3
    saved = json.loads((tmp_path / "run" / "checkpoint-3" / STATE_FILE).read_text())
    # accelerate fetched one batch ahead: the saved state is the consumed one, not the dataset's latest
    assert saved["states"][0]["zephon"]["step"] == 3 and saved["states"][0]["rows"] == 0
    rest, _ = train(recipe, tmp_path / "run", 6, resume=True)
    got = first + rest
    assert len(got) == 6 * GA == len(ref)
    for g, want in zip(got, ref):
        assert g["input_ids"].tobytes() == want["input"].tobytes()
        assert g["shift_labels"].tobytes() == want["labels"].tobytes()
        assert g["position_ids"].tobytes() == want["positions"].tobytes()
    assert glob.glob(os.path.join(tmp_path / "run", "checkpoint-6", STATE_FILE))


def test_trainer_refuses_what_would_not_resume_exactly(recipe, tmp_path):
    with pytest.raises(StateError, match="dataloader_num_workers=0"):
        train(recipe, tmp_path / "w", 1, workers=2)
