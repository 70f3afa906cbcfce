"""One rank of a model-parallel job reading a zephon recipe both ways (tests and benchmarks only).

    python read_once_worker.py --recipe R.toml --out DIR --tp 2 --steps 3 --local-batch-size 2
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set: one process per rank, gloo)

TorchTitan's data-loading mesh is ``("pp", "batch", "cp", "tp")``: with ``tp`` innermost, rank r
is DP rank ``r // tp``. The rank builds a :class:`ZephonDataLoader` for its DP rank twice, first
with every peer reading (``read_once = False``) and then with read-once, and for each writes to
``DIR/rank{R}_{mode}.json``: the SHA-256 of every slice ``next()`` handed out (``input``,
``positions``, ``labels``), the records its own pipeline fetched (``work_source`` items: the
loader's work), its CPU seconds building the loader and per recipe step, and the SHA-256 of each
value of its ``state_dict()`` after the steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import titan_launcher  # noqa: F401  (CPU patches before torchtitan)
import torch.distributed as dist


def run(args: argparse.Namespace, read_once: bool) -> dict:
    from zephon.integrations.torchtitan import ZephonDataLoader

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ZephonDataLoader.Config(recipe=args.recipe, read_once=read_once, workers=args.workers, log_every=0)
    c0, w0 = time.process_time(), time.perf_counter()
    loader = ZephonDataLoader(cfg, dp_world_size=world // args.tp, dp_rank=rank // args.tp, local_batch_size=args.lbs)
    nxt = next(loader)  # the first slice: startup work included in "build"
    c1, w1 = time.process_time(), time.perf_counter()
    hashes = []
    for i in range(args.steps * loader.microbatches_per_step):
        inputs, labels = nxt if i == 0 else next(loader)
        h = hashlib.sha256()
        for t in (inputs["input"], inputs["positions"], labels):
            h.update(t.numpy().tobytes())
        hashes.append(h.hexdigest())
    c2, w2 = time.process_time(), time.perf_counter()
    state = loader.state_dict()
    work = sum(int(v.get("items", 0)) for v in loader.metrics().values() if v.get("node_type") == "work_source")
    out = {
        "rank": rank,
        "dp_rank": rank // args.tp,
        "role": "alone" if loader.peers is None else ("leader" if loader.peers.leader else "follower"),
        "hashes": hashes,
        "records_fetched": work,
        "cpu_build_s": c1 - c0,
        "cpu_per_step_s": (c2 - c1) / max(args.steps - 1, 1),
        "wall_build_s": w1 - w0,
        "wall_per_step_s": (w2 - w1) / max(args.steps - 1, 1),
        "state": {k: hashlib.sha256(bytes(v)).hexdigest() for k, v in state.items()},
    }
    loader.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, required=True, help="model-parallel peers per DP rank (innermost)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--local-batch-size", dest="lbs", type=int, required=True)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--modes", default="per_peer,read_once")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    os.makedirs(args.out, exist_ok=True)
    for mode in args.modes.split(","):
        dist.barrier()
        result = run(args, read_once=mode == "read_once")
        with open(os.path.join(args.out, f"rank{dist.get_rank()}_{mode}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
