#!/usr/bin/env python
"""Regenerate docs/img/titan_resume.{json,png}: TorchTitan's trainer resumed on another number of ranks.

    python scripts/plot_titan_resume.py                # about 8 minutes on a 2-core CPU
    python scripts/plot_titan_resume.py --plot-only    # redraw the PNG from the JSON

Trains TorchTitan 0.3.0's llama3 debug model on CPU (gloo, real ``torchrun`` processes, through
``tests/support/titan_launcher.py``, which patches TorchTitan for CPU and records the loss of every step)
four times, on the same data and global batch:

  (a) zephon, uninterrupted on W=2 ranks, steps 1..N;
  (b) zephon, elastic: W=2 to step 10 (checkpoint), resumed on W=1 to step 20 (checkpoint), resumed
      on W=4 to step N;
  (c) TorchTitan's own HuggingFaceTextDataLoader, uninterrupted on W=2;
  (d) TorchTitan's loader, the same elastic schedule: each resume on another W is refused
      (the error is recorded); it is then resumed with ``--checkpoint.exclude_from_loading
      dataloader`` (model and optimizer restored, the data restarts from the beginning).

Losses go to docs/img/titan_resume.json, the plot to docs/img/titan_resume.png (left: (a) vs (b),
right: (c) vs (d); bottom row: |loss difference| to the uninterrupted run). The default data is a
small generated corpus (lanes 8, seq_len 64, global batch 16 rows, as in tests/integrations/test_titan.py);
``--recipe demo`` uses the bundled demo recipe of ``--config zephon_llama3_debug`` (slower).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "support")  # the CPU launcher and the helpers it imports
LAUNCHER = os.path.join(TESTS, "titan_launcher.py")
sys.path.insert(0, ROOT)

from benchmarks.stamp import stamp_files  # noqa: E402


def write_small_recipe(root: str) -> str:
    """The small recipe of tests/integrations/test_titan.py: 8 lanes, seq_len 64, global batch 16 rows."""
    from zephon.tools.demo import DEMO_TOML, TOKENIZER_DIR
    from zephon.tools.synth import make_demo_corpus

    os.makedirs(root, exist_ok=True)
    make_demo_corpus(root, seed=0, scale=0.1)
    text = (
        DEMO_TOML.format(tokenizer=TOKENIZER_DIR.replace("\\", "/"))
        .replace("lanes = 16", "lanes = 8")
        .replace("seq_len = 256", "seq_len = 64")
        .replace("global_batch_size = 32", "global_batch_size = 16")
        .replace("count = 2", "count = 0")
    )
    path = os.path.join(root, "small.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


class Runner:
    def __init__(self, work: str, recipe: str, hf_data: str, lbs: int, steps: int):
        self.work, self.recipe, self.hf_data, self.lbs, self.steps = work, recipe, hf_data, lbs, steps
        self.launches = []

    def env(self, out: str) -> dict:
        env = dict(os.environ)
        env.update(
            TOKENIZERS_PARALLELISM="false",
            OMP_NUM_THREADS="1",
            ZEPHON_CACHE_DIR=os.path.join(self.work, "zcache"),
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            HF_DATASETS_CACHE=os.path.join(self.work, "hfcache"),
            PYTHONPATH=os.pathsep.join([TESTS, ROOT, env.get("PYTHONPATH", "")]),
            ZEPHON_TEST_RECIPE=self.recipe,
            ZEPHON_TEST_HF_DATA=self.hf_data,
            ZEPHON_TEST_OUT=out,
            ZEPHON_TEST_LBS=str(self.lbs),
        )
        return env

    def torchrun(self, name: str, W: int, config: str, dump: str, until: int, extra=(), expect_fail=False):
        """One ``torchrun`` launch; returns its output. ``expect_fail``: must fail (TorchTitan's resume)."""
        out = os.path.join(self.work, "losses", name)
        shutil.rmtree(out, ignore_errors=True)
        args = [
            "--module",
            "titan_launcher",
            "--config",
            config,
            "--dump_folder",
            dump,
            "--training.steps",
            str(until),
            "--checkpoint.interval",
            str(self.steps),
        ] + list(extra)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={W}", LAUNCHER] + args
        shown = " ".join(["torchrun --standalone", f"--nproc_per_node={W}", "tests/support/titan_launcher.py"] + args)
        print(f"[{name}] {shown.replace(self.work + os.sep, '')}", flush=True)
        t0 = time.time()
        p = subprocess.run(cmd, env=self.env(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        dt = time.time() - t0
        os.makedirs(os.path.join(self.work, "logs"), exist_ok=True)
        with open(os.path.join(self.work, "logs", name + ".log"), "w", encoding="utf-8") as f:
            f.write(p.stdout)
        failed = p.returncode != 0
        print(f"    -> rc {p.returncode} in {dt:.0f} s", flush=True)
        if failed != expect_fail:
            tail = p.stdout[-5000:]
            raise SystemExit(
                f"[{name}] {'succeeded' if not failed else 'failed'} unexpectedly (rc {p.returncode}); "
                f"log: {self.work}/logs/{name}.log\n{tail}"
            )
        self.launches.append(
            {
                "name": name,
                "world_size": W,
                "until_step": until,
                "rc": p.returncode,
                "seconds": round(dt, 1),
                "args": shown.replace(self.work + os.sep, ""),
            }
        )
        return p.stdout, out


def read_losses(folder: str) -> dict:
    """{step: (loss, grad_norm)} as rank 0 of a launch logged them."""
    with open(os.path.join(folder, "loss_rank0.jsonl"), encoding="utf-8") as f:
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, f)}


def read_hashes(folder: str) -> dict:
    """{(step, lane): sha256} from every rank's per-lane batch hashes."""
    out = {}
    for path in glob.glob(os.path.join(folder, "hashes_rank*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for rec in map(json.loads, f):
                for lane, h in rec["lanes"].items():
                    out[(rec["step"], int(lane))] = h
    return out


def error_line(log: str) -> str:
    """The exception a failed launch ended with, as rank 0 reported it (without the log prefix)."""
    found = re.findall(r"^\[rank(\d+)\]:\s*((?:\w+\.)*\w*(?:Error|Exception): .*)$", log, re.M)
    if not found:
        raise SystemExit("a TorchTitan resume failed without an exception line; see its log")
    # rank 0's first *Error (DCP wraps the per-rank errors in a less telling CheckpointException)
    found.sort(key=lambda m: (not m[1].split(":")[0].endswith("Error"), int(m[0])))
    return found[0][1].strip()


def series(segments: list) -> dict:
    """Concatenate [(W, {step: (loss, grad_norm)}), ...] into parallel lists."""
    steps, ws, losses, gnorms = [], [], [], []
    for W, ls in segments:
        for s in sorted(ls):
            steps.append(s)
            ws.append(W)
            losses.append(ls[s][0])
            gnorms.append(ls[s][1])
    return {"step": steps, "world_size": ws, "loss": losses, "grad_norm": gnorms}


def run_all(args) -> dict:
    t_start = time.time()
    work = os.path.abspath(args.workdir)
    for sub in ("runs", "losses", "logs"):
        shutil.rmtree(os.path.join(work, sub), ignore_errors=True)
    data = os.path.join(work, "data")
    if args.recipe == "small":
        recipe = write_small_recipe(data)
        hf_data = os.path.join(data, "web")
    elif args.recipe == "demo":
        from zephon.tools.demo import write_demo_recipe

        recipe = write_demo_recipe(os.path.join(work, "demo"))
        hf_data = os.path.join(work, "demo", "web")
    else:
        raise SystemExit("--recipe must be 'small' or 'demo'")
    from zephon import Recipe

    r = Recipe.from_toml(recipe)
    N, (R1, R2) = args.steps, args.resume_after
    W0, W1, W2 = args.world_sizes
    for W in (W0, W1, W2):
        if r.lanes % W or r.global_batch_size % (W * args.local_batch_size):
            raise SystemExit(
                f"W={W} does not fit lanes={r.lanes}, global batch {r.global_batch_size}, "
                f"local batch {args.local_batch_size}"
            )
    run = Runner(work, recipe, hf_data, args.local_batch_size, N)
    d = lambda name: os.path.join(work, "runs", name)  # noqa: E731

    # (a) zephon, uninterrupted
    _, out_a = run.torchrun("zephon_uninterrupted", W0, "zephon_llama3_cpu", d("zephon_ref"), N)
    # (b) zephon, elastic: W0 -> checkpoint -> W1 -> checkpoint -> W2 (same dump folder: resumes from the newest step)
    _, out_b0 = run.torchrun("zephon_elastic_0", W0, "zephon_llama3_cpu", d("zephon_elastic"), R1)
    _, out_b1 = run.torchrun("zephon_elastic_1", W1, "zephon_llama3_cpu", d("zephon_elastic"), R2)
    _, out_b2 = run.torchrun("zephon_elastic_2", W2, "zephon_llama3_cpu", d("zephon_elastic"), N)
    # (c) TorchTitan's loader, uninterrupted
    _, out_c = run.torchrun("titan_uninterrupted", W0, "titan_loader_cpu", d("titan_ref"), N)
    # (d) TorchTitan's loader, elastic: each resume on another W is refused; then without loader state
    excl = ["--checkpoint.exclude_from_loading", "dataloader"]
    _, out_d0 = run.torchrun("titan_elastic_0", W0, "titan_loader_cpu", d("titan_elastic"), R1)
    log1, _ = run.torchrun("titan_elastic_1_refused", W1, "titan_loader_cpu", d("titan_elastic"), R2, expect_fail=True)
    _, out_d1 = run.torchrun("titan_elastic_1", W1, "titan_loader_cpu", d("titan_elastic"), R2, excl)
    log2, _ = run.torchrun("titan_elastic_2_refused", W2, "titan_loader_cpu", d("titan_elastic"), N, expect_fail=True)
    _, out_d2 = run.torchrun("titan_elastic_2", W2, "titan_loader_cpu", d("titan_elastic"), N, excl)

    zref, tref = read_losses(out_a), read_losses(out_c)
    zel = [(W0, read_losses(out_b0)), (W1, read_losses(out_b1)), (W2, read_losses(out_b2))]
    tel = [(W0, read_losses(out_d0)), (W1, read_losses(out_d1)), (W2, read_losses(out_d2))]
    for segs in (zel, tel):
        got = sorted(s for _, ls in segs for s in ls)
        if got != list(range(1, N + 1)):
            raise SystemExit(f"elastic run covers steps {got}, expected 1..{N}")
    if sorted(zref) != list(range(1, N + 1)) or sorted(tref) != list(range(1, N + 1)):
        raise SystemExit("an uninterrupted run did not record every step")

    # global batches: every (step, lane) batch of (b) equals (a)'s
    h_ref = read_hashes(out_a)
    h_el = {}
    for o in (out_b0, out_b1, out_b2):
        h_el.update(read_hashes(o))
    same = sum(1 for k in h_ref if h_el.get(k) == h_ref[k])
    if set(h_el) != set(h_ref) or len(h_ref) != N * r.lanes:
        raise SystemExit("lane batch hashes do not cover every (step, lane)")

    from importlib.metadata import version

    import torch

    errors = [
        {"after_step": R1, "saved_on": W0, "resumed_on": W1, "error": error_line(log1)},
        {"after_step": R2, "saved_on": W1, "resumed_on": W2, "error": error_line(log2)},
    ]
    return {
        "description": "Loss per step of TorchTitan's llama3 debug model on CPU (gloo): uninterrupted runs vs "
        "runs resumed from checkpoints on other numbers of data-parallel ranks, with zephon's loader "
        "and with TorchTitan's HuggingFaceTextDataLoader. Regenerate: python scripts/plot_titan_resume.py",
        "setup": {
            "model": "TorchTitan llama3 debugmodel (vocab 4096, SDPA attention on CPU), FSDP, AdamW lr 8e-4, "
            "2 warmup steps then constant",
            "device": "CPU, gloo, torchrun (tests/support/titan_launcher.py)",
            "recipe": args.recipe,
            "lanes": r.lanes,
            "seq_len": r.seq_len,
            "global_batch_size": r.global_batch_size,
            "local_batch_size": args.local_batch_size,
            "steps": N,
            "resume_after": [R1, R2],
            "world_sizes": [W0, W1, W2],
            "torch": torch.__version__,
            "torchtitan": version("torchtitan"),
            "python": platform.python_version(),
        },
        "runs": {
            "zephon_uninterrupted": series([(W0, zref)]),
            "zephon_elastic": series(zel),
            "titan_uninterrupted": series([(W0, tref)]),
            "titan_elastic": series(tel),
        },
        "titan_resume_errors": errors,
        "zephon_lane_batches_identical": {"equal": same, "total": len(h_ref)},
        "launches": run.launches,
        "runtime_s": round(time.time() - t_start, 1),
    }


def summarize(res: dict) -> dict:
    runs, R1, R2 = res["runs"], *res["setup"]["resume_after"]
    out = {}
    for name in ("zephon", "titan"):
        ref = dict(zip(runs[f"{name}_uninterrupted"]["step"], runs[f"{name}_uninterrupted"]["loss"]))
        el = dict(zip(runs[f"{name}_elastic"]["step"], runs[f"{name}_elastic"]["loss"]))
        diff = {s: abs(el[s] - ref[s]) for s in el}
        gref = dict(zip(runs[f"{name}_uninterrupted"]["step"], runs[f"{name}_uninterrupted"]["grad_norm"]))
        gel = dict(zip(runs[f"{name}_elastic"]["step"], runs[f"{name}_elastic"]["grad_norm"]))
        out[name] = {
            "max_abs_diff_before_resume": max(diff[s] for s in diff if s <= R1),
            "max_abs_diff_after_resume": max(diff[s] for s in diff if s > R1),
            "max_abs_diff_segment_2": max(diff[s] for s in diff if R1 < s <= R2),
            "max_abs_diff_segment_3": max(diff[s] for s in diff if s > R2),
            "max_abs_grad_norm_diff_after_resume": max(abs(gel[s] - gref[s]) for s in gel if s > R1),
            "final_loss_uninterrupted": ref[max(ref)],
            "final_loss_elastic": el[max(el)],
        }
    return out


def plot(res: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, setup = res["runs"], res["setup"]
    R1, R2 = setup["resume_after"]
    W0, W1, W2 = setup["world_sizes"]
    summ = summarize(res)
    floor = 1e-7
    marker = {W0: "o", W1: "s", W2: "^"}
    seg_color = {W0: "#1f77b4", W1: "#d62728", W2: "#2ca02c"}

    fig, axes = plt.subplots(2, 2, figsize=(13, 7.2), sharex=True, gridspec_kw={"height_ratios": [3, 1.25]})
    ylo = min(min(r["loss"]) for r in runs.values())
    yhi = max(max(r["loss"]) for r in runs.values())
    pad = 0.06 * (yhi - ylo)
    for col, name in enumerate(("zephon", "titan")):
        ax, axd = axes[0, col], axes[1, col]
        ref, el = runs[f"{name}_uninterrupted"], runs[f"{name}_elastic"]
        ax.plot(
            ref["step"],
            ref["loss"],
            color="0.55",
            lw=6,
            alpha=0.45,
            solid_capstyle="round",
            label=f"uninterrupted, W={W0}",
            zorder=1,
        )
        for W in (W0, W1, W2):
            idx = [i for i, w in enumerate(el["world_size"]) if w == W]
            if not idx:
                continue
            ax.plot(
                [el["step"][i] for i in idx],
                [el["loss"][i] for i in idx],
                marker=marker[W],
                ms=5,
                lw=1.3,
                color=seg_color[W],
                label=f"resumed run, W={W}",
                zorder=3,
            )
        refd = dict(zip(ref["step"], ref["loss"]))
        diffs = [max(abs(l - refd[s]), floor) for s, l in zip(el["step"], el["loss"])]
        axd.semilogy(el["step"], diffs, color="k", lw=1, zorder=2)
        for W in (W0, W1, W2):
            idx = [i for i, w in enumerate(el["world_size"]) if w == W]
            axd.scatter(
                [el["step"][i] for i in idx],
                [diffs[i] for i in idx],
                marker=marker[W],
                s=22,
                color=seg_color[W],
                zorder=3,
            )
        axd.axhline(1e-3, color="0.4", ls=":", lw=1)
        axd.text(1.0, 1e-3, " 1e-3", fontsize=8, color="0.3", va="center", transform=axd.get_yaxis_transform())
        axd.set_ylim(floor / 2, 3)
        for a in (ax, axd):
            for s in (R1, R2):
                a.axvline(s + 0.5, color="0.3", ls="--", lw=1, zorder=0)
            a.grid(alpha=0.25)
        for s, W in ((R1, W1), (R2, W2)):
            ax.text(
                s + 0.5,
                1.01,
                f"resume on W={W}",
                fontsize=9,
                ha="center",
                va="bottom",
                color="0.2",
                transform=ax.get_xaxis_transform(),
            )
        ax.set_ylim(ylo - pad, yhi + 5 * pad)  # headroom for the error box
        axd.set_xlabel("step")
        s = summ[name]
        if name == "zephon":
            ident = res["zephon_lane_batches_identical"]
            ax.set_title(
                f"zephon: W={W0} → {W1} → {W2} lies on the uninterrupted W={W0} run\n"
                f"max |Δloss| after the resumes {s['max_abs_diff_after_resume']:.1e}; "
                + (
                    f"global batches identical ({ident['total']}/{ident['total']} lane batches)"
                    if ident["equal"] == ident["total"]
                    else f"lane batches equal: only {ident['equal']}/{ident['total']}"
                ),
                fontsize=10.5,
                pad=18,
            )
            ax.set_ylabel("training loss")
            axd.set_ylabel("|Δloss| vs uninterrupted")
        else:
            ax.set_title(
                f"TorchTitan's own loader (HuggingFaceTextDataLoader): resume on W={W1} refused;\n"
                f"without loader state the data restarts: max |Δloss| {s['max_abs_diff_after_resume']:.2f}",
                fontsize=10.5,
                pad=18,
            )
            lines = []
            for e in res["titan_resume_errors"]:
                err = e["error"]
                if len(err) > 64:
                    cut = err.rfind(" ", 0, 64)
                    err = err[:cut] + "\n    " + err[cut + 1 :]
                lines.append(f"resume W={e['saved_on']}→{e['resumed_on']}: {err}")
            lines.append("then resumed with --checkpoint.exclude_from_loading dataloader")
            ax.text(
                0.98,
                0.97,
                "\n".join(lines),
                transform=ax.transAxes,
                fontsize=8,
                family="monospace",
                va="top",
                ha="right",
                multialignment="left",
                bbox=dict(boxstyle="round", fc="#fff3f3", ec="#d62728", alpha=0.95),
            )
        ax.legend(loc="lower left", fontsize=8.5, framealpha=0.9)
    axes[1, 0].text(
        0.02, 0.9, f"exact 0 drawn at {floor:g}", transform=axes[1, 0].transAxes, fontsize=8, color="0.3", va="top"
    )
    fig.suptitle(
        f"TorchTitan llama3 debug model on CPU, global batch {setup['global_batch_size']} × "
        f"{setup['seq_len']} tokens: checkpoint after step {R1} on W={W0}, resume on W={W1}, "
        f"checkpoint after step {R2}, resume on W={W2}",
        fontsize=11,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--resume-after", type=int, nargs=2, default=[10, 20], metavar=("S1", "S2"))
    p.add_argument("--world-sizes", type=int, nargs=3, default=[2, 1, 4], metavar=("W0", "W1", "W2"))
    p.add_argument(
        "--local-batch-size", type=int, default=4, help="rows per micro-batch (grad accumulation fills the rest)"
    )
    p.add_argument("--recipe", default="small", choices=["small", "demo"])
    p.add_argument(
        "--workdir",
        default=os.path.join(ROOT, "build", "titan_resume"),
        help="runs, checkpoints and logs (default build/titan_resume)",
    )
    p.add_argument("--json", default=os.path.join(ROOT, "docs", "img", "titan_resume.json"))
    p.add_argument("--png", default=os.path.join(ROOT, "docs", "img", "titan_resume.png"))
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    p.add_argument("--keep-checkpoints", action="store_true")
    args = p.parse_args()

    if args.plot_only:
        with open(args.json, encoding="utf-8") as f:
            res = json.load(f)
    else:
        if not (0 < args.resume_after[0] < args.resume_after[1] < args.steps):
            raise SystemExit("need 0 < S1 < S2 < --steps")
        res = run_all(args)
        res["summary"] = summarize(res)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        stamp_files(args.json)  # the commit, machine and command
        if not args.keep_checkpoints:
            shutil.rmtree(os.path.join(os.path.abspath(args.workdir), "runs"), ignore_errors=True)
    plot(res, args.png)

    s = summarize(res)
    R1, _ = res["setup"]["resume_after"]
    print(
        f"zephon    max |loss diff| elastic vs uninterrupted, steps {R1 + 1}..{res['setup']['steps']}: "
        f"{s['zephon']['max_abs_diff_after_resume']:.3e} (steps 1..{R1}: {s['zephon']['max_abs_diff_before_resume']:.3e})"
    )
    ident = res["zephon_lane_batches_identical"]
    print(f"zephon    lane batches identical to the uninterrupted run: {ident['equal']}/{ident['total']}")
    if ident["equal"] != ident["total"]:
        print(
            "WARNING: the elastic run's batches differ from the uninterrupted run's (was zephon's code edited "
            "while the script ran?)"
        )
    print(
        f"torchtitan max |loss diff| elastic (data restarted) vs uninterrupted, steps {R1 + 1}..: "
        f"{s['titan']['max_abs_diff_after_resume']:.3e}"
    )
    for e in res["titan_resume_errors"]:
        print(f"torchtitan resume W={e['saved_on']} -> W={e['resumed_on']} after step {e['after_step']}: {e['error']}")
    print(
        f"runtime {res['runtime_s']:.0f} s; wrote {os.path.relpath(args.json, ROOT)} and {os.path.relpath(args.png, ROOT)}"
    )


if __name__ == "__main__":
    main()
