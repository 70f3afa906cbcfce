"""Run TorchTitan 0.3.0's trainer on a CPU-only machine (tests only, not part of the library).

    torchrun --standalone --nproc_per_node=W tests/support/titan_launcher.py \\
        --module titan_launcher --config zephon_llama3_cpu --dump_folder DIR \\
        --training.steps N --training.local_batch_size B

Patches applied before torchtitan is imported (see ../shared/notes/torchtitan-cpu.md):
device type "cpu" (gloo), the ``torch.cpu`` functions the memory monitor calls,
``torch.distributed.set_timeout`` (torch 2.13 lacks it), and FSDP sum reductions (gloo has no
PREMUL_SUM). The config functions swap FlexAttention (no CPU backward) for SDPA.

Environment used by the config functions:
  ZEPHON_TEST_RECIPE  recipe TOML for ``zephon_llama3_cpu`` (default: the bundled demo)
  ZEPHON_TEST_OUT     folder for per-rank ``hashes_rank{R}.jsonl`` (per-lane batch hashes per
                      step) and ``loss_rank{R}.jsonl`` (global loss per step)
  ZEPHON_TEST_HF_DATA folder of JSONL files for ``titan_loader_cpu`` (TorchTitan's own loader)
"""

from __future__ import annotations

import json
import os
import sys
import types
from dataclasses import dataclass


def patch_cpu() -> None:
    """Make torchtitan run on CPU with gloo. Idempotent; call before importing torchtitan."""
    import torch
    import torch._utils
    import torch.distributed as dist

    torch._utils._get_available_device_type = lambda: "cpu"
    cpu = torch.cpu
    if not getattr(cpu, "_zephon_patched", False):
        cpu.get_device_name = lambda *a, **k: "cpu"
        cpu.get_device_properties = lambda *a, **k: types.SimpleNamespace(
            total_memory=64 * 1024**3, name="cpu", major=0, minor=0
        )
        cpu.memory_stats = lambda *a, **k: {}
        cpu.reset_peak_memory_stats = lambda *a, **k: None
        cpu.empty_cache = lambda *a, **k: None
        cpu.current_device = lambda *a, **k: 0
        cpu._zephon_patched = True
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)


patch_cpu()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _out(name: str) -> str | None:
    d = os.environ.get("ZEPHON_TEST_OUT")
    if not d:
        return None
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f"{name}_rank{_rank()}.jsonl")


def _append(name: str, record: dict) -> None:
    path = _out(name)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _patch_trainer() -> None:
    """FSDP sum reductions after the model is built; losses recorded per step."""
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    if getattr(Trainer, "_zephon_patched", False):
        return
    init = Trainer.__init__

    def __init__(self, *args, **kwargs):  # noqa: N807 - replaces Trainer.__init__
        init(self, *args, **kwargs)
        from torch.distributed.fsdp import FSDPModule

        for part in self.model_parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)

    log = MetricsProcessor.log

    def log_loss(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        _append("loss", {"step": int(step), "loss": float(global_avg_loss), "grad_norm": float(grad_norm)})
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    Trainer.__init__ = __init__
    MetricsProcessor.log = log_loss
    Trainer._zephon_patched = True


HASHED_FIELDS = ("dataset", "document_ids", "input", "labels", "positions")


def lane_hashes(batch, lanes_of_rank, rows_per_lane: int) -> dict:
    """Per-lane SHA-256 of a rank's local batch (the token fields the tests compare), by lane."""
    import zephon

    out = {}
    for j, lane in enumerate(lanes_of_rank):
        part = {k: batch[k][j * rows_per_lane : (j + 1) * rows_per_lane] for k in HASHED_FIELDS if k in batch}
        out[lane] = zephon.batch_sha256(part)
    return out


def _sdpa_everywhere(config) -> None:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _fqn, _cfg, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        if parent is not None:
            if isinstance(parent, list):
                parent[attr] = ScaledDotProductAttention.Config()
            else:
                setattr(parent, attr, ScaledDotProductAttention.Config())


def _cpu_common(config) -> None:
    _sdpa_everywhere(config)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.lr_scheduler.decay_ratio = 0.0  # runs of different lengths share the LR schedule
    config.lr_scheduler.warmup_steps = 2
    config.checkpoint.enable = True
    config.checkpoint.interval = 1
    config.checkpoint.keep_latest_k = 0
    config.checkpoint.last_save_model_only = False
    config.metrics.log_freq = 1
    config.validator.enable = False
    config.training.max_norm = 1.0
    config.debug.seed = 0
    config.debug.deterministic = True
    _patch_trainer()


# -- a zephon loader that records per-lane hashes of every step --------------------------------
import zephon.integrations.torchtitan as zt  # noqa: E402  (after patch_cpu)
import zephon.integrations.torchtitan_demo as zdemo  # noqa: E402


class HashingZephonDataLoader(zt.ZephonDataLoader):
    @dataclass(kw_only=True, slots=True)
    class Config(zt.ZephonDataLoader.Config):
        pass

    def on_local_batch(self, step, batch) -> None:
        owned = self.batches.lanes
        hashes = lane_hashes(batch, owned, self.recipe.rows_per_lane_at(step - 1))
        _append(
            "hashes",
            {
                "step": int(step),
                "dp_rank": self.dp_rank,
                "dp_world_size": self.dp_world_size,
                "rows": len(batch["input"]),
                "lanes": {str(k): v for k, v in hashes.items()},
            },
        )


def zephon_llama3_cpu():
    """llama3 debug model on a zephon recipe ($ZEPHON_TEST_RECIPE), CPU-friendly."""
    config = zdemo.zephon_llama3_debug()
    recipe = os.environ.get("ZEPHON_TEST_RECIPE", "demo")
    zt.with_zephon(config, recipe, local_batch_size=int(os.environ.get("ZEPHON_TEST_LBS", "4")))
    config.dataloader = HashingZephonDataLoader.Config(recipe=recipe)
    _cpu_common(config)
    return config


def zephon_ramp_cpu():
    """The same on a recipe whose [[batch_schedule]] changes the global batch: with_zephon's
    returned config (a ZephonTrainer's: gradient accumulation per step follows the recipe)."""
    recipe = os.environ["ZEPHON_TEST_RECIPE"]
    config = zt.with_zephon(
        zdemo.zephon_llama3_debug(), recipe, local_batch_size=int(os.environ.get("ZEPHON_TEST_LBS", "2"))
    )
    config.dataloader = HashingZephonDataLoader.Config(recipe=recipe)
    _cpu_common(config)
    return config


def zephon_chat_cpu():
    """The same on a chat recipe ($ZEPHON_TEST_RECIPE): the chat tokenizer (ChatML tokens) and its vocabulary."""
    from zephon.data import TextTokenizer
    from zephon.data.chat import CHAT_TOKENIZER

    config = zephon_llama3_cpu()
    config.hf_assets_path = CHAT_TOKENIZER
    zdemo.resize_vocab(config, TextTokenizer(CHAT_TOKENIZER).vocab_size)
    return config


def titan_loader_cpu():
    """The same model and shapes on TorchTitan's own HuggingFaceTextDataLoader (contrast)."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    config = zephon_llama3_cpu()
    config.dataloader = HuggingFaceTextDataLoader.Config(
        dataset="c4_test", dataset_path=os.environ["ZEPHON_TEST_HF_DATA"]
    )
    return config


def main() -> None:
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
