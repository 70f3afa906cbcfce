#!/usr/bin/env python
"""Scaling with workers: text tokens/s and vision images/s at 1, 2, 4, 8 and 16 workers, thread and
process workers, zephon and Grain on the same work, in at most 8 minutes.

    python benchmarks/scale.py                       # the 16-core measurement (default: 1,2,4,8,16 workers)
    python benchmarks/scale.py --workers 1,2 --tag 2core_test   # a quick run on a small machine

Writes ``benchmarks/results/scale_<tag>.{md,json,png}`` (tag: ``<cores>core`` by default). The
work is the benchmark's (``benchmarks/text_contenders.py``, ``benchmarks/vision_contenders.py``):
text = read JSONL, tokenize, pack greedily into rows of 2048, shuffle, batches of 8 rows; vision =
read tar shards, decode, resize, normalise, patchify, tokenize captions, pack, batches of 4 rows.
"Processes" means zephon's ``WorkerConfig(N, "process")`` (results through shared memory) and
Grain's ``mp_prefetch(num_workers=N)``; "threads" zephon's thread workers and Grain's
``ReadOptions(num_threads=N)``.

Every measurement runs in a fresh process: build the loader, take the first batch, run
``--warmup-s`` seconds untimed, then count what is delivered in ``--timed-s`` seconds (whole
batches), with the CPU time of the process tree when psutil is there. The plan is sized to the
budget (``--budget-s``, default 480 s): the timed span shrinks when there are many measurements,
and measurements that no longer fit are listed as not run. A contender whose modules are missing
is skipped and the table says why; the machine this is written for may have torch but none of
torchdata (zephon needs it), grain or the rest: see benchmarks/README.md ("Scaling to 16 cores")
for the wheels to carry and how to install them there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import machine, versions  # noqa: E402  (stdlib only: runs where zephon's dependencies are missing)
from benchmarks.stamp import stamp_files  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORKERS = [1, 2, 4, 8, 16]
HALVES = ["text", "vision"]
CONTENDERS = ["zephon", "grain"]
BACKENDS = ["thread", "process"]
#: what each contender imports, and what a half needs besides
NEEDS = {
    "zephon": ["numpy", "torch", "torchdata", "tokenizers", "fsspec", "zstandard", "tqdm"],
    "grain": ["numpy", "grain", "tokenizers"],
}
#: the vision work of both contenders is zephon's image function (so the ratios compare loaders)
HALF_NEEDS = {"text": [], "vision": ["PIL"]}
CONTENDER_HALF_NEEDS = {("grain", "vision"): ["torchdata"]}
LABELS = {"zephon": "zephon", "grain": "Grain"}
UNIT = {"text": "tokens/s", "vision": "images/s"}


# =========================================================================== environment
def missing(mods: list[str]) -> list[str]:
    """The modules of ``mods`` that cannot be imported here."""
    out = []
    for m in mods:
        try:
            if importlib.util.find_spec(m) is None:
                out.append(m)
        except (ImportError, ValueError):
            out.append(m)
    return out


def ensure_zephon_nodes() -> str | None:
    """``zephon.nodes`` is the repository's ``nodes/`` folder (pyproject's package-dir). In a
    plain checkout that was never pip-installed, make it importable with the link an editable
    install would make (``zephon/nodes -> ../nodes``, git-ignored). Returns what was done."""
    link = os.path.join(ROOT, "zephon", "nodes")
    if os.path.exists(link) or not os.path.isdir(os.path.join(ROOT, "nodes")):
        return None
    try:
        if importlib.util.find_spec("zephon.nodes") is not None:
            return None
    except ImportError:
        pass
    try:
        os.symlink(os.path.join("..", "nodes"), link)
    except OSError as e:
        return f"could not link zephon/nodes -> ../nodes ({e}); run `pip install --no-deps -e .`"
    return "linked zephon/nodes -> ../nodes (a checkout that was not pip-installed)"


def scale_versions() -> dict[str, str]:
    """The versions this script's results depend on (torchtitan is not among them)."""
    return versions(("torch", "torchdata", "grain", "tokenizers", "numpy", "pillow", "psutil", "matplotlib"))


# =========================================================================== worker side
def _tree_cpu() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _build(spec: dict[str, Any]):
    half, c, backend, n = spec["half"], spec["contender"], spec["backend"], spec["workers"]
    if half == "text":
        from benchmarks import text_contenders as tc

        s = tc.Settings.from_dict(spec["settings"])
        if c == "zephon":
            return tc.build_zephon(s, n, backend=backend)
        return tc.build_grain_threads(s, n) if backend == "thread" else tc.build_grain_mp(s, n)
    from benchmarks import vision_contenders as vc

    s = vc.VSettings.from_dict(spec["settings"])
    if c == "zephon":
        return vc.build_zephon(s, n, backend=backend)
    return vc.build_grain_threads(s, n) if backend == "thread" else vc.build_grain_mp(s, n)


def _units(half: str, batch: Any) -> int:
    if half == "text":
        from benchmarks.text_contenders import rows_of

        rows, seq = rows_of(batch).shape
        return rows * seq
    from benchmarks.vision_contenders import batch_stats

    return batch_stats(batch)[2]


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One timed run (in this process): first batch, warm-up, then units delivered in timed_s."""
    t0 = time.perf_counter()
    built = _build(spec)
    try:
        next(built.it)
        ttfb = time.perf_counter() - t0
        end = time.perf_counter() + spec["warmup_s"]
        while time.perf_counter() < end:
            next(built.it)
        c1, t1 = _tree_cpu(), time.perf_counter()
        units = batches = 0
        while time.perf_counter() - t1 < spec["timed_s"] or batches < spec.get("min_batches", 2):
            units += _units(spec["half"], next(built.it))
            batches += 1
        dt, c2 = time.perf_counter() - t1, _tree_cpu()
    finally:
        built.close()
    cpu = (c2 - c1) if c1 is not None and c2 is not None else None
    return {
        "ttfb_s": ttfb,
        "seconds": dt,
        "batches": batches,
        "units": units,
        "per_s": units / dt,
        "cpu_per_unit": cpu / units if cpu is not None and units else None,
        "cpu_cores_busy": cpu / dt if cpu is not None else None,
        "loadavg_1m": os.getloadavg()[0],
    }


def worker_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    try:
        out = {"ok": True, "result": measure(spec)}
    except Exception as e:  # reported in the table, not fatal for the run
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(spec["out"], "w") as f:
        json.dump(out, f)


# =========================================================================== orchestrator
def settings_for(half: str, size: str) -> dict[str, Any]:
    from benchmarks.corpus import DATA, TOKENIZER_DIR

    if half == "text":
        from benchmarks.corpus import text_corpus

        c = text_corpus(size)
        return {
            "files": c["files"],
            "glob": c["glob"],
            "corpus_dir": c["dir"],
            "cache_dir": os.path.join(DATA, "cache"),
            "tokenizer_dir": TOKENIZER_DIR,
            "seq_len": 2048,
            "batch_rows": 8,
            "lanes": 8,
            "shuffle_rows": 64 if size != "smoke" else 8,
        }
    from benchmarks.corpus import vision_corpus, vl_tokenizer
    from benchmarks.vision_contenders import VSettings

    c = vision_corpus(size)
    return VSettings(
        files=c["files"],
        glob=c["glob"],
        corpus_dir=c["dir"],
        cache_dir=os.path.join(DATA, "cache"),
        tokenizer_dir=vl_tokenizer(),
        seq_len=2048 if size != "smoke" else 512,
    ).to_dict()


def call(spec: dict[str, Any], tmp: str, n: int, timeout: float, inprocess: bool) -> dict[str, Any]:
    spec = dict(spec, out=os.path.join(tmp, f"m{n}.json"))
    if inprocess:
        worker_main(json.dumps(spec))
    else:
        try:
            p = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
        if not os.path.exists(spec["out"]):
            return {"ok": False, "error": f"exited with {p.returncode}: {(p.stderr or '')[-800:]}"}
    with open(spec["out"]) as f:
        return json.load(f)


def run(args: argparse.Namespace, log) -> str:
    start = machine()  # the load average before the first measurement
    started = time.monotonic()
    deadline = started + args.budget_s
    notes = [n for n in [ensure_zephon_nodes()] if n]
    workers = [int(x) for x in args.workers.split(",")]
    halves, contenders, backends = args.halves.split(","), args.contenders.split(","), args.backends.split(",")
    skipped: dict[str, str] = {}
    for c in contenders:
        why = missing(NEEDS[c])
        if why:
            skipped[c] = f"not installed here: {', '.join(why)}"
    half_skip: dict[str, str] = {}
    for h in halves:
        why = missing(HALF_NEEDS[h] + ["numpy", "tokenizers"])
        if why:
            half_skip[h] = f"not installed here: {', '.join(why)}"
    for k, v in {**skipped, **half_skip}.items():
        log(f"skipping {k}: {v}")
    live_c = [c for c in contenders if c not in skipped]
    live_h = [h for h in halves if h not in half_skip]
    pair_skip: dict[str, str] = {}
    for (c, h), mods in CONTENDER_HALF_NEEDS.items():
        why = missing(mods)
        if why and c in live_c and h in live_h:
            pair_skip[f"{c}/{h}"] = (
                f"not installed here: {', '.join(why)} (its per-image map is zephon's image function, as in "
                "benchmarks/vision_contenders.py, and zephon needs it)"
            )
            log(f"skipping {c} on {h}: {pair_skip[f'{c}/{h}']}")
    plan = [
        (h, c, b, n) for h in live_h for n in workers for c in live_c for b in backends if f"{c}/{h}" not in pair_skip
    ]
    log(f"{len(plan)} measurements planned within {args.budget_s:.0f} s")
    settings = {}
    for h in live_h:
        log(f"corpus: {h} ({args.size}) ...")
        settings[h] = settings_for(h, args.size)
    # the timed span from what is left of the budget: start-up measured as we go (first guess 8 s)
    overhead = 8.0 if args.size != "smoke" else 3.0
    tmp = tempfile.mkdtemp(prefix="zephon-scale-")
    results: list[dict[str, Any]] = []
    for i, (h, c, b, n) in enumerate(plan):
        left = deadline - time.monotonic()
        per = left / (len(plan) - i)
        timed = args.timed_s or max(0.5, min(10.0, per - overhead - args.warmup_s))
        if per < overhead + 0.5 and not args.timed_s:
            results.append({"half": h, "contender": c, "backend": b, "workers": n, "error": "not run: budget used up"})
            continue
        log(f"  {h} {c} {b} x{n}: timed {timed:.1f} s ...")
        t = time.monotonic()
        spec = {
            "half": h,
            "contender": c,
            "backend": b,
            "workers": n,
            "warmup_s": args.warmup_s,
            "timed_s": timed,
            "settings": settings[h],
        }
        res = call(spec, tmp, i, timeout=max(60.0, 6 * timed + 60), inprocess=args.inprocess)
        spent = time.monotonic() - t
        overhead = 0.5 * overhead + 0.5 * max(0.0, spent - timed - args.warmup_s)
        row = {"half": h, "contender": c, "backend": b, "workers": n, "wall_s": spent}
        if res["ok"]:
            row.update(res["result"])
            log(f"    {row['per_s']:.1f} {UNIT[h]}, first batch {row['ttfb_s']:.1f} s")
        else:
            row["error"] = res["error"]
            log(f"    ! {res['error'][:300]}")
        results.append(row)
    data = {
        "args": vars(args),
        "machine": dict(start, loadavg_end=os.getloadavg()),
        "versions": scale_versions(),
        "skipped": skipped,
        "half_skipped": half_skip,
        "pair_skipped": pair_skip,
        "notes": notes,
        "workers": workers,
        "results": results,
        "wall_s": time.monotonic() - started,
    }
    out = args.out or os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    tag = args.tag or f"{os.cpu_count()}core"
    stem = os.path.join(out, f"scale_{tag}")
    md = write_report(data, stem)
    log(f"done in {data['wall_s']:.0f} s: {md}")
    return md


# =========================================================================== report
def write_report(data: dict[str, Any], stem: str) -> str:
    m, a = data["machine"], data["args"]
    workers = data["workers"]
    L = [f"# zephon scaling with workers: `{os.path.basename(stem)}`\n"]
    L.append(
        f"Produced by `python benchmarks/scale.py --workers {a['workers']} --size {a['size']} --budget-s "
        f"{a['budget_s']:.0f}` in {data['wall_s']:.0f} s on {m['cpu']}, {m['cores']} cores (affinity "
        f"{m['affinity']}); load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at the end "
        f"{', '.join(f'{x:.2f}' for x in m['loadavg_end'])}.\n"
    )
    L.append("Versions: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items()) + "\n")
    L.append(
        "Each cell: one run in a fresh process, median-free (one measurement per cell: on a quiet machine "
        "the run-to-run spread of this harness is about ±5%; on a shared one much more; the CPU column is "
        "steadier). Units per second delivered to a consumer that does nothing over the timed span, after "
        "the first batch and a warm-up; in parentheses the speed-up over 1 worker of the same kind.\n"
    )
    for k, v in {**data["skipped"], **data["half_skipped"], **data.get("pair_skipped", {})}.items():
        L.append(f"- **skipped {k}**: {v}")
    for n in data["notes"]:
        L.append(f"- note: {n}")
    L.append("")
    rows: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for r in data["results"]:
        rows.setdefault((r["half"], r["contender"], r["backend"]), {})[r["workers"]] = r
    for half in a["halves"].split(","):
        L.append(f"## {half}: {UNIT[half]}\n")
        if half in data["half_skipped"]:
            L.append(f"(skipped: {data['half_skipped'][half]})\n")
            continue
        L.append("| contender | workers | " + " | ".join(f"{n}" for n in workers) + " |")
        L.append("|---|---|" + "---|" * len(workers))
        cpu_lines = []
        for c in a["contenders"].split(","):
            for b in a["backends"].split(","):
                label = f"{LABELS[c]} | {b} workers"
                if c in data["skipped"] or f"{c}/{half}" in data.get("pair_skipped", {}):
                    L.append(f"| {label} | " + " | ".join(["skipped"] * len(workers)) + " |")
                    continue
                cells = rows.get((half, c, b), {})
                one = (cells.get(workers[0]) or {}).get("per_s")
                out, cpu = [], []
                for n in workers:
                    r = cells.get(n)
                    if r is None or "error" in r:
                        out.append("not run" if r is None or "budget" in r.get("error", "") else "error")
                        cpu.append("-")
                        continue
                    v = r["per_s"]
                    fmt = f"{v / 1e6:.2f} M" if half == "text" else f"{v:.0f}"
                    out.append(fmt + (f" ({v / one:.1f}x)" if one and n != workers[0] else ""))
                    cu = r.get("cpu_per_unit")
                    cpu.append("-" if cu is None else (f"{cu * 1e6:.2f}" if half == "text" else f"{cu * 1e3:.1f}"))
                L.append(f"| {label} | " + " | ".join(out) + " |")
                cpu_lines.append(f"| {label} | " + " | ".join(cpu) + " |")
        L.append("")
        L.append(f"CPU of the process tree per unit ({'s per M tokens' if half == 'text' else 'ms per image'}):\n")
        L.append("| contender | workers | " + " | ".join(f"{n}" for n in workers) + " |")
        L.append("|---|---|" + "---|" * len(workers))
        L.extend(cpu_lines)
        L.append("")
    errors = [r for r in data["results"] if "error" in r and "budget" not in r["error"]]
    for r in errors:
        L.append(f"- error: {r['half']} {r['contender']} {r['backend']} x{r['workers']}: `{r['error'][:300]}`")
    md = stem + ".md"
    with open(md, "w") as f:
        f.write("\n".join(L) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1, default=str)
    stamp_files(stem + ".json", md)
    try:
        plot(data, stem + ".png")
    except ImportError as e:
        with open(md, "a") as f:
            f.write(f"\n(no plot: {e}; pip install matplotlib)\n")
    return md


def plot(data: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = data["args"]
    halves = a["halves"].split(",")
    fig, axs = plt.subplots(1, len(halves), figsize=(7 * len(halves), 5), squeeze=False)
    for ax, half in zip(axs[0], halves):
        for c in a["contenders"].split(","):
            for b in a["backends"].split(","):
                pts = [
                    (r["workers"], r["per_s"])
                    for r in data["results"]
                    if r["half"] == half and r["contender"] == c and r["backend"] == b and "per_s" in r
                ]
                if pts:
                    xs, ys = zip(*sorted(pts))
                    scale = 1e6 if half == "text" else 1.0
                    ax.plot(
                        xs,
                        [y / scale for y in ys],
                        marker="o",
                        ls="-" if b == "process" else "--",
                        label=f"{LABELS[c]}, {b} workers",
                    )
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["workers"], [str(n) for n in data["workers"]])
        ax.set_xlabel("workers")
        ax.set_ylabel("M tokens/s" if half == "text" else "images/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{half}: {UNIT[half]} vs workers")
        ax.legend()
    fig.suptitle(f"zephon and Grain with 1-{max(data['workers'])} workers; {data['machine']['cores']} cores")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default=",".join(map(str, WORKERS)))
    ap.add_argument("--halves", default=",".join(HALVES))
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--size", choices=["smoke", "small"], default="small", help="corpus size (benchmarks/corpus.py)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget for the whole run")
    ap.add_argument("--timed-s", type=float, default=None, help="timed span per run (default: from the budget)")
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--tag", default=None, help="results file name: scale_<tag> (default <cores>core)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--inprocess", action="store_true", help="measure in this process (tests)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(a.worker)
        return 0
    for name, value, allowed in (
        ("--halves", a.halves, HALVES),
        ("--contenders", a.contenders, CONTENDERS),
        ("--backends", a.backends, BACKENDS),
    ):
        bad = [x for x in value.split(",") if x not in allowed]
        if bad:
            ap.error(f"{name}: unknown {bad}; choose from {allowed}")
    run(a, lambda msg: print(msg, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
