#!/usr/bin/env python
"""Loader CPU per step of a model-parallel group: TP = 4 peers reading once vs each peer reading.

    python benchmarks/read_once.py                 # writes benchmarks/results/read_once.{md,json}
    python benchmarks/read_once.py --steps 10 --tag quick

Real processes on gloo (``torchrun``), one DP rank: TP = 1 (one process), then TP = 4 (four
processes, TorchTitan's mesh order, ``tp`` innermost) with every peer reading
(``read_once = False``) and with read-once (the default). Each rank runs
``tests/support/read_once_worker.py``: it builds :class:`ZephonDataLoader` for its DP rank, takes
the first step (startup), then ``--steps`` recipe steps, and reports its CPU seconds (the process's,
threads included) and the records its own pipeline fetched. The group's loader CPU per step is the
sum over its peers. The corpus (the demo generator's, about 6 MB) is written under /tmp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(ROOT, "tests", "support", "read_once_worker.py")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import machine, versions  # noqa: E402
from benchmarks.stamp import stamp_files  # noqa: E402

RECIPE = """\
seed = 5
lanes = 8
seq_len = 1024
global_batch_size = 16
cache_dir = "{root}/cache"

[tokenizer]
path = "{tok}"

[[datasets]]
name = "web"
path = "{root}/web/*.jsonl"
weight = 0.6

[[datasets]]
name = "books"
path = "{root}/books/*.txt"
format = "text"
weight = 0.4

[shuffle]
buffer = 64
"""


def _corpus(root: str) -> str:
    from zephon.tools.demo import TOKENIZER_DIR
    from zephon.tools.synth import make_demo_corpus

    make_demo_corpus(root, seed=11, scale=0.3)
    path = os.path.join(root, "recipe.toml")
    with open(path, "w") as f:
        f.write(RECIPE.format(root=root, tok=TOKENIZER_DIR))
    return path


def _run(n: int, tp: int, modes: str, recipe: str, out: str, steps: int) -> list[dict]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tests", "support"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", WORKER]
    cmd += ["--recipe", recipe, "--out", out, "--tp", str(tp), "--steps", str(steps), "--local-batch-size", "16"]
    p = subprocess.run(cmd + ["--modes", modes], env=env, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise SystemExit(f"torchrun failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rows = []
    for mode in modes.split(","):
        peers = [json.load(open(os.path.join(out, f"rank{r}_{mode}.json"))) for r in range(n)]
        rows.append(
            {
                "setup": f"TP = {tp}"
                + ("" if tp == 1 else (", read-once" if mode == "read_once" else ", every peer reads")),
                "processes": n,
                "group_cpu_per_step_ms": 1e3 * sum(p["cpu_per_step_s"] for p in peers),
                "leader_cpu_per_step_ms": 1e3 * peers[0]["cpu_per_step_s"],
                "follower_cpu_per_step_ms": [round(1e3 * p["cpu_per_step_s"], 2) for p in peers[1:]],
                "group_cpu_startup_s": sum(p["cpu_build_s"] for p in peers),
                "records_fetched": sum(p["records_fetched"] for p in peers),
                "wall_per_step_ms": 1e3 * max(p["wall_per_step_s"] for p in peers),
                "same_bytes_on_every_peer": len({tuple(p["hashes"]) for p in peers}) == 1,
                "hashes": peers[0]["hashes"],
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tag", default="read_once")
    args = ap.parse_args()
    t0 = time.time()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="zephon-read-once-") as tmp:
        recipe = _corpus(tmp)
        rows = _run(1, 1, "per_peer", recipe, os.path.join(tmp, "tp1"), args.steps)
        rows += _run(4, 4, "per_peer,read_once", recipe, os.path.join(tmp, "tp4"), args.steps)
    base, ref = rows[0]["group_cpu_per_step_ms"], rows[0]["hashes"]
    for r in rows:
        r["vs_tp1"] = r["group_cpu_per_step_ms"] / base
        r["same_batches_as_tp1"] = r.pop("hashes") == ref
    cmd = "python benchmarks/read_once.py" + (f" --steps {args.steps}" if args.steps != 30 else "")
    _write(rows, args, cmd, time.time() - t0, load0)


def _where() -> str:
    m = machine()
    return f"{m['cpu']}, {m['cores']} cores (affinity {m['affinity']})"


def _write(rows: list[dict], args: argparse.Namespace, cmd: str, took: float, load0: tuple) -> None:
    res = os.path.join(HERE, "results")
    os.makedirs(res, exist_ok=True)
    with open(os.path.join(res, f"{args.tag}.json"), "w") as f:
        json.dump({"command": cmd, "machine": machine(), "versions": versions(), "rows": rows}, f, indent=1)
    lines = [
        "# Read once per DP rank: loader CPU of a model-parallel group",
        "",
        f"Produced by `{cmd}` in {took:.0f} s on {_where()}; load average at start "
        f"{', '.join(f'{x:.2f}' for x in load0)}, at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}. "
        "The machine is shared by 8 sessions: wall times are noisy; the CPU columns (process time of each rank) "
        "are steadier.",
        "",
        f"One DP rank, recipe: 8 lanes x 2 rows of 1024 tokens per step (16 rows), shuffle window 64, "
        f"{args.steps} steps after the first, inline workers (all loader work on the rank's own CPU time).",
        "",
        "| setup | processes | group loader CPU per step | vs TP = 1 | leader | each follower (ms) | "
        "startup CPU (group) | records fetched (group) | same bytes on every peer, and as TP = 1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['processes']} | {r['group_cpu_per_step_ms']:.1f} ms | {r['vs_tp1']:.2f}x | "
            f"{r['leader_cpu_per_step_ms']:.1f} ms | {', '.join(map(str, r['follower_cpu_per_step_ms'])) or '-'} | "
            f"{r['group_cpu_startup_s']:.2f} s | {r['records_fetched']} | "
            f"{'yes' if r['same_bytes_on_every_peer'] and r['same_batches_as_tp1'] else 'NO'} |"
        )
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()), ""]
    with open(os.path.join(res, f"{args.tag}.md"), "w") as f:
        f.write("\n".join(lines))
    stamp_files(os.path.join(res, f"{args.tag}.json"), os.path.join(res, f"{args.tag}.md"), command=cmd)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
