"""One rank of a job that indexes a dataset spread over its ranks (tests only; started by
``torch.multiprocessing.spawn``, gloo on CPU).

``run(rank, world, port, job)`` writes ``job["out"]/rank{R}.json``: the index's fingerprint,
a SHA-256 of every shard's arrays, how many shards this rank built itself (first and second
indexing), the record counts, and (``job["recipe"]``) the SHA-256 of the first global batches of
the recipe prepared with the group; or the error it raised.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch.distributed as dist

from zephon import Recipe, WorkerConfig
from zephon.data import DatasetIndex, index_dataset


def arrays_digest(ix) -> str:
    h = hashlib.sha256()
    for s in range(len(ix.shards)):
        for k, v in sorted(ix._shard(s).items()):
            h.update(k.encode())
            h.update(v.tobytes())
    return h.hexdigest()


def batch_hashes(recipe: Recipe, steps: int) -> list[str]:
    router = recipe.router(1, 0, workers=WorkerConfig(0), prefetch=0)
    out = []
    for _ in range(steps):
        b = next(router)
        out.append(hashlib.sha256(b["input"].tobytes()).hexdigest())
    router.close()
    return out


def run(rank: int, world: int, port: int, job: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    built: list[int] = []
    original = DatasetIndex._build_arrays

    def counting(self, s):
        built.append(s)
        return original(self, s)

    DatasetIndex._build_arrays = counting  # type: ignore[method-assign]
    cache = job["cache"].format(rank=rank)
    out: dict = {"rank": rank}
    try:
        ix = index_dataset("web", job["path"], format="jsonl", cache_dir=cache, group="world", progress=False)
        out.update(fingerprint=ix.fingerprint, arrays=arrays_digest(ix), records=ix.num_records, built=len(built))
        built.clear()
        again = index_dataset("web", job["path"], format="jsonl", cache_dir=cache, group="world", progress=False)
        out.update(built_again=len(built), fingerprint_again=again.fingerprint, cached=all(again._cached))
        if job.get("recipe"):
            recipe = Recipe.from_toml(job["recipe"].format(rank=rank))
            recipe.prepare(progress=False, group="world")
            out["batches"] = batch_hashes(recipe, 3)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(job["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
