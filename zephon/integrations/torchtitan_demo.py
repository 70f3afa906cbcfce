"""The bundled TorchTitan example: the demo recipe and TorchTitan's llama3 debug model on it.

    torchrun --standalone --nproc_per_node=2 -m torchtitan.train \\
        --module zephon.integrations.torchtitan_demo --config zephon_llama3_debug \\
        --training.local_batch_size 8

Importing this module names the bundled demo recipe ``"demo"`` for
``ZephonDataLoader.Config.recipe`` (``--dataloader.recipe demo``); the data is generated on
first use. Kept apart from :mod:`zephon.integrations.torchtitan` so that the integration does not
depend on the demo's corpus generator (:mod:`zephon.tools.demo`).
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

from zephon.tools.demo import TOKENIZER_DIR, demo_root, write_demo_recipe

from .torchtitan import RECIPE_NAMES, with_zephon

__all__ = ["demo_recipe_path", "resize_vocab", "zephon_llama3_debug"]


def demo_recipe_path(root: str | None = None) -> str:
    """The bundled demo recipe (data generated on first use; safe with many ranks at once)."""
    root = demo_root(root)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks of one node generate the corpus once
        try:
            return write_demo_recipe(root)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


RECIPE_NAMES["demo"] = lambda: demo_recipe_path()  # looked up per call (a test may replace it)


def resize_vocab(trainer_config: Any, vocab_size: int) -> Any:
    """Set a decoder model's vocabulary (embedding, output layer, loss) to ``vocab_size``."""
    model = trainer_config.model_spec.model
    model.vocab_size = vocab_size
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings.num_embeddings = vocab_size
    if getattr(model, "lm_head", None) is not None:
        model.lm_head.out_features = vocab_size
    loss = trainer_config.loss
    inner = getattr(loss, "loss_fn", loss)
    if hasattr(inner, "global_vocab_size"):
        inner.global_vocab_size = vocab_size
    return trainer_config


def zephon_llama3_debug() -> Any:
    """``--module zephon.integrations.torchtitan_demo --config zephon_llama3_debug``: TorchTitan's
    llama3 debug model (vocabulary resized to the bundled tokenizer's 4096 tokens) on the bundled
    demo data (16 lanes, seq_len 256, global batch 32 rows; local_batch_size 8: gradient
    accumulation 4 / W on W = 1, 2 or 4 DP ranks; pass --training.local_batch_size 4 on 8 ranks,
    2 on 16)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.hf_assets_path = TOKENIZER_DIR
    with_zephon(config, "demo", local_batch_size=8)
    resize_vocab(config, 4096)
    config.validator.enable = False
    return config
