#!/usr/bin/env python
"""Issue 33, scale edges: seconds to the first batch with lanes far above the record count.

    python benchmarks/lane_start.py                       # writes benchmarks/results/lane_start.{md,json}
    python benchmarks/lane_start.py --before /tmp/base    # also an older checkout (``git archive <commit>``)

The demo corpus at scale 0.6 (3,072 records: 1,440 JSONL, 1,440 Parquet, 192 text lines), one
row of 64 tokens per lane (``global_batch_size = lanes``), no row shuffle, inline workers: for
lanes in 64, 512 and 4,096 at W = 1 (and rank 0 of W = 8 at 4,096 lanes), ``Recipe.prepare()``,
the router's construction and its first ``next()`` timed apart, each in a fresh process, rounds
alternating the order; with the records the mappers mapped (read and tokenized) before the first
batch. ``--before DIR`` runs the same measurements on the code under DIR (its ``zephon`` and
``nodes`` imported instead of this checkout's), in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHILD = len(sys.argv) == 6 and sys.argv[1] == "--child"  # one measurement, on the code under argv[2]
sys.path.insert(0, sys.argv[2] if CHILD else ROOT)
import zephon  # noqa: E402
from benchmarks.stamp import stamp_files  # noqa: E402
from zephon import Recipe, WorkerConfig  # noqa: E402
from zephon.engine import mapper  # noqa: E402
from zephon.tools.demo import TOKENIZER_DIR  # noqa: E402
from zephon.tools.synth import make_demo_corpus  # noqa: E402

CASES = ((64, 1), (512, 1), (4096, 1), (4096, 8))
SCALE, SEED, SEQ = 0.6, 3, 64


def _child(code: str, lanes: int, world: int, data: str) -> dict:
    """One measurement, in this (fresh) process, on the code under ``code`` (imported at the top)."""
    if not zephon.__file__.startswith(os.path.abspath(code) + os.sep):
        raise RuntimeError(f"measuring {code}, but zephon was imported from {zephon.__file__}")
    pats = make_demo_corpus(os.path.join(data, "corpus"), seed=SEED, scale=SCALE)
    fmt = {"web": "jsonl", "code": "parquet", "books": "text"}
    sets = "".join(f'[[datasets]]\nname = "{n}"\npath = "{p}"\nformat = "{fmt[n]}"\n' for n, p in pats.items())
    path = os.path.join(data, f"lanes{lanes}.toml")
    with open(path, "w") as f:
        f.write(
            f'seed = 77\nlanes = {lanes}\nseq_len = {SEQ}\nglobal_batch_size = {lanes}\ncache_dir = "{data}/cache"\n'
            f'[tokenizer]\npath = "{TOKENIZER_DIR}"\n{sets}[shuffle]\nbuffer = 1\n'
        )
    mapped = []
    real = mapper._run_chunk
    mapper._run_chunk = lambda fn, is_batch, items: mapped.append(len(items)) or real(fn, is_batch, items)
    t0 = time.perf_counter()
    rec = Recipe.from_toml(path)
    prep = rec.prepare()
    t1 = time.perf_counter()
    router = rec.router(world, 0, workers=WorkerConfig(0), prefetch=0)
    t2 = time.perf_counter()
    next(router)
    t3 = time.perf_counter()
    router.close()
    return {
        "lanes": lanes,
        "world_size": world,
        "records": sum(d.num_records for d in prep.plan.datasets),
        "prepare_s": t1 - t0,
        "router_s": t2 - t1,
        "first_next_s": t3 - t2,
        "records_mapped": sum(mapped),
        "tasks": len(mapped),
    }


def _run(code: str, lanes: int, world: int, data: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", code, str(lanes), str(world), data]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=code).stdout
    return json.loads(out.strip().splitlines()[-1])


def _table(rows: list[dict], codes: dict[str, str]) -> list[str]:
    lines = [
        "| code | lanes | W (rank 0) | prepare s | router s | first next s (median, all rounds) | records mapped |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for name in codes:
        for lanes, world in CASES:
            rs = [r for r in rows if r["code"] == name and r["lanes"] == lanes and r["world_size"] == world]
            if not rs:
                continue
            med = {k: statistics.median(r[k] for r in rs) for k in ("prepare_s", "router_s", "first_next_s")}
            each = ", ".join(f"{r['first_next_s']:.2f}" for r in rs)
            lines.append(
                f"| {name} | {lanes:,} | {world} | {med['prepare_s']:.2f} | {med['router_s']:.3f} | "
                f"**{med['first_next_s']:.2f}** ({each}) | {rs[0]['records_mapped']:,} |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", help="a checkout of the code to compare with (its zephon/ and nodes/)")
    ap.add_argument("--before-name", default="before")
    ap.add_argument("--data", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "zephon-lane-start"))
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    os.makedirs(args.data, exist_ok=True)
    codes = {"this commit": ROOT}
    if args.before:
        codes = {args.before_name: os.path.abspath(args.before), **codes}
    load = os.getloadavg()
    rows = []
    for r in range(args.rounds):
        order = [(n, c) for n, c in codes.items() for c in CASES]
        for name, (lanes, world) in order if r % 2 == 0 else order[::-1]:
            row = {"code": name, "round": r, **_run(codes[name], lanes, world, args.data)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    jpath, mpath = os.path.join(args.out, "lane_start.json"), os.path.join(args.out, "lane_start.md")
    with open(jpath, "w") as f:
        json.dump({"loadavg_start": list(load), "cases": CASES, "rows": rows}, f, indent=1)
    lines = [
        "# Lanes far above the records: seconds to the first batch (issue 33)",
        "",
        f"Demo corpus at scale {SCALE} ({rows[0]['records']:,} records), seq_len {SEQ}, one row per lane, "
        f"buffer 1, inline workers; {args.rounds} rounds in alternating order, each measurement a fresh "
        "process. 'records mapped': read and tokenized before the first batch. Timings from a shared, "
        "loaded machine: compare rows of one file only.",
        "",
        *_table(rows, codes),
        "",
    ]
    with open(mpath, "w") as f:
        f.write("\n".join(lines))
    stamp_files(jpath, mpath)
    print("\n".join(lines))


if __name__ == "__main__":
    if CHILD:
        print(json.dumps(_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))
    else:
        main()
