#!/usr/bin/env python
"""Does the number of GPUs change the result? The from-scratch experiment in miniature, on a CPU.

    python scripts/gpu_count_experiment.py              # 1, 2, 4 and 8 ranks, both loaders (~25 min, 2 cores)
    python scripts/gpu_count_experiment.py --plot-only  # redraw the figure (and the docs table) from the JSON

TorchTitan 0.3.0's llama3 debug model is trained from scratch on 1, 2, 4 and 8 data-parallel
ranks (real ``torchrun`` processes, gloo on CPU, through ``tests/support/titan_launcher.py``) with
the same seed, the same initial weights (a seed checkpoint written once), the same global batch,
learning-rate schedule and step count, once with TorchTitan's own ``HuggingFaceTextDataLoader``
and once with zephon, on the same JSONL corpus. Every run measures the validation loss at
regular intervals on one fixed held-out set (zephon's loader on a finite recipe, the same rows on
every rank count, ``validator.steps = -1``). Everything runs in fp32: in bf16, W=1 (autocast) and
W>=2 (FSDP's bf16 parameters) round differently, which alone moves the loss by ~1e-3.

Writes ``docs/img/gpu_count.json`` (every training loss, validation loss, per-step global-batch
digest, the zephon batch ledger's digests, timings and machine load), ``docs/img/gpu_count.png``
(training and validation curves per rank count, each loader side by side) and prints the docs
table (``--readme`` also rewrites it in docs/experiments.md): the spread (max - min over rank counts) of
the final validation loss, standard loader vs zephon.

The test tier runs a smaller variant (``tests/integrations/test_gpu_count.py``) and asserts what
the full run shows: zephon's global batches are byte-identical at every step on every rank count,
and its spread is at most 1e-3 and at least 10x smaller than the standard loader's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(ROOT, "tests", "support")  # the CPU launcher and the experiment's config functions
LAUNCHER = os.path.join(SUPPORT, "titan_launcher.py")
sys.path.insert(0, ROOT)

from benchmarks.stamp import stamp_files  # noqa: E402

README_START = "<!-- gpu-count-table:start (scripts/gpu_count_experiment.py --readme) -->"
README_END = "<!-- gpu-count-table:end -->"

TRAIN_TOML = """\
# the training data: zephon's recipe over the same JSONL files TorchTitan's loader reads
seed = 1234
lanes = 8
seq_len = {seq_len}
global_batch_size = {gbs}
cache_dir = "{cache}"

[tokenizer]
path = "{tokenizer}"

[[datasets]]
name = "web"
path = "corpus/train/*.jsonl"
format = "jsonl"
text_field = "text"

[pack]
algorithm = "greedy"
flush_every = 256

[shuffle]
buffer = 32

[workers]
count = 0
"""

VAL_TOML = """\
# the fixed validation set: one pass, in file order, every row once (end = "pad")
seed = 1234
lanes = 8
seq_len = {seq_len}
global_batch_size = {gbs}
cache_dir = "{cache}"
end = "pad"

[tokenizer]
path = "{tokenizer}"

[[datasets]]
name = "heldout"
path = "corpus/heldout/*.jsonl"
format = "jsonl"
text_field = "text"
policy = "stop"

[shuffle]
buffer = 1

[workers]
count = 0
"""


def write_data(work: str, scale: float, heldout: int, seq_len: int, gbs: int) -> dict:
    """The demo web corpus: the last ``heldout`` documents are the validation set, the rest train.

    No file name contains "val"/"test"/"eval": Hugging Face ``datasets`` assigns splits from file
    names, and TorchTitan's loader asks for split "train"."""
    from zephon.tools.demo import TOKENIZER_DIR
    from zephon.tools.synth import make_demo_corpus

    src = os.path.join(work, "generated")
    make_demo_corpus(src, seed=0, scale=scale)
    shards = sorted(os.listdir(os.path.join(src, "web")))
    train_dir, held_dir = os.path.join(work, "corpus", "train"), os.path.join(work, "corpus", "heldout")
    for d in (train_dir, held_dir):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    lines_last = open(os.path.join(src, "web", shards[-1]), encoding="utf-8").read().splitlines(keepends=True)
    if len(lines_last) <= heldout:
        raise SystemExit(f"the last shard has {len(lines_last)} documents; ask for fewer than that held out")
    for name in shards[:-1]:
        shutil.copy(os.path.join(src, "web", name), os.path.join(train_dir, name))
    with open(os.path.join(train_dir, shards[-1]), "w", encoding="utf-8") as f:
        f.writelines(lines_last[:-heldout])
    with open(os.path.join(held_dir, "heldout-0000.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(lines_last[-heldout:])
    fmt = dict(seq_len=seq_len, gbs=gbs, cache=os.path.join(work, "zcache"), tokenizer=TOKENIZER_DIR)
    paths = {"train_dir": train_dir, "train": os.path.join(work, "train.toml"), "val": os.path.join(work, "val.toml")}
    with open(paths["train"], "w", encoding="utf-8") as f:
        f.write(TRAIN_TOML.format(**fmt))
    with open(paths["val"], "w", encoding="utf-8") as f:
        f.write(VAL_TOML.format(**fmt))
    n_train = sum(1 for name in os.listdir(train_dir) for _ in open(os.path.join(train_dir, name), encoding="utf-8"))
    paths.update(train_docs=n_train, heldout_docs=heldout)
    return paths


class Runner:
    def __init__(self, work: str, data: dict, args: argparse.Namespace) -> None:
        self.work, self.data, self.args = work, data, args
        self.launches: list[dict] = []

    def env(self, out: str, W: int, seed_ckpt: str | None, extra: dict | None = None) -> dict:
        env = dict(os.environ)
        threads = max(1, (os.cpu_count() or 1) // W) if self.args.threads == 0 else self.args.threads
        env.update(
            TOKENIZERS_PARALLELISM="false",
            OMP_NUM_THREADS=str(threads),
            ZEPHON_CACHE_DIR=os.path.join(self.work, "zcache"),
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            HF_DATASETS_CACHE=os.path.join(self.work, "hfcache"),
            PYTHONPATH=os.pathsep.join([SUPPORT, ROOT, env.get("PYTHONPATH", "")]),
            EXP_TRAIN_RECIPE=self.data["train"],
            EXP_VAL_RECIPE=self.data["val"],
            EXP_TRAIN_DIR=self.data["train_dir"],
            EXP_VAL_FREQ=str(self.args.val_every),
            EXP_LR=str(self.args.lr),
            EXP_WARMUP=str(self.args.warmup),
            ZEPHON_TEST_OUT=out,
        )
        if self.args.layers:
            env["EXP_LAYERS"] = str(self.args.layers)
        if seed_ckpt:
            env["EXP_SEED_CKPT"] = seed_ckpt
        env.update(extra or {})
        return env

    def torchrun(
        self, name: str, W: int, config: str, steps: int, seed_ckpt: str | None, extra=(), env: dict | None = None
    ) -> str:
        """One ``torchrun`` launch; ``env`` adds to (or overrides) the experiment's environment."""
        out = os.path.join(self.work, "out", name)
        dump = os.path.join(self.work, "runs", name)
        for d in (out, dump):
            shutil.rmtree(d, ignore_errors=True)
        gbs = self.args.global_batch_size
        args = [
            "--module",
            "titan_experiment",
            "--config",
            config,
            "--dump_folder",
            dump,
            "--training.steps",
            str(steps),
            "--training.local_batch_size",
            str(gbs // W),
        ] + list(extra)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={W}", LAUNCHER] + args
        shown = " ".join(["torchrun --standalone", f"--nproc_per_node={W}", "tests/support/titan_launcher.py"] + args)
        print(f"[{name}] {shown.replace(self.work + os.sep, '')}", flush=True)
        load0, t0 = os.getloadavg(), time.time()
        p = subprocess.run(
            cmd, env=self.env(out, W, seed_ckpt, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        dt, load1 = time.time() - t0, os.getloadavg()
        os.makedirs(os.path.join(self.work, "logs"), exist_ok=True)
        with open(os.path.join(self.work, "logs", name + ".log"), "w", encoding="utf-8") as f:
            f.write(p.stdout)
        print(f"    -> rc {p.returncode} in {dt:.0f} s (load average {load0[0]:.1f} -> {load1[0]:.1f})", flush=True)
        if p.returncode != 0:
            raise SystemExit(
                f"[{name}] failed (rc {p.returncode}); log: {self.work}/logs/{name}.log\n{p.stdout[-5000:]}"
            )
        self.launches.append(
            {
                "name": name,
                "world_size": W,
                "seconds": round(dt, 1),
                "load_average_before": [round(x, 2) for x in load0],
                "load_average_after": [round(x, 2) for x in load1],
                "args": shown.replace(self.work + os.sep, ""),
            }
        )
        return out


def _records(folder: str, name: str, rank: int | None = 0) -> list[dict]:
    files = (
        [os.path.join(folder, f"{name}_rank{rank}.jsonl")]
        if rank is not None
        else sorted(
            (os.path.join(folder, f) for f in os.listdir(folder) if f.startswith(f"{name}_rank")),
            key=lambda p: int(p.rsplit("rank", 1)[1].split(".")[0]),
        )
    )
    out = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            out.extend(dict(json.loads(line), _file=os.path.basename(path)) for line in f if line.strip())
    return out


def read_run(out: str, W: int, steps: int, dump: str | None = None) -> dict:
    """Losses, validation losses, per-step global-batch digests and validation next() calls of one run."""
    loss = {r["step"]: r["loss"] for r in _records(out, "loss")}
    grad = {r["step"]: r["grad_norm"] for r in _records(out, "loss")}
    val = {r["step"]: r["val_loss"] for r in _records(out, "val")}
    # the rows every rank drew for each step, in rank order = the global batch as the model saw it
    per_step: dict[int, list[list[str]]] = {}
    for r in range(W):
        for rec in _records(out, "rows", r):
            per_step.setdefault(rec["step"], [[] for _ in range(W)])[r].extend(rec["rows"])
    digests = []
    for s in range(1, steps + 1):
        rows = [h for rank_rows in per_step[s] for h in rank_rows]
        digests.append(hashlib.sha256("".join(rows).encode()).hexdigest())
    calls = [[rec["calls"] for rec in _records(out, "valcalls", r)] for r in range(W)]
    run = {
        "world_size": W,
        "train_loss": [loss[s] for s in range(1, steps + 1)],
        "grad_norm": [grad[s] for s in range(1, steps + 1)],
        "val_steps": sorted(val),
        "val_loss": [val[s] for s in sorted(val)],
        "global_batch_sha256": digests,
        "validation_next_calls_per_rank": calls,
    }
    if dump is not None:
        from zephon.tools.ledger import read_ledger

        led = read_ledger(dump)
        run["ledger_digest"] = [led.digest(b) for b in range(steps)]
    return run


def run_all(args: argparse.Namespace) -> dict:
    t_start = time.time()
    work = os.path.abspath(args.workdir)
    for sub in ("out", "logs"):
        shutil.rmtree(os.path.join(work, sub), ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    data = write_data(work, args.scale, args.heldout, args.seq_len, args.global_batch_size)
    from zephon import Recipe
    from zephon.tools.cli import run_hashes

    val = Recipe.from_toml(data["val"])
    with val.global_loader(1) as g:
        end = g.end
        assert end is not None
        val_rows = end.steps * val.global_batch_size
    runner = Runner(work, data, args)
    if args.seed_checkpoint:
        seed_ckpt = os.path.abspath(args.seed_checkpoint)
    else:
        # the initial weights, once (W=1): every run loads them (model only) from this checkpoint
        runner.torchrun("seed", 1, "exp_seed", 1, None, ["--checkpoint.create_seed_checkpoint"])
        seed_ckpt = os.path.join(work, "runs", "seed", "checkpoint", "step-0")
    runs: dict[str, dict] = {"zephon": {}, "titan": {}}
    for W in args.world_sizes:
        for loader in args.loaders:
            name = f"{loader}_W{W}"
            out = runner.torchrun(name, W, f"exp_{loader}", args.steps, seed_ckpt)
            dump = os.path.join(work, "runs", name) if loader == "zephon" else None
            runs[loader][str(W)] = read_run(out, W, args.steps, dump)
    # what `zephon hashes --digest ledger` prints for the training recipe, computed here from the recipe alone
    import io

    expected_ledger = run_hashes(Recipe.from_toml(data["train"]), steps=args.steps, digest="ledger", out=io.StringIO())
    from importlib.metadata import version

    import torch

    return {
        "description": "From-scratch training of TorchTitan's llama3 debug model on 1, 2, 4 and 8 data-parallel ranks "
        "(CPU, gloo) with TorchTitan's HuggingFaceTextDataLoader and with zephon, same seed, initial weights, global "
        "batch, schedule and steps; validation loss on one fixed held-out set (zephon, finite recipe). "
        "Regenerate: python scripts/gpu_count_experiment.py",
        "setup": {
            "model": "TorchTitan llama3 debugmodel (dim 256, vocab 4096, SDPA attention on CPU)"
            + (f", first {args.layers} layers" if args.layers else ", 6 layers"),
            "precision": "fp32 (training.mixed_precision_param = float32)",
            "optimizer": f"AdamW lr {args.lr}, weight decay 0.1, grad clip 1.0; warmup {args.warmup} steps, "
            "cosine decay over 80% of the run to 0.1x",
            "initial_weights": "seed checkpoint written on W=1 (--checkpoint.create_seed_checkpoint), loaded model-only",
            "seq_len": args.seq_len,
            "global_batch_size": args.global_batch_size,
            "local_batch_size": {str(W): args.global_batch_size // W for W in args.world_sizes},
            "steps": args.steps,
            "validation_every": args.val_every,
            "validation_set": f"{args.heldout} held-out documents, {end.steps} steps x {val.global_batch_size} rows "
            f"= {val_rows} rows (end = 'pad': lanes hold {min(end.lane_steps)}..{max(end.lane_steps)} micro-batches)",
            "train_documents": data["train_docs"],
            "corpus": f"zephon demo web corpus (make_demo_corpus seed 0, scale {args.scale})",
            "zephon": "8 lanes, greedy packing, shuffle window 32",
            "titan": "HuggingFaceTextDataLoader(dataset='c4_test', dataset_path=corpus/train)",
            "world_sizes": args.world_sizes,
            "omp_threads": "cores / W" if args.threads == 0 else args.threads,
            "torch": torch.__version__,
            "torchtitan": version("torchtitan"),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "runs": runs,
        "zephon_hashes_ledger_digest": expected_ledger,
        "launches": runner.launches,
        "runtime_s": round(time.time() - t_start, 1),
    }


def summarize(res: dict) -> dict:
    out: dict = {}
    for loader, runs in res["runs"].items():
        if not runs:
            continue
        Ws = sorted(runs, key=int)
        final = {W: runs[W]["val_loss"][-1] for W in Ws}
        steps = runs[Ws[0]]["val_steps"]
        spread_by_step = [
            max(runs[W]["val_loss"][i] for W in Ws) - min(runs[W]["val_loss"][i] for W in Ws) for i in range(len(steps))
        ]
        n = len(runs[Ws[0]]["train_loss"])
        train_spread = [
            max(runs[W]["train_loss"][i] for W in Ws) - min(runs[W]["train_loss"][i] for W in Ws) for i in range(n)
        ]
        ref = runs[Ws[0]]["global_batch_sha256"]
        same_steps = {W: sum(a == b for a, b in zip(runs[W]["global_batch_sha256"], ref)) for W in Ws}
        calls = {W: runs[W]["validation_next_calls_per_rank"] for W in Ws}
        s = {
            "final_val_loss": final,
            "final_val_spread": max(final.values()) - min(final.values()),
            "val_steps": steps,
            "val_spread_by_step": spread_by_step,
            "max_train_loss_spread": max(train_spread),
            "final_train_loss_spread": train_spread[-1],
            "global_batches_equal_to_W1": same_steps,
            "steps": n,
            "validation_passes_all_ranks_same_calls": all(
                len({tuple(c) for c in calls[W]}) == 1 and len(calls[W][0]) == len(steps) for W in Ws
            ),
            "validation_next_calls_per_pass": {W: calls[W][0][0] if calls[W][0] else None for W in Ws},
        }
        if loader == "zephon":
            exp = res.get("zephon_hashes_ledger_digest")
            s["ledger_equal_on_every_W_and_to_zephon_hashes"] = all(runs[W].get("ledger_digest") == exp for W in Ws)
        out[loader] = s
    if "zephon" in out and "titan" in out:
        out["spread_ratio_titan_over_zephon"] = out["titan"]["final_val_spread"] / max(
            out["zephon"]["final_val_spread"], 1e-12
        )
    return out


def table(res: dict) -> str:
    s = summarize(res)
    Ws = [str(W) for W in res["setup"]["world_sizes"]]
    head = "| loader | " + " | ".join(f"W={W}" for W in Ws) + " | spread (max − min) |"
    rows = [head, "|---" * (len(Ws) + 2) + "|"]
    names = {"titan": "TorchTitan `HuggingFaceTextDataLoader`", "zephon": "zephon"}
    for loader in ("titan", "zephon"):
        if loader not in s:
            continue
        f = s[loader]["final_val_loss"]
        rows.append(
            f"| {names[loader]} | "
            + " | ".join(f"{f[W]:.5f}" for W in Ws)
            + f" | **{s[loader]['final_val_spread']:.2e}** |"
        )
    return "\n".join(rows)


def plot(res: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarize(res)
    setup = res["setup"]
    colors = {"1": "#1f77b4", "2": "#d62728", "4": "#2ca02c", "8": "#9467bd", "16": "#8c564b"}
    loaders = [l for l in ("titan", "zephon") if res["runs"].get(l)]
    fig, axes = plt.subplots(
        3,
        len(loaders),
        figsize=(7.2 * len(loaders), 10.2),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2.2, 1.6]},
    )
    all_runs = [r for l in loaders for r in res["runs"][l].values()]
    lo_t = min(min(r["train_loss"]) for r in all_runs)
    hi_t = max(max(r["train_loss"][10:]) for r in all_runs)
    lo_v = min(min(r["val_loss"]) for r in all_runs)
    hi_v = max(max(r["val_loss"][1:]) for r in all_runs)
    titles = {"titan": "TorchTitan's own loader (HuggingFaceTextDataLoader)", "zephon": "zephon"}
    for col, loader in enumerate(loaders):
        runs = res["runs"][loader]
        Ws = sorted(runs, key=int)
        ax, axv, axs = axes[0, col], axes[1, col], axes[2, col]
        for W in Ws:
            r = runs[W]
            steps = list(range(1, len(r["train_loss"]) + 1))
            ax.plot(steps, r["train_loss"], lw=1.1, color=colors.get(W), alpha=0.85, label=f"W={W}")
            axv.plot(r["val_steps"], r["val_loss"], marker="o", ms=4, lw=1.3, color=colors.get(W), label=f"W={W}")
        sl = s[loader]
        n = sl["steps"]
        train_spread = [
            max(runs[W]["train_loss"][i] for W in Ws) - min(runs[W]["train_loss"][i] for W in Ws) for i in range(n)
        ]
        axs.semilogy(range(1, n + 1), [max(x, 1e-8) for x in train_spread], color="0.6", lw=0.9, label="training loss")
        axs.semilogy(
            sl["val_steps"],
            [max(x, 1e-8) for x in sl["val_spread_by_step"]],
            "k-o",
            ms=4,
            lw=1.3,
            label="validation loss",
        )
        axs.axhline(1e-3, color="0.4", ls=":", lw=1)
        axs.text(1.0, 1e-3, " 1e-3", fontsize=8, color="0.3", va="center", transform=axs.get_yaxis_transform())
        axs.set_ylim(1e-8, 3)
        axs.text(0.01, 0.95, "exact 0 drawn at 1e-8", transform=axs.transAxes, fontsize=7.5, color="0.35", va="top")
        axs.legend(loc="lower right", fontsize=8, ncol=2)
        ax.set_ylim(lo_t - 0.05, hi_t + 0.15)
        axv.set_ylim(lo_v - 0.03, hi_v + 0.06)
        first = runs[Ws[0]]["val_loss"][0]
        axv.text(0.01, 0.97, f"step 1: {first:.2f} (off the scale)", transform=axv.transAxes, fontsize=8, va="top")
        same = sl["global_batches_equal_to_W1"]
        if all(v == n for v in same.values()):
            ident = f"global batches byte-identical to W={Ws[0]}'s at all {n} steps on every W"
            for a in (ax, axv):
                a.text(
                    0.5,
                    0.5 if a is ax else 0.15,
                    "the curves of W = " + ", ".join(Ws) + " coincide",
                    transform=a.transAxes,
                    ha="center",
                    fontsize=9,
                    color="0.3",
                )
        else:
            ident = "global batches equal to W=1's: " + ", ".join(f"W={W} {same[W]}/{n}" for W in Ws[1:])
        ax.set_title(
            f"{titles[loader]}\nfinal validation loss spread over W: {sl['final_val_spread']:.2e}\n{ident}",
            fontsize=10,
        )
        ax.set_ylabel("training loss")
        axv.set_ylabel("validation loss\n(one fixed held-out set)")
        axs.set_ylabel("spread over W\n(max − min)")
        axs.set_xlabel("step")
        for a in (ax, axv, axs):
            a.grid(alpha=0.25)
        ax.legend(loc="upper right", fontsize=8.5, ncol=2)
        axv.legend(loc="upper right", fontsize=8.5, ncol=2)
    fig.suptitle(
        "Training from scratch on 1, 2, 4 and 8 data-parallel ranks, same seed, initial weights, global batch and "
        f"schedule\nTorchTitan llama3 debug model ({setup['model'].split('), ')[-1]}), CPU, fp32, "
        f"{setup['steps']} steps of {setup['global_batch_size']} × {setup['seq_len']} tokens",
        fontsize=11,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def update_readme(res: dict, readme: str) -> None:
    text = open(readme, encoding="utf-8").read()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{readme} has no {README_START} ... {README_END} block")
    a, rest = text.split(README_START, 1)
    _, b = rest.split(README_END, 1)
    with open(readme, "w", encoding="utf-8") as f:
        f.write(a + README_START + "\n" + table(res) + "\n" + README_END + b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--loaders", nargs="+", default=["zephon", "titan"], choices=["zephon", "titan"])
    p.add_argument("--val-every", type=int, default=25, help="validation at step 1 and every N steps")
    p.add_argument("--heldout", type=int, default=120, help="documents held out as the validation set")
    p.add_argument("--scale", type=float, default=1.0, help="size of the generated corpus (1.0: 2400 documents)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2, help="keep only the first N transformer layers (0 = all 6)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP threads per rank (0 = cores / W; more than 1 slows to a crawl when other work shares the cores)",
    )
    p.add_argument("--workdir", default=os.path.join(ROOT, "build", "gpu_count"))
    p.add_argument("--json", default=os.path.join(ROOT, "docs", "img", "gpu_count.json"))
    p.add_argument("--png", default=os.path.join(ROOT, "docs", "img", "gpu_count.png"))
    p.add_argument("--readme", action="store_true", help="rewrite the table in docs/experiments.md")
    p.add_argument("--plot-only", action="store_true", help="redraw from the JSON")
    p.add_argument("--no-plot", action="store_true", help="write the JSON only (the test tier)")
    p.add_argument(
        "--seed-checkpoint",
        default=None,
        help="use this step-0 folder (written by an earlier run with the same --layers) instead of writing one",
    )
    args = p.parse_args()
    if args.plot_only:
        with open(args.json, encoding="utf-8") as f:
            res = json.load(f)
    else:
        for W in args.world_sizes:
            if 8 % W or args.global_batch_size % W:
                raise SystemExit(f"W={W} must divide the 8 lanes and the global batch ({args.global_batch_size})")
        res = run_all(args)
        res["summary"] = summarize(res)
        res["readme_table"] = table(res)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        stamp_files(args.json)  # the commit, machine and command
    if not args.no_plot:
        plot(res, args.png)
    s = summarize(res)
    print()
    print(table(res))
    print()
    for loader in ("titan", "zephon"):
        if loader in s:
            sl = s[loader]
            print(
                f"{loader:>6}: final validation spread {sl['final_val_spread']:.3e}; by validation step "
                + ", ".join(f"{st}: {x:.1e}" for st, x in zip(sl["val_steps"], sl["val_spread_by_step"]))
                + f"; global batches equal to W=1: {sl['global_batches_equal_to_W1']}"
            )
    if "spread_ratio_titan_over_zephon" in s:
        import numpy as np

        z = s["zephon"]["final_val_spread"]
        ulp = float(np.spacing(np.float32(max(s["zephon"]["final_val_loss"].values()))))
        if z <= 4 * ulp:  # a ratio would divide by float resolution
            print(
                f"zephon's final losses are equal to the last bit: a spread of {z / ulp:.2g} float32 steps of the loss"
            )
        else:
            print(f"spread ratio TorchTitan / zephon: {s['spread_ratio_titan_over_zephon']:.0f}x")
    if "zephon" in s:
        print(
            f"zephon ledger digests equal on every W and to `zephon hashes --digest ledger`: "
            f"{s['zephon']['ledger_equal_on_every_W_and_to_zephon_hashes']}"
        )
    print(
        f"runtime {res['runtime_s']:.0f} s; wrote {os.path.relpath(args.json, ROOT)}, {os.path.relpath(args.png, ROOT)}"
    )
    if args.readme:
        update_readme(res, os.path.join(ROOT, "docs", "experiments.md"))
        print("updated the table in docs/experiments.md")


if __name__ == "__main__":
    main()
