"""Memory budget of vision-language recipes: the bytes validation states against what a lane holds.

For each recipe: the budget ``Recipe.memory_budget()`` states (shuffle window, micro-batch,
samples in flight), the shuffle window's actual peak bytes (every array of every micro-batch it
held), and the process's resident-set growth over the run; and the old default recipe
(data_version 1, ``[shuffle] buffer = 1024`` at seq_len 2048) that grew past 14 GB without a
first batch, which validation now refuses. Results: ``benchmarks/results/memory_budget.{json,md}``.

    python -m benchmarks.memory_budget [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

from benchmarks.corpus import vision_corpus, vl_tokenizer
from benchmarks.stamp import stamp_files
from zephon import Recipe, RecipeError, WorkerConfig
from zephon.nodes import WindowShuffle

OUT = os.path.join(os.path.dirname(__file__), "results")


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def recipe(glob: str, **over: Any) -> dict[str, Any]:
    return {
        "seed": 1,
        "lanes": 2,
        "seq_len": 2048,
        "global_batch_size": 4,
        "tokenizer": {"path": vl_tokenizer()},
        "datasets": [{"name": "pairs", "path": glob, "kind": "image_text"}],
        "vision": {"max_pixels": 1 << 20},
    } | over


def measure(name: str, cfg: dict[str, Any], steps: int) -> dict[str, Any]:
    r = Recipe.from_dict(cfg, ".")
    r.prepare()
    b = r.memory_budget()
    peak = {"window": 0, "micro": 0}
    accept = WindowShuffle.accept

    def nbytes(item: Any) -> int:
        return sum(v.nbytes for v in item.values() if isinstance(v, np.ndarray))

    def measured(self: WindowShuffle, item: Any) -> None:
        peak["micro"] = max(peak["micro"], nbytes(item))
        peak["window"] = max(peak["window"], sum(map(nbytes, self._items)) + nbytes(item))
        accept(self, item)

    WindowShuffle.accept = measured  # type: ignore[method-assign]
    try:
        before, t0 = rss(), time.perf_counter()
        top = before
        with r.global_loader(1, workers=WorkerConfig(0)) as g:
            for _ in range(steps):
                next(g)
                top = max(top, rss())
        seconds = time.perf_counter() - t0
    finally:
        WindowShuffle.accept = accept  # type: ignore[method-assign]
    lanes, prefetch = r.lanes, r.prefetch_depth(1)
    return {
        "name": name,
        "seq_len": r.seq_len,
        "lanes": r.lanes,
        "rows_per_lane": r.rows_per_lane,
        "buffer": r.spec.shuffle.buffer,
        "data_version": r.spec.data_version,
        "steps": steps,
        "seconds": round(seconds, 1),
        "stated_lane_bytes": b.lane_bytes,
        "stated_window_bytes": b.window_bytes,
        "stated_micro_batch_bytes": b.micro_batch_bytes,
        "stated_rank_bytes": b.rank_bytes(lanes, prefetch),
        "peak_window_bytes": peak["window"],
        "peak_micro_batch_bytes": peak["micro"],
        "rss_growth_bytes": top - before,
        "within": peak["window"] <= b.window_bytes and top - before <= b.rank_bytes(lanes, prefetch),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--size", default="smoke")
    args = ap.parse_args()
    glob = vision_corpus(args.size)["glob"]
    out: dict[str, Any] = {}
    old = recipe(glob, lanes=8, global_batch_size=32, data_version=1, vision={})
    try:
        Recipe.from_dict(old, ".")
        out["old_default"] = {"refused": False}
    except RecipeError as e:
        out["old_default"] = {"refused": True, "message": str(e)}
    runs = [
        measure("v2 default buffer, max_pixels 2^20", recipe(glob), args.steps),
        measure("buffer 16 rows, max_pixels 2^20", recipe(glob, shuffle={"buffer": 16}), args.steps),
    ]
    out["runs"] = runs
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "memory_budget.json"), "w") as f:
        json.dump(out, f, indent=1)
    mb = 1e6
    lines = [
        "# Memory budget of vision-language recipes (stated vs measured)",
        "",
        f"Old default (data_version 1, buffer 1024, seq_len 2048, 8 lanes): "
        f"{'refused: ' + out['old_default']['message'] if out['old_default']['refused'] else 'ACCEPTED'}",
        "",
        "| recipe | buffer | stated window MB | peak window MB | stated micro-batch MB | peak micro-batch MB "
        "| stated rank MB | RSS growth MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['name']} | {r['buffer']} | {r['stated_window_bytes'] / mb:.1f} | {r['peak_window_bytes'] / mb:.1f} "
            f"| {r['stated_micro_batch_bytes'] / mb:.1f} | {r['peak_micro_batch_bytes'] / mb:.1f} "
            f"| {r['stated_rank_bytes'] / mb:.1f} | {r['rss_growth_bytes'] / mb:.1f} |"
        )
    with open(os.path.join(OUT, "memory_budget.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    stamp_files(os.path.join(OUT, "memory_budget.json"), os.path.join(OUT, "memory_budget.md"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
