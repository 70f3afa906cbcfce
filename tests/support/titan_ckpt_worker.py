"""One launch of a TorchTitan CheckpointManager round trip with the zephon loader (tests only).

    torchrun --standalone --nproc_per_node=W tests/support/titan_ckpt_worker.py \\
        --recipe R.toml --dump DIR --out OUT --load-step S --steps N --local-batch-size B [--async] \\
        [--multimodal]

Builds TorchTitan's real ``CheckpointManager`` (interval 1, full last checkpoint) around a tiny
``nn.Linear`` model, its optimizer and LR scheduler and a ``ZephonDataLoader`` for this DP rank,
then does what the trainer does: ``load(S)`` (S = 0: fresh start), and for each step
S+1..S+N: ``next()`` once per microbatch, an optimizer step, ``save(step)``. Each rank appends,
per step, the SHA-256 of every lane's rows of what it was handed (``input``, ``labels``,
``positions``) to ``OUT/hashes_rank{R}.jsonl``. With ``--tp N`` the N consecutive global ranks
are the model-parallel peers of one DP rank (TorchTitan's mesh has ``tp`` innermost): R is the DP
rank, its first peer writes ``hashes_rank{R}.jsonl`` and the others ``peer_hashes_rank{G}.jsonl``
(G: the global rank). With ``--multimodal`` (a vision-language
recipe) each lane's hash also covers its ``mrope_positions`` and its images: ``grid_thw`` and
the un-padded ``pixel_values`` (see :func:`mm_lane_fields`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import titan_launcher  # noqa: F401  (CPU patches before torchtitan)
import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--load-step", type=int, default=0)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--local-batch-size", type=int, required=True)
    ap.add_argument("--async", dest="async_mode", action="store_true")
    ap.add_argument("--multimodal", action="store_true", help="hash mrope_positions and the images too")
    ap.add_argument("--tp", type=int, default=1, help="model-parallel peers per DP rank (rank r is DP rank r // tp)")
    ap.add_argument("--per-peer", action="store_true", help="every peer reads (read_once = False)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    global_rank, tp = dist.get_rank(), args.tp
    rank, world = global_rank // tp, dist.get_world_size() // tp  # the DP rank and degree

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    import zephon
    from zephon.engine.lanes import lanes_of_rank
    from zephon.integrations.torchtitan import ZephonDataLoader

    loader = ZephonDataLoader.Config(recipe=args.recipe, read_once=not args.per_peer).build(
        dp_world_size=world,
        dp_rank=rank,
        tokenizer=None,
        seq_len=None,
        local_batch_size=args.local_batch_size,
        snapshot_every_n_steps=1,
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=100)
    train_state = _TrainState()
    ckpt = CheckpointManager.Config(
        enable=True,
        interval=1,
        last_save_model_only=False,
        keep_latest_k=0,
        async_mode="async" if args.async_mode else "disabled",
    ).build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=args.dump,
    )

    ckpt.load(step=args.load_step if args.load_step > 0 else -1)
    if train_state.step != args.load_step:
        raise SystemExit(f"rank {rank}: loaded train step {train_state.step}, expected {args.load_step}")

    os.makedirs(args.out, exist_ok=True)
    rows_per_lane = loader.recipe.rows_per_lane
    owned = list(lanes_of_rank(loader.recipe.lanes, world, rank))
    data_iter = iter(loader)
    name = f"hashes_rank{rank}.jsonl" if global_rank % tp == 0 else f"peer_hashes_rank{global_rank}.jsonl"
    with open(os.path.join(args.out, name), "a", encoding="utf-8") as f:
        for step in range(args.load_step + 1, args.load_step + args.steps + 1):
            parts = [next(data_iter) for _ in range(loader.microbatches_per_step)]
            batch = {
                "input": torch.cat([p[0]["input"] for p in parts]),
                "positions": torch.cat([p[0]["positions"] for p in parts]),
                "labels": torch.cat([p[1] for p in parts]),
            }
            for k, v in batch.items():
                assert v.dtype == torch.int64 and v.shape == (loader.rows_per_step, loader.recipe.seq_len), (k, v.shape)
            lanes = {}
            if args.multimodal:
                per_lane = mm_lane_fields(
                    parts, rows_per_lane, loader.special_tokens["image_id"], loader.recipe.vision.patch_dim
                )
                assert len(per_lane) == len(owned)
                for lane, fields in zip(owned, per_lane):
                    lanes[str(lane)] = zephon.batch_sha256(fields)
            else:
                for j, lane in enumerate(owned):
                    lanes[str(lane)] = zephon.batch_sha256(
                        {k: v[j * rows_per_lane : (j + 1) * rows_per_lane] for k, v in batch.items()}
                    )
            f.write(json.dumps({"step": step, "dp_rank": rank, "dp_world_size": world, "lanes": lanes}) + "\n")
            f.flush()
            # a real optimizer step on data-dependent numbers
            x = batch["input"][:, :4].float() / 1000.0
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizers.step()
            lr_schedulers.step()
            optimizers.zero_grad()
            train_state.step = step
            ckpt.save(step, last_step=(step == args.load_step + args.steps))
    ckpt.maybe_wait_for_saving()
    ckpt.close()
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


def mm_lane_fields(parts, rows_per_lane: int, image_id: int, patch_dim: int):
    """Per lane, from the TorchTitan multimodal microbatches a rank was handed (in order):
    ``input``, ``labels``, ``positions``, ``mrope_positions`` (its rows), ``grid_thw`` and
    ``pixel_values`` (its images, each image's patches without the per-image zero padding).
    Images go to rows by the rows' runs of ``image_id`` tokens (TorchTitan's format keeps
    images in token order and does not say which row each belongs to)."""
    rows = {k: np.concatenate([p[0][k].numpy() for p in parts]) for k in ("input", "positions", "mrope_positions")}
    rows["labels"] = np.concatenate([p[1].numpy() for p in parts])
    grids, pix = [], []
    for inp, _ in parts:
        if inp["grid_thw"] is None:
            continue
        for j, g in enumerate(inp["grid_thw"].numpy()):
            grids.append(g)
            pix.append(inp["pixel_values"][j, : int(np.prod(g))].numpy())
    is_img = rows["input"] == image_id
    per_row = (is_img & ~np.pad(is_img[:, :-1], ((0, 0), (1, 0)))).sum(axis=1)
    assert int(per_row.sum()) == len(grids), (per_row, len(grids))
    first = np.concatenate([[0], np.cumsum(per_row)])
    out = []
    for lo in range(0, len(per_row), rows_per_lane):
        hi = lo + rows_per_lane
        i0, i1 = int(first[lo]), int(first[hi])
        d = {k: v[lo:hi] for k, v in rows.items()}
        d["grid_thw"] = np.stack(grids[i0:i1]).astype(np.int64) if i1 > i0 else np.zeros((0, 3), np.int64)
        d["pixel_values"] = (
            np.concatenate(pix[i0:i1]).astype(np.float32) if i1 > i0 else np.zeros((0, patch_dim), np.float32)
        )
        out.append(d)
    return out


class _TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


if __name__ == "__main__":
    main()
