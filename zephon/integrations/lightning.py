"""Lightning: zephon's rows through a ``StatefulDataLoader``, and exact resumes from Lightning checkpoints.

Lightning saves a ``StatefulDataLoader``'s ``state_dict()`` in its checkpoints, but its fit loop
fetches one batch ahead, so the saved loader state is one batch past what the model consumed
(measured with pytorch-lightning 2.6: a resume skips a batch). :class:`ZephonLightningCallback`
stores instead the dataset's state after the rows the model consumed
(``global_step x accumulate_grad_batches x local_batch_size``, see
:meth:`~zephon.integrations.torch_data.ZephonIterableDataset.state_dict_at`) under the checkpoint's
``"zephon"`` key, empties the loader's own entry, and loads it back on resume, into a loader with
any ``num_workers`` (a state between recipe steps; one in the middle of a step resumes on the
same layout)::

    ds = ZephonIterableDataset(recipe, local_batch_size=4)
    dl = StatefulDataLoader(ds, batch_size=4)
    trainer = pl.Trainer(max_steps=1000, callbacks=[ZephonLightningCallback(ds), ModelCheckpoint(...)])
    trainer.fit(model, dl, ckpt_path=...)

The run that saves reads the dataset in the main process: ``num_workers=0`` there (zephon runs its
own workers; the data is the same).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

from zephon.engine import StateError

from .torch_data import ZephonIterableDataset

__all__ = ["ZephonLightningCallback"]


class ZephonLightningCallback(pl.Callback):
    """Saves the consumed rows' dataset state in each checkpoint and restores it (module doc)."""

    def __init__(self, dataset: ZephonIterableDataset) -> None:
        super().__init__()
        self.dataset = dataset

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        loader = trainer.train_dataloader
        if getattr(loader, "num_workers", 0):
            raise StateError(
                "ZephonLightningCallback reads the dataset's state in the main process: save from a loader with "
                "num_workers=0 and give zephon its own workers (the recipe's [workers]); the data is the same"
            )
        batches = trainer.global_step * trainer.accumulate_grad_batches
        checkpoint["zephon"] = self.dataset.state_dict_at(batches * self.dataset.local_batch_size)
        fit = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        if "combined_loader" in fit:  # the loader's own state is a batch ahead: Lightning restores nothing
            fit["combined_loader"] = [{} for _ in fit["combined_loader"]]

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if "zephon" not in checkpoint:
            raise StateError("the checkpoint holds no zephon state (it was saved without ZephonLightningCallback)")
        self.dataset.load_state_dict(checkpoint["zephon"])
