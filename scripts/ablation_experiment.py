#!/usr/bin/env python
"""Is my ablation's effect larger than the noise? One mixture weight changed, trained on 1 and 2 ranks.

    python scripts/ablation_experiment.py              # both loaders, W = 1, 2, three data seeds (~35 min, 2 busy cores)
    python scripts/ablation_experiment.py --bf16       # ... and zephon's runs once more in bf16 (slow on a CPU)
    python scripts/ablation_experiment.py --plot-only  # redraw the figure (and the docs table) from the JSON

The committed bf16 figure comes from a separate short run, merged into the JSON:

    python scripts/ablation_experiment.py --bf16-only --steps 4 --val-every 4 --docs 120 --heldout 10 \\
        --seeds 0 --seed-checkpoint build/ablation/runs/seed/checkpoint/step-0 \\
        --workdir build/abl_bf16 --json build/abl_bf16/abl.json --no-plot
    python scripts/ablation_experiment.py --plot-only --bf16-check build/abl_bf16/abl.json

The user's real question, in miniature. Two recipes differ in one mixture weight: recipe A reads
the synthetic ``web`` and ``code`` corpora (``zephon.tools.synth``) at token shares 0.7 / 0.3,
recipe B at 0.3 / 0.7. Each is trained from scratch on W = 1 and W = 2 data-parallel ranks
(TorchTitan 0.3.0's llama3 debug model, real ``torchrun`` processes, gloo on CPU, fp32, through
``scripts/gpu_count_experiment.py``'s launcher and ``tests/support/titan_experiment.py``) with
the same seed checkpoint, global batch, schedule and step count, once with TorchTitan's own
loader and once with zephon. Every run is validated on one fixed held-out set (half web, half
code documents; zephon's loader on a finite recipe, the same rows on every W).

How the A/B difference reaches TorchTitan's loader: TorchTitan 0.3.0 ships its own mixture
loader, ``InterleavedHuggingFaceTextDataLoader``: one ``HuggingFaceTextDataLoader`` source per
dataset folder (the same JSONL files zephon reads) with a weight; each packed row is drawn from
a source with probability = weight, so the weights are token shares, as zephon's are. Recipe A
gives it weights 0.7 / 0.3, recipe B 0.3 / 0.7: both loaders see the same documents and the same
mixture, each in its own order. The data seed is zephon's recipe ``seed`` and the interleaver's
``seed`` of TorchTitan's loader (its per-source document order is fixed: file order, split by rank).

Reported per loader: the ablation effect (final validation loss of B minus A) at each W; the
GPU-count effect (the spread over W of one recipe's final validation loss); whether the ablation
effect is the same at every W; and beside them the data-seed noise floor (the spread of recipe
A's final validation loss over three data seeds at W = 1, both loaders). zephon's spreads are
framed in float32 steps of the loss: a spread of 0 or a few float32 steps (reduction order across
ranks) is printed as "equal to the last bit" with the number of steps, never as a ratio that
divides by float resolution.

``--bf16`` also runs zephon's A and B at every W with ``training.mixed_precision_param =
"bfloat16"`` (TorchTitan 0.3.0 applies FSDP's mixed-precision policy at every W, W = 1 included,
so W = 1 and W = 2 round the same way; gloo carries the bf16 all-gathers on CPU). It works on
CPU/gloo, but bf16 matmuls on this CPU took ~25 s a step (fp32: 2-3 s), hence the short run.

Writes ``docs/img/ablation.json`` (every loss, per-step global-batch digests, ledger digests,
timings, machine load, the configuration), ``docs/img/ablation.png`` and prints the docs table
(``--readme`` rewrites it in docs/experiments.md). ``tests/integrations/test_ablation.py`` runs a small
variant; ``scripts/ablation_gpu.sh`` runs a bigger one on a 16-core machine.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_count_experiment as gce  # noqa: E402  (the launcher, the run reader, the validation recipe)

from benchmarks.stamp import stamp_files  # noqa: E402  (gpu_count_experiment puts the checkout on sys.path)

README_START = "<!-- ablation-table:start (scripts/ablation_experiment.py --readme) -->"
README_END = "<!-- ablation-table:end -->"
LOADER_NAMES = {
    "titan": "TorchTitan `InterleavedHuggingFaceTextDataLoader`",
    "zephon": "zephon",
    "zephon_bf16": "zephon, bf16",
}
LAST_BIT_STEPS = 4  # a spread of at most this many float32 steps of the loss is reduction-order rounding

TRAIN_TOML = """\
# recipe {label}: web {web} / code {code} (token shares), data seed {seed}
seed = {seed}
lanes = 8
seq_len = {seq_len}
global_batch_size = {gbs}
cache_dir = "{cache}"

[tokenizer]
path = "{tokenizer}"

[[datasets]]
name = "web"
path = "corpus/train/web/*.jsonl"
format = "jsonl"
text_field = "text"
weight = {web}

[[datasets]]
name = "code"
path = "corpus/train/code/*.jsonl"
format = "jsonl"
text_field = "text"
weight = {code}

[pack]
algorithm = "greedy"
flush_every = 256

[shuffle]
buffer = 32

[workers]
count = 0
"""


def write_data(work: str, args: argparse.Namespace) -> dict:
    """Two JSONL corpora (web, code; two shards each), a held-out set of both halves, and one
    zephon recipe per (recipe, data seed). No file name contains "val"/"test"/"eval" (Hugging Face
    ``datasets`` assigns splits from file names; TorchTitan's loader asks for "train")."""
    from zephon.tools.demo import TOKENIZER_DIR
    from zephon.tools.synth.text import generate_documents
    from zephon.tools.synth.writers import write_jsonl

    half = args.heldout // 2
    held: list[str] = []
    dirs = {}
    for k, style in enumerate(("web", "code")):
        docs = generate_documents(style, args.docs + half, seed=k)
        d = os.path.join(work, "corpus", "train", style)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        cut = args.docs // 2
        write_jsonl(os.path.join(d, f"{style}-0000.jsonl"), docs[:cut])
        write_jsonl(os.path.join(d, f"{style}-0001.jsonl"), docs[cut : args.docs])
        held.extend(docs[args.docs :])
        dirs[style] = d
    held_dir = os.path.join(work, "corpus", "heldout")
    shutil.rmtree(held_dir, ignore_errors=True)
    write_jsonl(os.path.join(held_dir, "heldout-0000.jsonl"), held)
    fmt = dict(seq_len=args.seq_len, gbs=args.global_batch_size, cache=os.path.join(work, "zcache"))
    fmt["tokenizer"] = TOKENIZER_DIR
    data = {"dirs": dirs, "val": os.path.join(work, "val.toml"), "recipes": {}}
    with open(data["val"], "w", encoding="utf-8") as f:
        f.write(gce.VAL_TOML.format(**fmt))
    for label, web in (("A", args.web_share[0]), ("B", args.web_share[1])):
        for seed in args.seeds:
            path = os.path.join(work, f"train_{label}_seed{seed}.toml")
            code = round(1.0 - web, 6)
            with open(path, "w", encoding="utf-8") as f:
                f.write(TRAIN_TOML.format(label=label, web=web, code=code, seed=seed, **fmt))
            data["recipes"][(label, seed)] = path
    data["weights"] = {"A": args.web_share[0], "B": args.web_share[1]}
    return data


def plan(args: argparse.Namespace) -> list[dict]:
    """The launches, the main grid first (so a cut-short run still has the effects)."""
    runs = []
    for W in args.world_sizes:
        for label in ("A", "B"):
            for loader in [] if args.bf16_only else args.loaders:
                if loader == "titan" and label not in args.titan_recipes:
                    continue
                runs.append(dict(loader=loader, recipe=label, W=W, seed=args.seeds[0], precision="float32"))
    for seed in [] if args.bf16_only else args.seeds[1:]:
        for loader in args.loaders:
            runs.append(dict(loader=loader, recipe="A", W=args.world_sizes[0], seed=seed, precision="float32"))
    if args.bf16 or args.bf16_only:
        for W in args.world_sizes:
            for label in ("A", "B"):
                runs.append(dict(loader="zephon", recipe=label, W=W, seed=args.seeds[0], precision="bfloat16"))
    for r in runs:
        r["name"] = f"{r['loader']}_{r['recipe']}_W{r['W']}_seed{r['seed']}" + (
            "_bf16" if r["precision"] == "bfloat16" else ""
        )
    return runs


def launch(runner: gce.Runner, data: dict, r: dict, steps: int, seed_ckpt: str) -> dict:
    recipe = data["recipes"][(r["recipe"], r["seed"])]
    web = data["weights"][r["recipe"]]
    env = {"EXP_TRAIN_RECIPE": recipe, "EXP_PRECISION": r["precision"]}
    if r["loader"] == "titan":
        sources = [[data["dirs"]["web"], web], [data["dirs"]["code"], round(1.0 - web, 6)]]
        env.update(EXP_TITAN_SOURCES=json.dumps(sources), EXP_TITAN_SEED=str(r["seed"]))
    config = "exp_titan_mix" if r["loader"] == "titan" else "exp_zephon"
    out = runner.torchrun(r["name"], r["W"], config, steps, seed_ckpt, env=env)
    dump = os.path.join(runner.work, "runs", r["name"]) if r["loader"] == "zephon" else None
    run = gce.read_run(out, r["W"], steps, dump)
    run.update({k: r[k] for k in ("loader", "recipe", "seed", "precision")})
    return run


def configuration(args: argparse.Namespace, data: dict, val_desc: str) -> dict:
    from importlib.metadata import version

    import torch

    return {
        "model": "TorchTitan llama3 debugmodel (dim 256, vocab 4096, SDPA attention on CPU)"
        + (f", first {args.layers} layers" if args.layers else ", 6 layers"),
        "precision": "fp32 (training.mixed_precision_param = float32)"
        + ("; zephon also in bf16 (--bf16)" if args.bf16 else ""),
        "optimizer": f"AdamW lr {args.lr}, weight decay 0.1, grad clip 1.0; warmup {args.warmup} steps, "
        "cosine decay over 80% of the run to 0.1x",
        "initial_weights": "seed checkpoint written on W=1 (--checkpoint.create_seed_checkpoint), loaded model-only",
        "recipes": {k: {"web": w, "code": round(1.0 - w, 6)} for k, w in data["weights"].items()},
        "data_seeds": args.seeds,
        "seq_len": args.seq_len,
        "global_batch_size": args.global_batch_size,
        "steps": args.steps,
        "validation_every": args.val_every,
        "validation_set": val_desc,
        "train_documents": {"web": args.docs, "code": args.docs},
        "corpus": "zephon.tools.synth generate_documents('web', seed 0) and ('code', seed 1), JSONL",
        "zephon": "8 lanes, token-deficit mixing, greedy packing, shuffle window 32; data seed = recipe seed",
        "titan": "InterleavedHuggingFaceTextDataLoader, sources = HuggingFaceTextDataLoader('c4_test', folder) "
        "per dataset with the recipe's weights; data seed = its interleaving seed",
        "world_sizes": args.world_sizes,
        "omp_threads": "cores / W" if args.threads == 0 else args.threads,
        "torch": torch.__version__,
        "torchtitan": version("torchtitan"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def run_all(args: argparse.Namespace, json_path: str) -> dict:
    """Every launch; the JSON is rewritten after each one (``"complete": false`` until the last)."""
    t_start = time.time()
    work = os.path.abspath(args.workdir)
    for sub in ("out", "logs"):
        shutil.rmtree(os.path.join(work, sub), ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    data = write_data(work, args)
    from zephon import Recipe
    from zephon.tools.cli import run_hashes

    val = Recipe.from_toml(data["val"])
    with val.global_loader(1) as g:
        end = g.end
        assert end is not None
        val_desc = (
            f"{args.heldout // 2} web + {args.heldout // 2} code held-out documents, {end.steps} steps x "
            f"{val.global_batch_size} rows (end = 'pad')"
        )
    gce_args = argparse.Namespace(**vars(args))
    train0 = data["recipes"][("A", args.seeds[0])]  # the seed checkpoint's recipe (its data is never used)
    runner = gce.Runner(work, {"train": train0, "val": data["val"], "train_dir": ""}, gce_args)
    res: dict = {
        "description": f"A mixture-weight ablation (web share {args.web_share[0]} vs {args.web_share[1]}, the rest code) "
        f"trained from scratch on W = {', '.join(map(str, args.world_sizes))} (CPU, gloo) with TorchTitan's "
        "InterleavedHuggingFaceTextDataLoader and with zephon, plus the data-seed noise floor. Regenerate: python scripts/ablation_experiment.py",
        "setup": configuration(args, data, val_desc),
        "runs": {},
        "complete": False,
    }
    if args.seed_checkpoint:
        seed_ckpt = os.path.abspath(args.seed_checkpoint)
    else:
        runner.torchrun("seed", 1, "exp_seed", 1, None, ["--checkpoint.create_seed_checkpoint"])
        seed_ckpt = os.path.join(work, "runs", "seed", "checkpoint", "step-0")
    res["zephon_hashes_ledger_digest"] = {
        label: run_hashes(
            Recipe.from_toml(data["recipes"][(label, args.seeds[0])]),
            steps=args.steps,
            digest="ledger",
            out=io.StringIO(),
        )
        for label in ("A", "B")
    }
    for r in plan(args):
        try:
            res["runs"][r["name"]] = launch(runner, data, r, args.steps, seed_ckpt)
        except SystemExit as e:  # a failed launch: bf16 is reported as not workable, anything else stops here
            if r["precision"] != "bfloat16":
                raise
            res.setdefault("bf16_failures", {})[r["name"]] = str(e)[-3000:]
        res["launches"], res["runtime_s"] = runner.launches, round(time.time() - t_start, 1)
        write_json(res, json_path)
    res["complete"] = True
    return res


def merge_bf16_check(res: dict, path: str) -> None:
    """Keep a separate (shorter) ``--bf16-only`` run's result beside the main one, as ``bf16_check``."""
    with open(path, encoding="utf-8") as f:
        check = json.load(f)
    keys = ("steps", "seq_len", "global_batch_size", "world_sizes", "precision", "validation_set", "train_documents")
    res["bf16_check"] = {
        "setup": {k: check["setup"][k] for k in keys},
        "runs": check["runs"],
        "launches": check.get("launches", []),
        "summary": summarize(check),
    }


def write_json(res: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    res["summary"] = summarize(res)
    res["readme_table"] = table(res)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    stamp_files(path)  # the commit, machine and command (kept on a --plot-only redraw)


# -- the numbers -------------------------------------------------------------------------------


def f32_steps(x: float, near: float) -> float:
    """``x`` in float32 steps (units in the last place) of a loss near ``near``."""
    import numpy as np

    return abs(x) / float(np.spacing(np.float32(abs(near))))


def framed(x: float, near: float) -> str:
    """A spread in words: "equal to the last bit" when it is 0 or a few float32 steps of the loss."""
    n = f32_steps(x, near)
    if n <= LAST_BIT_STEPS:
        return f"equal to the last bit ({n:.2g} float32 steps, {abs(x):.1e})" if n else "equal to the last bit (0)"
    return f"{x:.2e}"


def _grid(res: dict, variant: str) -> dict:
    loader, prec = ("zephon", "bfloat16") if variant == "zephon_bf16" else (variant, "float32")
    seed0 = res["setup"]["data_seeds"][0]
    grid: dict = {}
    for run in res["runs"].values():
        if run["loader"] == loader and run["precision"] == prec and run["seed"] == seed0:
            grid.setdefault(run["recipe"], {})[str(run["world_size"])] = run
    return grid


def summarize(res: dict) -> dict:
    out: dict = {}
    Ws = [str(W) for W in res["setup"]["world_sizes"]]
    for variant in ("titan", "zephon", "zephon_bf16"):
        grid = _grid(res, variant)
        labels = [label for label in ("A", "B") if all(W in grid.get(label, {}) for W in Ws)]
        if not labels:
            continue
        final = {label: {W: grid[label][W]["val_loss"][-1] for W in Ws} for label in labels}
        near = max(v for f in final.values() for v in f.values())
        gpu = {label: max(final[label].values()) - min(final[label].values()) for label in labels}
        s: dict = {
            "final_val_loss": final,
            "gpu_count_effect": gpu,
            "gpu_count_effect_f32_steps": {k: round(f32_steps(v, near), 2) for k, v in gpu.items()},
            "float32_step_of_the_loss": f32_steps(1.0, near) ** -1,
            "global_batches_identical_across_W": {
                label: all(
                    grid[label][W]["global_batch_sha256"] == grid[label][Ws[0]]["global_batch_sha256"] for W in Ws
                )
                for label in labels
            },
            "global_batches_equal_to_first_W": {
                label: {
                    W: sum(
                        a == b
                        for a, b in zip(
                            grid[label][W]["global_batch_sha256"], grid[label][Ws[0]]["global_batch_sha256"]
                        )
                    )
                    for W in Ws
                }
                for label in labels
            },
            "steps": len(grid[labels[0]][Ws[0]]["train_loss"]),
        }
        if len(labels) == 2:
            effect = {W: final["B"][W] - final["A"][W] for W in Ws}
            spread = max(effect.values()) - min(effect.values())
            s["ablation_effect_B_minus_A"] = effect
            s["ablation_effect_spread_over_W"] = spread
            s["ablation_effect_spread_f32_steps"] = round(f32_steps(spread, near), 2)
        if variant != "titan":
            exp = res.get("zephon_hashes_ledger_digest", {})
            s["ledger_equal_on_every_W_and_to_zephon_hashes"] = all(
                grid[label][W].get("ledger_digest") == exp.get(label) for label in labels for W in Ws
            )
        seeds = {
            str(run["seed"]): run["val_loss"][-1]
            for run in res["runs"].values()
            if run["loader"] == variant
            and run["recipe"] == "A"
            and run["precision"] == "float32"
            and str(run["world_size"]) == Ws[0]
        }
        if len(seeds) > 1:
            s["data_seed_final_val_loss"] = seeds
            s["data_seed_spread"] = max(seeds.values()) - min(seeds.values())
        out[variant] = s
    return out


def table(res: dict) -> str:
    s = summarize(res)
    Ws = [str(W) for W in res["setup"]["world_sizes"]]
    head = (
        "| loader | "
        + " | ".join(f"effect B − A, W={W}" for W in Ws)
        + f" | effect's spread over W | GPU-count effect (A; B) | data-seed spread ({len(res['setup']['data_seeds'])} seeds, A, W="
        + Ws[0]
        + ") |"
    )
    rows = [head, "|---" * (len(Ws) + 4) + "|"]
    variants = [(LOADER_NAMES[variant], s.get(variant, {})) for variant in ("titan", "zephon", "zephon_bf16")]
    check = res.get("bf16_check")
    if check and "zephon_bf16" not in s:
        st = check["setup"]
        name = (
            f"zephon, bf16 (a separate short run: {st['steps']} steps of {st['global_batch_size']} × {st['seq_len']})"
        )
        variants.append((name, check["summary"].get("zephon_bf16", {})))
    for name, v in variants:
        if "ablation_effect_B_minus_A" not in v or list(v["ablation_effect_B_minus_A"]) != Ws:
            continue
        near = max(x for f in v["final_val_loss"].values() for x in f.values())
        gpu = "; ".join(framed(v["gpu_count_effect"][k], near) for k in ("A", "B"))
        seed = f"{v['data_seed_spread']:.2e}" if "data_seed_spread" in v else "—"
        rows.append(
            f"| {name} | "
            + " | ".join(f"{v['ablation_effect_B_minus_A'][W]:+.5f}" for W in Ws)
            + f" | **{framed(v['ablation_effect_spread_over_W'], near)}** | {gpu} | {seed} |"
        )
    return "\n".join(rows)


# -- the figure --------------------------------------------------------------------------------


def plot(res: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarize(res)
    variants = [v for v in ("titan", "zephon", "zephon_bf16") if "ablation_effect_B_minus_A" in s.get(v, {})]
    Ws = [str(W) for W in res["setup"]["world_sizes"]]
    colors = {"1": "#1f77b4", "2": "#d62728", "4": "#2ca02c", "8": "#9467bd"}
    fig, axes = plt.subplots(
        2, len(variants), figsize=(6.4 * len(variants), 8.4), squeeze=False, gridspec_kw={"height_ratios": [3, 2.4]}
    )
    titles = {
        "titan": "TorchTitan's mixture loader\n(InterleavedHuggingFaceTextDataLoader)",
        "zephon": "zephon (fp32)",
        "zephon_bf16": "zephon (bf16)",
    }
    for col, variant in enumerate(variants):
        grid, v = _grid(res, variant), s[variant]
        ax, axf = axes[0, col], axes[1, col]
        for label, ls in (("A", "-"), ("B", "--")):
            for W in Ws:
                r = grid[label][W]
                ax.plot(
                    r["val_steps"][1:],
                    r["val_loss"][1:],
                    ls=ls,
                    marker="o",
                    ms=3.5,
                    lw=1.2,
                    color=colors.get(W),
                    label=f"recipe {label}, W={W}",
                )
        if all(v["global_batches_identical_across_W"].values()):
            ax.text(
                0.5,
                0.5,
                f"W = {', '.join(Ws)} coincide (the same global batches)",
                transform=ax.transAxes,
                ha="center",
                fontsize=9,
                color="0.3",
            )
        ax.set_title(titles[variant], fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (one fixed held-out set)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.25)
        # the final validation losses: A and B at each W, and recipe A's data seeds at the first W
        for x, label in ((0, "A"), (1, "B")):
            for j, W in enumerate(Ws):
                axf.plot(
                    x + 0.08 * (j - (len(Ws) - 1) / 2),
                    v["final_val_loss"][label][W],
                    "o",
                    ms=7,
                    color=colors.get(W),
                    label=f"W={W}" if x == 0 else None,
                )
        for seed, loss in v.get("data_seed_final_val_loss", {}).items():
            axf.plot(-0.35, loss, "s", ms=5, color="0.5", label="A, data seeds, W=" + Ws[0] if seed == "0" else None)
        near = max(x for f in v["final_val_loss"].values() for x in f.values())
        effects = ", ".join(f"W={W}: {v['ablation_effect_B_minus_A'][W]:+.4f}" for W in Ws)
        seed_txt = f"\ndata-seed spread {v['data_seed_spread']:.2e}" if "data_seed_spread" in v else ""
        axf.set_title(
            f"effect B − A: {effects}\nits spread over W: {framed(v['ablation_effect_spread_over_W'], near)}{seed_txt}",
            fontsize=9,
        )
        rec = res["setup"]["recipes"]
        axf.set_xticks([0, 1], [f"recipe {k}\nweb {rec[k]['web']} / code {rec[k]['code']}" for k in ("A", "B")])
        axf.set_xlim(-0.6, 1.4)
        axf.set_ylabel("final validation loss")
        axf.grid(alpha=0.25)
        axf.legend(fontsize=8, loc="best")
    st = res["setup"]
    fig.suptitle(
        f"One mixture weight changed, trained on W = {', '.join(Ws)}: TorchTitan llama3 debug model "
        f"({st['model'].split('), ')[-1]}), CPU, {st['steps']} steps of {st['global_batch_size']} × {st['seq_len']} tokens",
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


def report(res: dict) -> None:
    s = summarize(res)
    print()
    print(table(res))
    print()
    for variant, v in s.items():
        near = max(x for f in v["final_val_loss"].values() for x in f.values())
        if "ablation_effect_B_minus_A" in v:
            eff = ", ".join(f"W={W}: {x:+.6f}" for W, x in v["ablation_effect_B_minus_A"].items())
            print(f"{variant}: ablation effect B - A {eff}; over W: {framed(v['ablation_effect_spread_over_W'], near)}")
        gpu_txt = ", ".join(f"{k} {framed(x, near)}" for k, x in v["gpu_count_effect"].items())
        print(
            f"{variant}: GPU-count effect {gpu_txt}; global batches identical across W: "
            f"{v['global_batches_identical_across_W']}"
        )
        if "data_seed_spread" in v:
            gpu = max(v["gpu_count_effect"].values())
            print(
                f"    data-seed spread {v['data_seed_spread']:.3e} ({v['data_seed_final_val_loss']}); "
                f"GPU-count effect / data-seed spread = {gpu / v['data_seed_spread']:.2f}"
                if f32_steps(gpu, near) > LAST_BIT_STEPS
                else f"    data-seed spread {v['data_seed_spread']:.3e}; the GPU-count effect is equal to the last bit"
            )
        if "ledger_equal_on_every_W_and_to_zephon_hashes" in v:
            print(
                f"    ledger equal on every W and to `zephon hashes`: {v['ledger_equal_on_every_W_and_to_zephon_hashes']}"
            )
    if "bf16_check" in res:
        v = res["bf16_check"]["summary"].get("zephon_bf16", {})
        if "ablation_effect_B_minus_A" in v:
            near = max(x for f in v["final_val_loss"].values() for x in f.values())
            eff = ", ".join(f"W={W}: {x:+.6f}" for W, x in v["ablation_effect_B_minus_A"].items())
            print(f"bf16 check: effect {eff}; over W: {framed(v['ablation_effect_spread_over_W'], near)}")
    print(f"runtime {res.get('runtime_s', 0):.0f} s; complete: {res.get('complete')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--loaders", nargs="+", default=["zephon", "titan"], choices=["zephon", "titan"])
    p.add_argument("--web-share", type=float, nargs=2, default=[0.7, 0.3], help="web's token share in A and in B")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="data seeds; the first is the main grid's")
    p.add_argument("--titan-recipes", nargs="+", default=["A", "B"], choices=["A", "B"], help="(the test: A only)")
    p.add_argument("--bf16", action="store_true", help="also run zephon's A and B at every W in bf16")
    p.add_argument("--bf16-only", action="store_true", help="only zephon's bf16 runs (a quick check)")
    p.add_argument("--bf16-check", default=None, help="with --plot-only: add a --bf16-only run's JSON as bf16_check")
    p.add_argument("--note", default=None, help="with --plot-only: record a note in the JSON (how the run ended)")
    p.add_argument("--val-every", type=int, default=15, help="validation at step 1 and every N steps")
    p.add_argument("--heldout", type=int, default=40, help="held-out documents (half web, half code)")
    p.add_argument("--docs", type=int, default=600, help="training documents per dataset")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2, help="keep only the first N transformer layers (0 = all 6)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank (0 = cores / W)")
    p.add_argument("--workdir", default=os.path.join(ROOT, "build", "ablation"))
    p.add_argument("--json", default=os.path.join(ROOT, "docs", "img", "ablation.json"))
    p.add_argument("--png", default=os.path.join(ROOT, "docs", "img", "ablation.png"))
    p.add_argument("--readme", action="store_true", help="rewrite the table in docs/experiments.md")
    p.add_argument("--plot-only", action="store_true", help="redraw from the JSON")
    p.add_argument("--no-plot", action="store_true", help="write the JSON only (the test tier)")
    p.add_argument("--seed-checkpoint", default=None, help="a step-0 folder from an earlier run with the same --layers")
    args = p.parse_args()
    if args.plot_only:
        with open(args.json, encoding="utf-8") as f:
            res = json.load(f)
        if args.bf16_check or args.note:
            if args.bf16_check:
                merge_bf16_check(res, args.bf16_check)
            if args.note:
                res["note"] = args.note
            write_json(res, args.json)
    else:
        for W in args.world_sizes:
            if 8 % W or args.global_batch_size % W:
                raise SystemExit(f"W={W} must divide the 8 lanes and the global batch ({args.global_batch_size})")
        res = run_all(args, args.json)
        write_json(res, args.json)
    if not args.no_plot:
        plot(res, args.png)
    report(res)
    if args.readme:
        update_readme(res, os.path.join(ROOT, "docs", "experiments.md"))
        print("updated the table in docs/experiments.md")


if __name__ == "__main__":
    main()
