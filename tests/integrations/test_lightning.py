"""Lightning's own fit loop on CPU over a StatefulDataLoader of zephon's dataset: the checkpoint
carries the state of the rows the model consumed (ZephonLightningCallback; Lightning's own loader
state is a batch ahead), and a fit resumed from it gets the native batches exactly, in the middle
of a recipe step, also with loader workers after a boundary."""

from __future__ import annotations

import glob
import os

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from test_torch_data import native, write_small_recipe  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from zephon import Recipe  # noqa: E402
from zephon.integrations.lightning import ZephonLightningCallback  # noqa: E402
from zephon.integrations.torch_data import ZephonIterableDataset  # noqa: E402

LBS = 4


class Tiny(pl.LightningModule):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab))
        self.seen: list = []

    def training_step(self, batch, i):
        self.seen.append(batch["input"].numpy().copy())
        logits = self.net(batch["input"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    r = Recipe.from_toml(write_small_recipe(str(tmp_path_factory.mktemp("pl_data"))))
    r.prepare()
    return r


def fit(recipe, root, steps, ckpt=None, workers=0, save=True, every_n=4):
    torch.manual_seed(0)
    model = Tiny(recipe.tokenizer.vocab_size)
    ds = ZephonIterableDataset(recipe, world_size=1, rank=0, local_batch_size=LBS)
    dl = StatefulDataLoader(
        ds, batch_size=LBS, num_workers=workers, multiprocessing_context="fork" if workers else None
    )
    every = pl.callbacks.ModelCheckpoint(dirpath=str(root), every_n_train_steps=every_n, save_top_k=-1)
    callbacks = [ZephonLightningCallback(ds)] + ([every] if save else [])
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=save,
    )
    trainer.fit(model, train_dataloaders=dl, ckpt_path=ckpt)
    return model.seen


@pytest.mark.parametrize("workers,at", [(0, 6), (2, 4)], ids=["mid-step", "boundary-then-workers"])
def test_lightning_resumes_on_the_native_batches(recipe, tmp_path, workers, at):
    ref = native(recipe, 1, 0, 3, LBS)  # 4 batches per recipe step
    first = fit(recipe, tmp_path, 8, every_n=at)
    ckpt = glob.glob(os.path.join(tmp_path, f"*step={at}.ckpt"))
    assert len(ckpt) == 1
    rest = fit(recipe, tmp_path, 12, ckpt=ckpt[0], workers=workers, save=not workers)
    got = first[:at] + rest
    assert len(got) == 12
    for g, want in zip(got, ref):
        assert g.tobytes() == want["input"].tobytes()
