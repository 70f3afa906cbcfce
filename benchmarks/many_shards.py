#!/usr/bin/env python
"""Startup at scale: time to first batch and restore time with 10,000 and 100,000 small shards.

    python benchmarks/many_shards.py                     # 10k and 100k shards
    python benchmarks/many_shards.py --shards 10000      # one size

Writes ``benchmarks/results/many_shards.{md,json}``. The corpus (JSON Lines shards of 4 short
documents each, about 1 kB, 1,000 per folder) is generated once under /tmp
(``/tmp/zephon-many-shards/<N>``, reused by later runs; never in the repository). Each
measurement is a fresh process (``python -c`` importing zephon), so nothing is warm but the OS's
file cache:

- cold: an empty index cache: find the files (glob, stat, realpath for ``same_file = "once"``),
  index every shard, write its cache entry, load the tokenizer, estimate tokens per byte, build
  the rank's lanes, first batch;
- warm: the same with the cache filled by the cold run (every shard still stat-ed and its cache
  entry read and checked against the file's size and modification time);
- restore: warm, plus a state saved after 3 steps loaded before the first batch;
- spread2: cold again, with two ranks (two processes, gloo) indexing together, each a slice of
  the shards (``Recipe.prepare(group="world")``); rank 0's times, both ranks' CPU seconds.

The phases are timed apart (prepare = find + index + tokenizer + estimate; first batch = lanes
built and the first global batch at W = 1 of 8 lanes). Wall seconds on a machine shared by 8
sessions: noisy; the process CPU seconds are given too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import machine, versions  # noqa: E402
from benchmarks.stamp import stamp_files  # noqa: E402

BASE = "/tmp/zephon-many-shards"
PHASES = ("cold", "warm", "restore", "spread2")
WORDS = [
    "river",
    "stone",
    "light",
    "garden",
    "window",
    "market",
    "paper",
    "signal",
    "orbit",
    "forest",
    "engine",
    "letter",
    "harbor",
    "silver",
    "candle",
    "winter",
    "thunder",
    "meadow",
    "lantern",
    "copper",
    "island",
    "mirror",
    "valley",
    "compass",
]

RECIPE = """\
seed = 3
lanes = 8
seq_len = 256
global_batch_size = 8
cache_dir = "{cache}"

[tokenizer]
path = "{tok}"

[[datasets]]
name = "many"
path = "{root}/data/*/*.jsonl"
format = "jsonl"
weight = 1.0

[shuffle]
buffer = 16
"""

CHILD = r"""
import json, os, sys, time
t0, c0 = time.perf_counter(), time.process_time()
from zephon import Recipe, WorkerConfig
from zephon.engine.checkpoint import load_state, save_state
group = None
if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # indexing spread over the ranks (gloo)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    group = "world"
t1, c1 = time.perf_counter(), time.process_time()
recipe = Recipe.from_toml(sys.argv[1])
recipe.prepare(progress=False, group=group)
t2 = time.perf_counter()
router = recipe.router(1, 0, workers=WorkerConfig(0), prefetch=0)
if sys.argv[2] == "restore":
    router.reset(load_state(sys.argv[3]))
next(router)
t3, c3 = time.perf_counter(), time.process_time()
if sys.argv[2] == "warm":
    next(router); next(router)
    save_state(sys.argv[3], router.state_dict())
router.close()
print(json.dumps({"import_s": t1 - t0, "prepare_s": t2 - t1, "first_batch_s": t3 - t2,
                  "to_first_batch_s": t3 - t1, "cpu_s": time.process_time() - c0,
                  "cpu_to_first_batch_s": c3 - c1}))
"""


def make_corpus(n: int) -> str:
    """``n`` shards under /tmp (kept for later runs); returns the folder."""
    root = os.path.join(BASE, str(n))
    done = os.path.join(root, "COMPLETE")
    if os.path.exists(done):
        return root
    shutil.rmtree(root, ignore_errors=True)
    for i in range(n):
        folder = os.path.join(root, "data", f"{i // 1000:04d}")
        if i % 1000 == 0:
            os.makedirs(folder, exist_ok=True)
        lines = []
        for j in range(4):
            words = [WORDS[(i * 31 + j * 7 + k * k) % len(WORDS)] for k in range(30 + (i + j) % 20)]
            lines.append(json.dumps({"text": f"shard {i} doc {j}: " + " ".join(words)}))
        with open(os.path.join(folder, f"s{i:07d}.jsonl"), "w") as f:
            f.write("\n".join(lines) + "\n")
    open(done, "w").close()
    return root


def measure(n: int, phases: tuple[str, ...] = PHASES) -> dict:
    from zephon.tools.demo import TOKENIZER_DIR

    t = time.perf_counter()
    root = make_corpus(n)
    made = time.perf_counter() - t
    cache = os.path.join(root, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    recipe = os.path.join(root, "recipe.toml")
    with open(recipe, "w") as f:
        f.write(RECIPE.format(cache=cache, tok=TOKENIZER_DIR, root=root))
    state = os.path.join(root, "state.json")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", ZEPHON_CACHE_DIR=cache)
    out: dict = {"shards": n, "corpus_s": made}
    for phase in phases:
        if phase == "spread2":  # cold again, two ranks indexing together
            shutil.rmtree(cache, ignore_errors=True)
            out[phase] = two_ranks(recipe, env)
        else:
            p = subprocess.run(
                [sys.executable, "-c", CHILD, recipe, phase, state],
                env=env,
                capture_output=True,
                text=True,
                timeout=3000,
            )
            if p.returncode:
                raise SystemExit(f"{phase} at {n} shards failed:\n{p.stderr[-3000:]}")
            out[phase] = json.loads(p.stdout.strip().splitlines()[-1])
        print(n, phase, out[phase], flush=True)
    return out


def two_ranks(recipe: str, env: dict) -> dict:
    """Cold, with two ranks (processes, gloo) indexing together: rank 0's times, and the CPU
    seconds of both."""
    dist = dict(env, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, recipe, "cold", ""],
            env=dict(dist, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    got = []
    for p in procs:
        so, se = p.communicate(timeout=3000)
        if p.returncode:
            raise SystemExit(f"spread2 failed:\n{se[-3000:]}")
        got.append(json.loads(so.strip().splitlines()[-1]))
    return {**got[0], "cpu_s_ranks": [g["cpu_s"] for g in got]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--shards", default="10000,100000")
    ap.add_argument("--tag", default="many_shards")
    ap.add_argument("--phases", default=",".join(PHASES), help="which of " + ", ".join(PHASES))
    ap.add_argument("--before", help="a results .json of an earlier run whose rows come first in the table")
    args = ap.parse_args()
    t0, load0 = time.time(), os.getloadavg()
    phases = tuple(args.phases.split(","))
    rows = [measure(int(n), phases) for n in args.shards.split(",")]
    cmd = "python benchmarks/many_shards.py" + (f" --shards {args.shards}" if args.shards != "10000,100000" else "")
    cmd += f" --tag {args.tag}" if args.tag != "many_shards" else ""
    cmd += f" --phases {args.phases}" if phases != PHASES else ""
    if args.before:
        with open(args.before) as f:
            earlier = json.load(f)
        rows = earlier["rows"] + rows
        cmd = f"{earlier['command']}, then {cmd} --before {args.before}"
    for r in rows:
        r.setdefault("load", [round(x, 2) for x in os.getloadavg()])
    m = machine()
    lines = [
        "# Startup at scale: time to first batch with many small shards",
        "",
        f"Produced by `{cmd}` in {time.time() - t0:.0f} s on {m['cpu']}, {m['cores']} cores; load average at "
        f"start {', '.join(f'{x:.2f}' for x in load0)}, at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}. "
        "The machine is shared with other sessions: wall seconds are noisy (CPU seconds of the process beside them).",
        "",
        "One dataset of N JSON Lines shards (4 documents, about 1 kB each), 8 lanes, W = 1, inline workers. "
        "Seconds from `Recipe.from_toml` (zephon already imported) to the first batch.",
        "",
        "| shards | phase | prepare (find, index, tokenizer, estimate) | lanes + first batch | to first batch | "
        "CPU to first batch | process CPU (import included) | load average after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for phase in [p for p in PHASES if p in r]:
            x = r[phase]
            lines.append(
                f"| {r['shards']:,} | {phase} | {x['prepare_s']:.1f} s | {x['first_batch_s']:.1f} s | "
                f"{x['to_first_batch_s']:.1f} s | {x.get('cpu_to_first_batch_s', float('nan')):.1f} s | "
                f"{x['cpu_s']:.1f} s | {r['load'][0]:.1f} |"
            )
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        k = b["shards"] / a["shards"]
        for phase in [p for p in PHASES if p in a and p in b and "cpu_to_first_batch_s" in a[p]]:
            g = b[phase]["to_first_batch_s"] / a[phase]["to_first_batch_s"]
            c = b[phase]["cpu_to_first_batch_s"] / a[phase]["cpu_to_first_batch_s"]
            per = (b[phase]["cpu_to_first_batch_s"] - a[phase]["cpu_to_first_batch_s"]) / (b["shards"] - a["shards"])
            lines.append(
                f"\n{phase}: {k:.0f}x the shards, {g:.1f}x the wall time and {c:.1f}x the CPU time to first batch "
                f"({per * 1e3:.2f} ms of CPU per added shard)."
            )
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()), ""]
    res = os.path.join(HERE, "results")
    with open(os.path.join(res, f"{args.tag}.json"), "w") as f:
        json.dump({"command": cmd, "machine": m, "rows": rows}, f, indent=1)
    with open(os.path.join(res, f"{args.tag}.md"), "w") as f:
        f.write("\n".join(lines))
    stamp_files(os.path.join(res, f"{args.tag}.json"), os.path.join(res, f"{args.tag}.md"), command=cmd)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
