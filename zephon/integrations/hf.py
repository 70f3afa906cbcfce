"""Hugging Face Trainer: zephon's rows, and the loader state saved in every Trainer checkpoint.

The Trainer takes a :class:`~zephon.integrations.torch_data.ZephonIterableDataset` (``style="hf"``:
``input_ids``, ``labels`` and ``shift_labels`` = zephon's already shifted labels, so the model's
loss does not shift them again, ``position_ids``) as ``train_dataset``. It saves no loader state of
its own and resumes by skipping batches, so :class:`ZephonCheckpointCallback`:

* on every save, writes the dataset's state after the rows the Trainer consumed
  (``global_step x gradient_accumulation_steps x per_device_train_batch_size``; accelerate's
  loader fetches one batch ahead, so the dataset's own latest state is not it) as JSON into the
  checkpoint folder (``zephon_data.json``);
* when training resumes from a checkpoint (``trainer.train(resume_from_checkpoint=...)``), loads
  it into the dataset before the first batch. Set ``ignore_data_skip=True`` (the callback
  refuses to resume without it: the Trainer would skip as many batches again),
  ``remove_unused_columns=False`` (``shift_labels`` is no parameter of ``forward``) and
  ``dataloader_num_workers=0`` (zephon runs its own workers)::

    ds = ZephonIterableDataset(recipe, local_batch_size=4, style="hf")
    args = TrainingArguments(out, per_device_train_batch_size=4, max_steps=1000, save_steps=100,
                             ignore_data_skip=True, remove_unused_columns=False)
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[ZephonCheckpointCallback(ds)])
    trainer.train(resume_from_checkpoint=True)   # or a path

A checkpoint taken between recipe steps (``gradient_accumulation_steps x batch size`` a multiple
of the rank's rows per recipe step) resumes on any number of ranks (each rank's file is merged);
one in the middle of a step only with the same layout (the dataset says so).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from transformers import TrainerCallback

from zephon.engine import StateError

from .torch_data import ZephonIterableDataset, zephon_state

__all__ = ["STATE_FILE", "ZephonCheckpointCallback"]

#: the file, in each Trainer checkpoint folder, that holds the zephon loader state
STATE_FILE = "zephon_data.json"


def _dataset_states(state: Any) -> list[dict[str, Any]]:
    """The ZephonIterableDataset states inside a (StatefulDataLoader / accelerate) state."""
    if isinstance(state, dict):
        if "zephon" in state and "rows" in state:
            return [state]
        return [s for v in state.values() for s in _dataset_states(v)]
    if isinstance(state, (list, tuple)):
        return [s for v in state for s in _dataset_states(v)]
    return []


class ZephonCheckpointCallback(TrainerCallback):
    """Saves the loader state in each checkpoint and restores it on resume (module doc)."""

    def __init__(self, dataset: ZephonIterableDataset) -> None:
        super().__init__()
        self.dataset = dataset

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        consumed = state.global_step * args.gradient_accumulation_steps * args.per_device_train_batch_size
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        rank = int(os.environ.get("RANK", "0"))
        name = STATE_FILE if rank == 0 else f"zephon_data_rank{rank:05d}.json"
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump({"global_step": state.global_step, "states": [self.dataset.state_dict_at(consumed)]}, f)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if args.dataloader_num_workers:
            raise StateError(
                "ZephonCheckpointCallback reads the dataset's state in the main process: set "
                "dataloader_num_workers=0 and give zephon its own workers (the recipe's [workers], or "
                "ZephonIterableDataset(workers=...)); the data is the same either way"
            )
        if state.global_step == 0:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        files = sorted(glob.glob(os.path.join(folder, "zephon_data*.json")))
        if not files:
            raise StateError(f"resuming at step {state.global_step} but {folder} holds no {STATE_FILE}")
        if not args.ignore_data_skip:
            raise StateError(
                "resuming with zephon's loader state needs TrainingArguments(ignore_data_skip=True): otherwise the "
                "Trainer would also skip the batches already consumed"
            )
        saved = []
        for path in files:
            with open(path, encoding="utf-8") as f:
                saved.extend(json.load(f)["states"])
        if len(saved) == 1:  # this rank's own state (also in the middle of a recipe step)
            self.dataset.load_state_dict(saved[0])
        else:  # every rank's (and loader worker's) lanes, for any layout
            self.dataset.load_state_dict(zephon_state(saved))
