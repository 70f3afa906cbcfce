"""A batch-size schedule in TorchTitan's trainer: gradient accumulation that follows the recipe.

TorchTitan 0.3's trainer fixes ``gradient_accumulation_steps`` (``global_batch_size /
(local_batch_size x DP degree)``) when it starts, and its ``train_step`` draws that many
microbatches per optimizer step. A recipe with a ``[[batch_schedule]]`` (see
:mod:`zephon.recipe.phases`) has larger global batches in some phases: at the same local batch
size, a larger global batch is more microbatches. :class:`ZephonTrainer` is TorchTitan's
``Trainer`` that, before each optimizer step, takes the step's accumulation count from its
zephon loader (:meth:`ZephonDataLoader.accumulation_steps
<zephon.integrations.torchtitan.ZephonDataLoader.accumulation_steps>`, from the recipe step
alone, so the same on every DP degree and after a resume on another one). Everything else is
TorchTitan's: the loss is normalised by the step's valid tokens over all its microbatches (as
TorchTitan always does), and the learning-rate schedule counts optimizer steps, untouched.

:func:`zephon.integrations.torchtitan.with_zephon` returns a :class:`ZephonTrainer.Config` (a
copy of the given ``Trainer.Config``, same fields) for a recipe whose global batch changes: use
the config it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from torchtitan.trainer import Trainer

__all__ = ["ZephonTrainer", "scheduled_trainer_config"]


class ZephonTrainer(Trainer):
    """TorchTitan's ``Trainer`` whose gradient-accumulation steps per optimizer step follow the
    zephon loader's batch-size schedule (other loaders: TorchTitan's fixed count)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def train_step(self, data_iterator: Iterator[Any]) -> Any:
        """TorchTitan's step, drawing this step's microbatches: the loader's
        ``accumulation_steps`` for the recipe step it is about to hand out."""
        steps = getattr(self.dataloader, "accumulation_steps", None)
        if callable(steps):
            self.gradient_accumulation_steps = steps(self.num_pipeline_parallel_microbatches)
        return super().train_step(data_iterator)


def scheduled_trainer_config(trainer_config: Any) -> Any:
    """A :class:`ZephonTrainer.Config` with ``trainer_config``'s fields (it must be a plain
    ``Trainer.Config``: a model's own trainer subclass has its own ``train_step``)."""
    if isinstance(trainer_config, ZephonTrainer.Config):
        return trainer_config
    if not isinstance(trainer_config, Trainer.Config) or Trainer.Config not in type(trainer_config).__mro__[:2]:
        raise ValueError(
            f"zephon.integrations.torchtitan: the recipe's [[batch_schedule]] changes the global batch, which needs "
            f"zephon's ZephonTrainer (gradient accumulation per step); the config is a {type(trainer_config).__name__}, "
            "not TorchTitan's Trainer.Config. Use a Trainer.Config, or a recipe whose global batch stays fixed"
        )
    values = {f.name: getattr(trainer_config, f.name) for f in dataclasses.fields(trainer_config) if f.init}
    return ZephonTrainer.Config(**values)
