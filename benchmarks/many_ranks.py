#!/usr/bin/env python
"""A thousand ranks, simulated: per-rank state, checkpoint, startup work and memory at W = 8 to 1,024.

    python benchmarks/many_ranks.py            # writes benchmarks/results/many_ranks.{md,json}
    python benchmarks/many_ranks.py --full     # every one of the 1,024 ranks (about 5 min here)

Each row is :func:`zephon.tools.many_ranks.simulate` of W ranks x 8 lanes in this process: the
routers of the simulated ranks built one after the other, 2 steps each, compared with one W = 1
router over all lanes (the same rows, the same checkpoint resuming W = 1 and a rank of W). The
lanes are the engine's toy lanes (source -> ordered mapper -> packer -> shuffle -> batch: the
shape of a text lane, no I/O), so the numbers are the bookkeeping's. Two more tables: a finite
run (every lane ends), whose shared entry carries every lane's step count, and a real recipe
(the test corpus, tokenizer and all) at 8,192 lanes, ranks sampled from W = 1,024.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import machine, versions  # noqa: E402
from benchmarks.stamp import stamp_files  # noqa: E402

LANES_PER_RANK = 8


def _toy_rows(full: bool) -> list[dict]:
    from zephon.engine.testing import toy_lane
    from zephon.tools.many_ranks import simulate

    rows = []
    for w in (8, 64, 1024):
        sample = None if (full or w <= 64) else [0, 1, 255, 511, 512, 1022, 1023]
        t = time.perf_counter()
        r = simulate(functools.partial(toy_lane, rows_per_step=1), lanes=w * LANES_PER_RANK, world_size=w, ranks=sample)
        r["wall_s"] = time.perf_counter() - t
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def _finite_rows() -> list[dict]:
    """A finite lane set: the shared entry (on every rank) holds each lane's step count, and every
    rank counts every lane (a dry run over the data) unless a cache has the counts."""
    from zephon.engine import WorkerConfig
    from zephon.engine.checkpoint import SHARED_KEY, encode_state
    from zephon.engine.lanes import LaneSet
    from zephon.engine.router import Router
    from zephon.engine.testing import toy_lane

    rows = []
    for w in (8, 64, 1024):
        lanes = w * LANES_PER_RANK
        ls = LaneSet(functools.partial(toy_lane, n=lanes * 6, rows_per_step=1), end="drop")
        c0 = time.process_time()
        router = Router(ls, lanes=lanes, world_size=w, rank=w - 1, workers=WorkerConfig(0))
        next(router)
        startup = time.process_time() - c0
        enc = encode_state(router.state_dict())
        router.close()
        rows.append(
            {
                "world_size": w,
                "lanes": lanes,
                "shared_entry_bytes": len(enc[SHARED_KEY]),
                "rank_state_bytes": sum(map(len, enc.values())),
                "startup_cpu_s": startup,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _real_rows() -> list[dict]:
    """Ranks of W = 1,024 of a real recipe with 8,192 lanes: startup CPU, memory, state size."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
    from text_fixtures import write_corpus, write_recipe

    from zephon import Recipe, WorkerConfig
    from zephon.engine.checkpoint import SHARED_KEY, encode_state

    rows = []
    with tempfile.TemporaryDirectory(prefix="zephon-many-ranks-") as root:
        write_corpus(root)
        recipe = Recipe.from_toml(write_recipe(root)).replace(lanes=8192, global_batch_size=8192)
        c0 = time.process_time()
        recipe.prepare(progress=False)
        prepare_s = time.process_time() - c0
        for rank in (0, 511, 1023):
            tracemalloc.start()
            c0 = time.process_time()
            router = recipe.router(1024, rank, workers=WorkerConfig(0), prefetch=0)
            next(router)
            startup = time.process_time() - c0
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            enc = encode_state(router.state_dict())
            router.close()
            rows.append(
                {
                    "rank": rank,
                    "prepare_cpu_s": prepare_s,
                    "startup_cpu_s": startup,
                    "peak_python_bytes": peak,
                    "rank_state_bytes": sum(map(len, enc.values())),
                    "shared_entry_bytes": len(enc[SHARED_KEY]),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _kb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e3:,.1f} kB"


def _markdown(toy: list[dict], finite: list[dict], real: list[dict], cmd: str, took: float, load0: tuple) -> str:
    m = machine()
    lines = [
        "# A thousand ranks, simulated (router and lane bookkeeping)",
        "",
        f"Produced by `{cmd}` in {took:.0f} s on {m['cpu']}, {m['cores']} cores; load average at start "
        f"{', '.join(f'{x:.2f}' for x in load0)}, at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())} "
        "(the machine is shared by 8 sessions: CPU seconds are steadier than wall time, both are noisy).",
        "",
        "## Toy lanes (engine parts, no I/O), 8 lanes per rank, 2 steps",
        "",
        "| W | lanes | ranks simulated | ownership = W 1 | batches = W 1 | checkpoint resumes W 1 and W | "
        "state per rank | shared entry | checkpoint (merged) | W = 1 state | startup CPU per rank (mean / max) | "
        "traced memory per rank at first batch | W = 1 startup CPU / memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    yes = {True: "yes", False: "NO"}
    for r in toy:
        lines.append(
            f"| {r['world_size']} | {r['lanes']} | {r['ranks_simulated']} | {yes[r['ownership_ok']]} | "
            f"{yes[r['same_batches_as_w1']]} | {yes[r['restored_ok']]} | {_kb(r['rank_state_bytes_max'])} | "
            f"{r['shared_entry_bytes']} B | {_kb(r['checkpoint_bytes'])} | {_kb(r['w1_state_bytes'])} | "
            f"{r['startup_cpu_s_mean'] * 1e3:.1f} / {r['startup_cpu_s_max'] * 1e3:.1f} ms | "
            f"{_kb(r['startup_peak_bytes_mean'])} | {r['w1_startup_cpu_s']:.2f} s / {r['w1_startup_peak_bytes'] / 1e6:.1f} MB |"
        )
    lines += [
        "",
        "## A finite run (every lane ends): the last rank of W",
        "",
        "| W | lanes | shared entry (on every rank) | state of one rank | startup CPU of one rank |",
        "|---|---|---|---|---|",
    ]
    for r in finite:
        lines.append(
            f"| {r['world_size']} | {r['lanes']} | {_kb(r['shared_entry_bytes'])} | {_kb(r['rank_state_bytes'])} | "
            f"{r['startup_cpu_s']:.2f} s |"
        )
    lines += [
        "",
        "## A real recipe (tests/support/text_fixtures.py: JSONL + Parquet + text, the bundled tokenizer), "
        "8,192 lanes, ranks of W = 1,024",
        "",
        "| rank | prepare (index, estimate; once per process) | startup CPU to first batch | traced Python memory "
        "| state | shared entry |",
        "|---|---|---|---|---|---|",
    ]
    for r in real:
        lines.append(
            f"| {r['rank']} | {r['prepare_cpu_s']:.2f} s | {r['startup_cpu_s']:.2f} s | "
            f"{r['peak_python_bytes'] / 1e6:.1f} MB | {_kb(r['rank_state_bytes'])} | {r['shared_entry_bytes']} B |"
        )
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--full", action="store_true", help="simulate every rank of W = 1,024 (not a sample)")
    ap.add_argument("--tag", default="many_ranks")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0, load0 = time.time(), os.getloadavg()
    toy, finite, real = _toy_rows(args.full), _finite_rows(), _real_rows()
    cmd = "python benchmarks/many_ranks.py" + (" --full" if args.full else "")
    out = os.path.join(HERE, "results")
    with open(os.path.join(out, f"{args.tag}.json"), "w") as f:
        json.dump({"command": cmd, "machine": machine(), "toy": toy, "finite": finite, "real": real}, f, indent=1)
    text = _markdown(toy, finite, real, cmd, time.time() - t0, load0)
    with open(os.path.join(out, f"{args.tag}.md"), "w") as f:
        f.write(text)
    stamp_files(os.path.join(out, f"{args.tag}.json"), os.path.join(out, f"{args.tag}.md"), command=cmd)
    print(text)


if __name__ == "__main__":
    main()
