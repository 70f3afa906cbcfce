"""An ablation's effect must not depend on the GPU count: the ablation experiment in miniature.

``scripts/ablation_experiment.py`` with a small model, corpus and step count, in real
``torchrun`` processes (TorchTitan 0.3.0's trainer, gloo on CPU, fp32): two recipes that differ
in one mixture weight (web/code 0.7/0.3 vs 0.3/0.7), each trained from scratch on W = 1 and 2.

* zephon: each recipe's global batches are byte-identical at every step on both W (and equal to
  the ledger ``zephon hashes`` computes), so the ablation effect (final validation loss of B
  minus A) is the same on both W to the last bit (at most a few float32 steps of the loss:
  gradient sums over a different number of ranks);
* TorchTitan's mixture loader (``InterleavedHuggingFaceTextDataLoader`` with the same weights on
  the same files): its global batches differ across W.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "ablation_experiment.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
SMALL = [
    "--world-sizes", "1", "2",
    "--steps", "4",
    "--val-every", "4",
    "--seq-len", "64",
    "--docs", "120",
    "--heldout", "10",
    "--seeds", "0",
    "--titan-recipes", "A",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_zephon_ablation_effect_is_the_same_on_every_world_size(tmp_path):
    import ablation_experiment as ab

    out = str(tmp_path / "ablation.json")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, SCRIPT, "--workdir", str(tmp_path), "--json", out, "--no-plot", *SMALL]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1400)
    assert p.returncode == 0, p.stdout[-6000:]
    print(p.stdout[-2500:])
    with open(out, encoding="utf-8") as f:
        res = json.load(f)
    assert res["complete"]
    z, t = res["summary"]["zephon"], res["summary"]["titan"]
    runs = res["runs"]
    # zephon: byte-identical global batches on W = 1 and 2 for both recipes, as the ledger says
    assert z["global_batches_identical_across_W"] == {"A": True, "B": True}
    assert z["global_batches_equal_to_first_W"] == {"A": {"1": 4, "2": 4}, "B": {"1": 4, "2": 4}}
    assert z["ledger_equal_on_every_W_and_to_zephon_hashes"]
    # the two recipes are different data (the ablation changes the batches) ...
    a, b = runs["zephon_A_W1_seed0"], runs["zephon_B_W1_seed0"]
    assert sum(x != y for x, y in zip(a["global_batch_sha256"], b["global_batch_sha256"])) == 4
    effect = z["ablation_effect_B_minus_A"]
    assert effect["1"] != 0.0
    # ... and the effect is the same on both W to the last bit: a few float32 steps of the loss
    assert z["ablation_effect_spread_f32_steps"] <= ab.LAST_BIT_STEPS, (effect, z["float32_step_of_the_loss"])
    assert max(z["gpu_count_effect_f32_steps"].values()) <= ab.LAST_BIT_STEPS, z["gpu_count_effect"]
    assert ab.framed(z["ablation_effect_spread_over_W"], a["val_loss"][-1]).startswith("equal to the last bit")
    # TorchTitan's mixture loader on the same files and weights: other batches on W = 2
    assert t["global_batches_identical_across_W"] == {"A": False}
    assert t["global_batches_equal_to_first_W"]["A"]["2"] < 4
    assert res["setup"]["recipes"] == {"A": {"web": 0.7, "code": 0.3}, "B": {"web": 0.3, "code": 0.7}}
