"""A thousand ranks in one process: the router and lane bookkeeping of W ranks, simulated.

Why: elastic determinism is claimed for any W that divides the lane count, and per-rank costs are
claimed to be the rank's share, but a real job of 1,024 ranks is rarely at hand. :func:`simulate`
builds the routers of W ranks one after the other in this process (each as a real job's rank
builds it: its own lanes only), steps each, and checks against one W = 1 router over all lanes:

- ownership: the ranks' lane blocks, in rank order, are exactly W = 1's lanes (each lane once);
- batches: each simulated rank's step-t rows are W = 1's rows of its lanes, for every step taken;
- state: each rank's encoded state (what its DCP entries hold: lane entries plus the shared
  ``"zephon"`` entry), the checkpoint (the ranks' states merged, every key once), and that the
  merged checkpoint resumes W = 1 and a sampled rank at W with W = 1's next step;
- startup: CPU seconds and traced Python memory of each rank from building its router to its
  first batch.

``ranks`` limits the simulated ranks to a sample (real recipes: a rank's first step is real I/O and
tokenizing); the checkpoint figures then cover the sample only (``checkpoint_bytes`` is None).

>>> import functools
>>> from zephon.engine.testing import toy_lane
>>> r = simulate(functools.partial(toy_lane, rows_per_step=1), lanes=64, world_size=16, steps=2)
>>> r["same_batches_as_w1"], r["ownership_ok"], r["restored_ok"], r["ranks_simulated"]
(True, True, True, 16)
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon.engine import WorkerConfig
from zephon.engine.checkpoint import SHARED_KEY, encode_state, is_lane_key, merge_states
from zephon.engine.digest import batch_sha256
from zephon.engine.lanes import LaneBuilder, LaneSet, lanes_of_rank
from zephon.engine.router import Router

__all__ = ["lane_rows", "simulate"]


def lane_rows(batch: dict[str, Any], lanes: int) -> list[str]:
    """SHA-256 of each lane's rows of a local batch of ``lanes`` lanes (array fields, lane order)."""
    arrays = {k: v for k, v in batch.items() if isinstance(v, np.ndarray)}
    n = len(next(iter(arrays.values())))
    per = n // lanes
    return [batch_sha256({k: v[i * per : (i + 1) * per] for k, v in arrays.items()}) for i in range(lanes)]


def _encoded_sizes(state: dict[str, Any]) -> tuple[int, int, int]:
    """(total bytes, bytes of the shared entry, lane entries) of a state as DCP stores it."""
    enc = encode_state(state)
    return sum(len(v) for v in enc.values()), len(enc.get(SHARED_KEY, b"")), sum(map(is_lane_key, enc))


def _rank_run(make: Any, rank: int, steps: int, lanes_per_rank: int, after: int = 0) -> dict[str, Any]:
    """Build rank ``rank``'s router, take ``steps`` steps; its hashes, state and startup cost (and
    the hashes of ``after`` more steps, taken after the state)."""
    tracemalloc.start()
    c0 = time.process_time()
    router = make(rank)
    try:
        hashes = [lane_rows(next(router), lanes_per_rank)]
        startup_s = time.process_time() - c0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        hashes += [lane_rows(next(router), lanes_per_rank) for _ in range(steps - 1)]
        state = router.state_dict()
        hashes += [lane_rows(next(router), lanes_per_rank) for _ in range(after)]
        return {"hashes": hashes, "state": state, "startup_cpu_s": startup_s, "peak_bytes": peak}
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        router.close()


def simulate(
    lanes_from: LaneBuilder | LaneSet,
    *,
    lanes: int,
    world_size: int,
    steps: int = 3,
    ranks: Sequence[int] | None = None,
    seed: int = 0,
    fingerprint: str = "",
    workers: WorkerConfig | None = None,
) -> dict[str, Any]:
    """Simulate ``world_size`` ranks (or the sample ``ranks``) of a run of ``lanes`` lanes for
    ``steps`` steps and compare them with one W = 1 router; returns the report (see the module)."""
    workers = workers or WorkerConfig(0)
    kw: dict[str, Any] = dict(lanes=lanes, seed=seed, fingerprint=fingerprint, workers=workers)
    per = lanes // world_size
    t0 = time.process_time()
    blocks = [lanes_of_rank(lanes, world_size, r) for r in range(world_size)]
    ownership_ok = [l for b in blocks for l in b] == list(lanes_of_rank(lanes, 1, 0))
    ownership_s = time.process_time() - t0
    sample = list(range(world_size)) if ranks is None else sorted(set(ranks))

    def make(rank: int, w: int = world_size) -> Router:
        return Router(lanes_from, world_size=w, rank=rank, **kw)

    runs = {r: _rank_run(make, r, steps, per) for r in sample}
    ref = _rank_run(lambda _: make(0, 1), 0, steps, lanes, after=1)
    same = all(runs[r]["hashes"][t] == ref["hashes"][t][r * per : (r + 1) * per] for r in sample for t in range(steps))
    sizes = {r: _encoded_sizes(runs[r]["state"]) for r in sample}
    full = ranks is None
    merged = merge_states(runs[r]["state"] for r in sample) if full else ref["state"]
    restored_ok = _restores(make, merged, ref["hashes"][steps], sample[len(sample) // 2], world_size, per)
    rank_bytes = [sizes[r][0] for r in sample]
    return {
        "lanes": lanes,
        "world_size": world_size,
        "lanes_per_rank": per,
        "steps": steps,
        "ranks_simulated": len(sample),
        "ownership_ok": ownership_ok,
        "ownership_cpu_s": ownership_s,
        "same_batches_as_w1": same,
        "restored_ok": restored_ok,
        "rank_state_bytes_max": max(rank_bytes),
        "rank_state_bytes_mean": sum(rank_bytes) / len(rank_bytes),
        "shared_entry_bytes": sizes[sample[0]][1],
        "lane_entry_bytes_mean": (sizes[sample[0]][0] - sizes[sample[0]][1]) / max(sizes[sample[0]][2], 1),
        "checkpoint_bytes": _encoded_sizes(merged)[0] if full else None,
        "w1_state_bytes": _encoded_sizes(ref["state"])[0],
        "startup_cpu_s_mean": sum(runs[r]["startup_cpu_s"] for r in sample) / len(sample),
        "startup_cpu_s_max": max(runs[r]["startup_cpu_s"] for r in sample),
        "startup_peak_bytes_mean": sum(runs[r]["peak_bytes"] for r in sample) / len(sample),
        "w1_startup_cpu_s": ref["startup_cpu_s"],
        "w1_startup_peak_bytes": ref["peak_bytes"],
    }


def _restores(make: Any, state: dict[str, Any], want: list[str], rank: int, world_size: int, per: int) -> bool:
    """The checkpoint resumes W = 1 and rank ``rank`` of ``world_size`` with W = 1's next step."""
    ok = True
    for w, r in ((1, 0), (world_size, rank)):
        router = make(r, w)
        try:
            router.reset(state)
            got = lane_rows(next(router), len(router.owned))
        finally:
            router.close()
        ok = ok and got == (want if w == 1 else want[r * per : (r + 1) * per])
    return ok
