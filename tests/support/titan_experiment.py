"""Config functions of the from-scratch experiment (scripts/gpu_count_experiment.py and its test).

    torchrun --standalone --nproc_per_node=W tests/support/titan_launcher.py \\
        --module titan_experiment --config exp_zephon|exp_titan|exp_seed --dump_folder DIR ...

The same model (TorchTitan's llama3 debug model, SDPA on CPU, fp32), seed, initial weights (a
seed checkpoint written once on W=1), optimizer, learning-rate schedule, global batch and step
count on every W; the data comes either from zephon (``exp_zephon``) or from TorchTitan 0.3's own
``HuggingFaceTextDataLoader`` on the same JSONL files (``exp_titan``). Both validate on one fixed
set through zephon's loader (a finite recipe: every rank the same rows' share and the same number
of steps; ``validator.steps = -1``).

Environment:
  EXP_TRAIN_RECIPE  zephon training recipe (TOML)
  EXP_VAL_RECIPE    zephon validation recipe (finite)
  EXP_TRAIN_DIR     folder of the training JSONL files (TorchTitan's loader reads it)
  EXP_SEED_CKPT     absolute path of the seed checkpoint's step-0 folder (not for exp_seed)
  EXP_LR, EXP_WARMUP, EXP_VAL_FREQ, EXP_LAYERS   learning rate, warmup steps, validation
                    interval, transformer layers kept (defaults 3e-3, 10, 20, all)
  EXP_PRECISION     FSDP's parameter dtype, "float32" (default) or "bfloat16"
  EXP_TITAN_SOURCES for ``exp_titan_mix``: JSON list of [folder, weight], one per dataset
                    (TorchTitan's InterleavedHuggingFaceTextDataLoader), EXP_TITAN_SEED its seed
  ZEPHON_TEST_OUT   per-rank records: loss_rank{R}.jsonl (titan_launcher), val_rank{R}.jsonl
                    (validation loss), rows_rank{R}.jsonl (SHA-256 of every row the trainer drew),
                    valcalls_rank{R}.jsonl (next() calls of each validation pass)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import titan_launcher as tl  # patches torch for CPU before torchtitan is imported

import zephon.integrations.torchtitan as zt


class CountingZephonDataLoader(zt.ZephonDataLoader):
    """The validation loader: records how many ``next()`` calls each validation pass took on each
    rank (the end of a finite recipe is the same call on every rank)."""

    @dataclass(kw_only=True, slots=True)
    class Config(zt.ZephonDataLoader.Config):
        pass

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self._calls = 0

    def __next__(self):
        try:
            out = super().__next__()
        except StopIteration:
            tl._append("valcalls", {"calls": self._calls, "recipe_steps": self.step})
            raise
        self._calls += 1
        return out


def _row_digests(input_dict, labels) -> list[str]:
    inp = input_dict["input"].numpy()
    lab = labels.numpy()
    return [hashlib.sha256(inp[i].tobytes() + lab[i].tobytes()).hexdigest() for i in range(len(inp))]


def _patch_recording() -> None:
    """Every row the trainer draws (both loaders), and every validation loss, per rank."""
    import time

    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    if getattr(Trainer, "_exp_patched", False):
        return
    gen, log_validation = Trainer.batch_generator, MetricsProcessor.log_validation

    def batch_generator(self, data_iterable):
        for input_dict, labels in gen(self, data_iterable):
            tl._append("rows", {"step": int(self.step), "rows": _row_digests(input_dict, labels)})
            yield input_dict, labels

    def log_validation_recorded(self, loss, step, extra_metrics=None):
        tl._append("val", {"step": int(step), "val_loss": float(loss), "time": time.time()})
        return log_validation(self, loss, step, extra_metrics)

    Trainer.batch_generator = batch_generator
    MetricsProcessor.log_validation = log_validation_recorded
    Trainer._exp_patched = True


def _common(config):
    from torchtitan.components.optimizer.optimizer import default_adamw

    tl._cpu_common(config)
    _patch_recording()
    env = os.environ
    config.optimizer = default_adamw(lr=float(env.get("EXP_LR", "3e-3")))
    config.lr_scheduler.warmup_steps = int(env.get("EXP_WARMUP", "10"))
    config.lr_scheduler.decay_ratio = 0.8
    config.lr_scheduler.decay_type = "cosine"
    config.lr_scheduler.min_lr_factor = 0.1
    # fp32 everywhere: with bf16, W=1 (autocast) and W>=2 (FSDP bf16 parameters) round differently
    config.training.mixed_precision_param = env.get("EXP_PRECISION", "float32")
    config.activation_checkpoint = None  # nothing to save on a CPU; recomputation only costs time
    layers = env.get("EXP_LAYERS")
    if layers:
        m = config.model_spec.model
        m.layers = m.layers[: int(layers)]
    # identical initial weights on every W: load the seed checkpoint (model only), never save
    config.checkpoint.enable = True
    config.checkpoint.load_only = True
    config.checkpoint.initial_load_path = env.get("EXP_SEED_CKPT")
    config.checkpoint.initial_load_model_only = True
    config.metrics.log_freq = 1  # every step's loss is recorded
    # one fixed validation set, the same on every W, the whole set each time (steps = -1)
    zt.with_zephon(config, env["EXP_TRAIN_RECIPE"], validation=env["EXP_VAL_RECIPE"])
    v = config.validator
    v.freq = int(env.get("EXP_VAL_FREQ", "20"))
    v.dataloader = CountingZephonDataLoader.Config(recipe=env["EXP_VAL_RECIPE"], ledger=False, log_every=0)
    return config


def exp_zephon():
    """zephon's loader on the training recipe (writes the batch ledger into the dump folder)."""
    os.environ["ZEPHON_TEST_RECIPE"] = os.environ["EXP_TRAIN_RECIPE"]
    config = _common(tl.zephon_llama3_cpu())
    config.dataloader = zt.ZephonDataLoader.Config(recipe=os.environ["EXP_TRAIN_RECIPE"], log_every=0)
    return config


def exp_titan():
    """TorchTitan 0.3's HuggingFaceTextDataLoader on the same JSONL files (same model, shapes, schedule)."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    config = exp_zephon()
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=os.environ["EXP_TRAIN_DIR"])
    return config


def exp_titan_mix():
    """TorchTitan 0.3's own mixture loader, ``InterleavedHuggingFaceTextDataLoader``: one
    ``HuggingFaceTextDataLoader`` source per dataset folder with its weight (a packed row is drawn
    from a source with probability = weight, so the weights are token shares), seed EXP_TITAN_SEED."""
    from torchtitan.hf_datasets.text_datasets import HFDataSource, InterleavedHuggingFaceTextDataLoader

    config = exp_zephon()
    sources = [
        HFDataSource(dataset="c4_test", dataset_path=folder, weight=float(weight))
        for folder, weight in json.loads(os.environ["EXP_TITAN_SOURCES"])
    ]
    config.dataloader = InterleavedHuggingFaceTextDataLoader.Config(
        sources=sources, seed=int(os.environ.get("EXP_TITAN_SEED", "42"))
    )
    return config


def exp_seed():
    """W=1 only, with --checkpoint.create_seed_checkpoint: writes checkpoint/step-0 (the initial weights)."""
    config = exp_zephon()
    config.checkpoint.load_only = False
    config.checkpoint.initial_load_path = None
    config.validator.enable = False
    return config
