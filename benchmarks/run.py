#!/usr/bin/env python
"""zephon benchmarks: one command, side by side, on the same data.

    python benchmarks/run.py [--size smoke|small|full] [--only text|vision|all] [--rounds N] [--no-profile]

Text half (below) and vision half (benchmarks/run_vision.py: image-text tar shards; zephon, Grain,
TorchTitan's MMDataLoader, the decode-only limit; writes vision_<size>.{md,png,json}).

Generates the corpus deterministically under benchmarks/.data/, runs every installed contender
(zephon, Grain with threads and with mp_prefetch, torchdata.nodes, TorchTitan's
HuggingFaceTextDataLoader) and the tokenizer-only limit at 1 and 2 threads, in rounds that
alternate the order (A B C ... then ... C B A) so that machine noise cancels in the per-round
ratios; then zephon's restore time vs step, checkpoint size, lanes-per-rank scaling, consumer wait
behind a fake training step, and a py-spy profile. Writes benchmarks/results/text_<size>.md and
text_<size>.png (and text_<size>.json with every raw measurement).

Each measurement runs in a fresh Python process (clean peak RSS, no leftover threads), except at
``--size smoke``, which runs in-process to stay fast (used by tests/system/test_benchmarks_smoke.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import HERE, RssSampler, Runner, available_mod, machine, versions  # noqa: E402

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(HERE, ".data", "hf_cache"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# size -> plan. steps: batches timed after the first (a multiple of every shuffle window, so the
# timed span holds whole windows of work for every contender)
PLANS: dict[str, dict[str, Any]] = {
    "smoke": {
        "rounds": 1,
        "threads": [1],
        "steps": 8,
        "warmup": 0,
        "lanes_warmup": 0,
        "shuffle_rows": 8,
        "restore_steps": [2, 10],
        "restore_repeats": 1,
        "lanes": [8, 16],
        "lanes_batch": 16,
        "lanes_steps": 2,
        "lanes_rounds": 1,
        "lanes_big": {"lanes": 32, "batch": 32, "steps": 1, "warmup": 0},
        "wait_steps": 10,
        "wait_ms": 20,
        "profile": False,
        "titan_extra": False,
        "bracket": False,
    },
    "small": {
        "rounds": 3,
        "threads": [1, 2],
        "steps": 256,
        "warmup": 64,
        "lanes_warmup": 16,
        "shuffle_rows": 64,
        "restore_steps": [10, 1000, 10000],
        "restore_repeats": 3,
        "lanes": [8, 64, 256],
        "lanes_batch": 256,
        "lanes_steps": 64,
        "lanes_rounds": 3,
        "lanes_threads": [2],
        "lanes_big": {"lanes": 1024, "batch": 1024, "steps": 8, "warmup": 2},
        "wait_steps": 160,
        "wait_ms": 50,
        "profile": True,
        "titan_extra": True,
    },
    "full": {
        "rounds": 3,
        "threads": [1, 2],
        "steps": 256,
        "warmup": 128,
        "lanes_warmup": 16,
        "shuffle_rows": 64,
        "restore_steps": [10, 1000, 10000],
        "restore_repeats": 3,
        "lanes": [8, 64, 256],
        "lanes_batch": 256,
        "lanes_steps": 64,
        "lanes_rounds": 3,
        "lanes_big": {"lanes": 1024, "batch": 1024, "steps": 16, "warmup": 2},
        "wait_steps": 320,
        "wait_ms": 50,
        "profile": True,
        "titan_extra": True,
    },
}
LANES_SHUFFLE_ROWS = 8  # per-lane window in the lanes-per-rank sweep (256 lanes x 64 rows would be 1 GB)

CONTENDERS = ["zephon", "zephon_proc", "grain_threads", "grain_mp", "torchdata", "titan"]
NEEDS = {
    "zephon_proc": "zephon",
    "grain_threads": "grain",
    "grain_mp": "grain",
    "torchdata": "torchdata.nodes",
    "titan": "torchtitan",
    "titan_nw2": "torchtitan",
    "zephon": "zephon",
}


# =========================================================================== worker side
def _settings(spec: dict[str, Any]):
    from benchmarks.text_contenders import Settings

    return Settings.from_dict(spec["settings"])


def _build(name: str, s, threads: int, **kw):
    from benchmarks import text_contenders as tc

    if name == "zephon":
        return tc.build_zephon(s, threads, **kw)
    if name == "zephon_proc":
        return tc.build_zephon(s, threads, backend="process", **kw)
    if name == "zephon_proc_noshm":
        return tc.build_zephon(s, threads, backend="process", shm_mb=0, **kw)
    if name == "grain_threads":
        return tc.build_grain_threads(s, threads)
    if name == "grain_mp":
        return tc.build_grain_mp(s, threads)
    if name == "torchdata":
        return tc.build_torchdata(s, threads)
    if name == "titan":  # 1 "thread" = the main process alone; 2 = main + 1 worker process
        return tc.build_titan(s, threads - 1)
    if name == "titan_nw2":
        return tc.build_titan(s, 2)
    raise ValueError(name)


def _labels_of(batch: Any):
    if isinstance(batch, (list, tuple)):
        return batch[1]
    return batch.get("labels")


def w_throughput(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from benchmarks.text_contenders import rows_of

    s = _settings(spec)
    name, threads, steps = spec["contender"], spec["threads"], spec["steps"]
    kw = spec.get("build_kw", {})
    with RssSampler() as mem:
        t0 = time.perf_counter()
        built = _build(name, s, threads, **kw)
        b = next(built.it)
        ttfb = time.perf_counter() - t0
        for _ in range(spec.get("warmup", 0)):  # reach steady state: prefetch leads built during the
            b = next(built.it)  # first batch are used up before timing starts
        t1 = time.perf_counter()
        c1 = mem.cpu_s()
        x = rows_of(b)
        rows, seq = x.shape
        pad = n = 0
        for _ in range(steps):
            b = next(built.it)
            lab = _labels_of(b)
            if lab is not None:
                lab = np.asarray(lab)
                pad += int(np.count_nonzero(lab == -100))
                n += lab.size
        t2 = time.perf_counter()
        c2 = mem.cpu_s()
        state = built.state_bytes()
        pools = [m for r in built.loader.routers for m in r.pools.metrics()] if built.loader is not None else []
        built.close()
    assert seq == s.seq_len, (name, x.shape)
    return {
        "contender": name,
        "threads": threads,
        "ttfb_s": ttfb,
        "seconds": t2 - t1,
        "steps": steps,
        "warmup": spec.get("warmup", 0),
        "rows": rows,
        "tokens": steps * rows * seq,
        "tokens_per_s": steps * rows * seq / (t2 - t1),
        "pad_frac": pad / n if n else None,
        "peak_rss_mb": mem.peak / 2**20,
        "state": state,
        "cpu_s_per_mtok": (c2 - c1) / (steps * rows * seq / 1e6),
        "notes": built.notes,
        "kw": kw,
        "pools": pools,
    }


def w_limit(spec: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.text_contenders import limit_tokens_per_s

    s = _settings(spec)
    with RssSampler() as mem:
        r = limit_tokens_per_s(s, spec["threads"], spec["tokens"], cpu=mem.cpu_s)
    r.update({"contender": "limit", "threads": spec["threads"], "peak_rss_mb": mem.peak / 2**20})
    return r


def _sha(batch: Any) -> str:
    from zephon import batch_sha256

    return batch_sha256(batch)


def w_restore(spec: dict[str, Any]) -> dict[str, Any]:
    """zephon: advance to each target step, snapshot, keep the next batch as reference; then
    restore each snapshot into a fresh loader and time load_state_dict + the first batch."""
    from benchmarks.text_contenders import zephon_recipe
    from zephon import WorkerConfig

    s = _settings(spec)
    wc = WorkerConfig(spec["threads"], "thread")
    r = zephon_recipe(s)
    r.prepare()
    snaps = []
    t0 = time.perf_counter()
    with r.global_loader(world_size=1, workers=wc) as g:
        next(g)
        fresh_first = time.perf_counter() - t0
        step = 1
        for target in spec["targets"]:
            while step < target:
                next(g)
                step += 1
            st = g.state_dict()
            ref = _sha(next(g))
            step += 1
            lanes = {k: len(json.dumps(v).encode()) for k, v in st.items() if k.startswith("lane_")}
            snaps.append((target, json.loads(json.dumps(st)), ref, lanes, len(json.dumps(st).encode())))
    advance_s = time.perf_counter() - t0
    out = []
    for target, st, ref, lanes, total in snaps:
        loads, firsts, ok = [], [], True
        for _ in range(spec["repeats"]):
            g2 = r.global_loader(world_size=1, workers=wc)
            a = time.perf_counter()
            g2.load_state_dict(st)
            b = time.perf_counter()
            got = _sha(next(g2))
            c = time.perf_counter()
            g2.close()
            loads.append(b - a)
            firsts.append(c - b)
            ok = ok and got == ref
        out.append(
            {
                "step": target,
                "load_s": statistics.median(loads),
                "first_batch_s": statistics.median(firsts),
                "restore_s": statistics.median([l + f for l, f in zip(loads, firsts)]),
                "identical": ok,
                "max_lane_bytes": max(lanes.values()),
                "mean_lane_bytes": sum(lanes.values()) / len(lanes),
                "rank_bytes": total,
                "lanes": len(lanes),
            }
        )
    return {"threads": spec["threads"], "fresh_first_batch_s": fresh_first, "advance_s": advance_s, "points": out}


def w_wait(spec: dict[str, Any]) -> dict[str, Any]:
    """Consumer wait per step behind a fake training step of ``ms`` (a sleep: the host thread idles
    while the accelerator computes, as in a GPU-bound step)."""
    s = _settings(spec)
    built = _build(spec["contender"], s, spec["threads"])
    next(built.it)
    time.sleep(spec["ms"] / 1000 * 4)  # the first step's work
    waits = []
    for _ in range(spec["steps"]):
        a = time.perf_counter()
        next(built.it)
        waits.append(time.perf_counter() - a)
        time.sleep(spec["ms"] / 1000)
    built.close()
    return {"contender": spec["contender"], "threads": spec["threads"], "ms": spec["ms"], "waits": waits}


def _tree_rss_mb() -> float:
    import psutil

    me = psutil.Process()
    total = me.memory_info().rss
    for c in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += c.memory_info().rss
    return total / 2**20


def w_lanes(spec: dict[str, Any]) -> dict[str, Any]:
    """zephon with ``lanes`` lanes on one rank: time to the first batch (lanes primed and pulled
    on a few threads), timed throughput and CPU, resident memory in steady state, then a restore
    (load_state_dict + first batch into a fresh loader) checked byte for byte."""
    from benchmarks.text_contenders import build_zephon

    s = _settings(spec)
    threads, lanes = spec["threads"], spec["lanes"]
    kw = {"lanes": lanes, "global_batch": spec["batch"], "shuffle_rows": LANES_SHUFFLE_ROWS}
    rss_before = _tree_rss_mb()
    with RssSampler() as mem:
        t0 = time.perf_counter()
        built = build_zephon(s, threads, **kw)
        b = next(built.it)
        ttfb = time.perf_counter() - t0
        for _ in range(spec["warmup"]):
            next(built.it)
        c1, t1 = mem.cpu_s(), time.perf_counter()
        for _ in range(spec["steps"]):
            b = next(built.it)
        t2, c2 = time.perf_counter(), mem.cpu_s()
        rss_steady = _tree_rss_mb()
        state = built.loader.state_dict()
        ref = _sha(next(built.it))
        state_bytes = built.state_bytes()
        built.close()
        again = build_zephon(s, threads, **kw)
        t3 = time.perf_counter()
        again.loader.load_state_dict(json.loads(json.dumps(state)))
        t4 = time.perf_counter()
        got = _sha(next(again.it))
        t5 = time.perf_counter()
        again.close()
    rows, seq = b["input"].shape
    tokens = spec["steps"] * rows * seq
    return {
        "lanes": lanes,
        "threads": threads,
        "batch": rows,
        "ttfb_s": ttfb,
        "steps": spec["steps"],
        "warmup": spec["warmup"],
        "seconds": t2 - t1,
        "tokens": tokens,
        "tokens_per_s": tokens / (t2 - t1),
        "cpu_s_per_mtok": (c2 - c1) / (tokens / 1e6),
        "rss_before_mb": rss_before,
        "rss_steady_mb": rss_steady,
        "peak_rss_mb": mem.peak / 2**20,
        "restore_load_s": t4 - t3,
        "restore_first_batch_s": t5 - t4,
        "restore_s": t5 - t3,
        "restore_identical": got == ref,
        "state": state_bytes,
        "kw": kw,
        "loadavg_1m": os.getloadavg()[0],
    }


WORKERS = {"throughput": w_throughput, "limit": w_limit, "restore": w_restore, "wait": w_wait, "lanes": w_lanes}


def worker_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    try:
        if spec["kind"] in WORKERS:
            fn = WORKERS[spec["kind"]]
        else:  # the vision half's kinds (vthroughput, vlimit)
            from benchmarks.run_vision import VWORKERS

            fn = VWORKERS[spec["kind"]]
        out = {"ok": True, "result": fn(spec)}
    except Exception as e:  # reported, not fatal for the whole run
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    sys.stdout.flush()
    with open(spec["out"], "w") as f:
        json.dump(out, f)


# =========================================================================== orchestrator
def available(name: str) -> str | None:
    mod = NEEDS.get(name)
    return None if mod is None else available_mod(mod)


def run_text(
    size: str, rounds: int | None, do_profile: bool, inprocess: bool | None, log, out_dir: str | None = None
) -> str:
    from benchmarks.common import bracketed_rounds
    from benchmarks.corpus import DATA, text_corpus
    from zephon.tools.demo import TOKENIZER_DIR

    plan = dict(PLANS[size])
    if rounds:
        plan["rounds"] = rounds
    inprocess = (size == "smoke") if inprocess is None else inprocess
    started = time.time()
    load_start = os.getloadavg()
    log(f"[text/{size}] generating corpus ...")
    corpus = text_corpus(size)
    settings = {
        "files": corpus["files"],
        "glob": corpus["glob"],
        "corpus_dir": corpus["dir"],
        "cache_dir": os.path.join(DATA, "cache"),
        "tokenizer_dir": TOKENIZER_DIR,
        "seq_len": 2048,
        "batch_rows": 8,
        "lanes": 8,
        "shuffle_rows": plan["shuffle_rows"],
    }
    log(f"  {corpus['docs']} documents, {corpus['bytes'] / 1e6:.1f} MB of JSONL in {len(corpus['files'])} shards")
    tmp = tempfile.mkdtemp(prefix="zephon-bench-")
    R = Runner(inprocess, tmp, log, worker_main)
    skipped = {n: why for n in CONTENDERS + ["titan_nw2"] if (why := available(n))}
    for n, why in skipped.items():
        log(f"  skipping {n}: {why}")
    contenders = [c for c in CONTENDERS if c not in skipped]

    # warm the caches (zephon's index, the HF datasets Arrow cache) so time-to-first-batch is warm
    log("  warming caches ...")
    warm = {}
    for c in contenders:
        if c in ("zephon", "titan"):
            res = R.call({"kind": "throughput", "contender": c, "threads": 1, "steps": 1, "settings": settings})
            warm[c] = res.get("result", {}).get("ttfb_s")

    # ---------------------------------------------------------------- throughput rounds
    raw: list[dict[str, Any]] = []
    tokens_target = plan["steps"] * 8 * 2048

    def measure(c: str, threads: int, rnd: int, slot: int) -> None:
        log(f"  round {rnd + 1}/{plan['rounds']} threads={threads} {c} ...")
        if c == "limit":
            res = R.call({"kind": "limit", "threads": threads, "tokens": tokens_target, "settings": settings})
        else:
            res = R.call(
                {
                    "kind": "throughput",
                    "contender": c,
                    "threads": threads,
                    "steps": plan["steps"],
                    "warmup": plan["warmup"],
                    "settings": settings,
                }
            )
        if res["ok"]:
            r = res["result"]
            r.update(round=rnd, contender=c, slot=slot)
            raw.append(r)
            log(f"    {r['tokens_per_s'] / 1e6:.3f} M tokens/s")
        else:
            raw.append({"contender": c, "threads": threads, "round": rnd, "slot": slot, "error": res["error"]})

    others = [c for c in contenders if c != "zephon"] + ["limit"]
    extra = ["titan_nw2"] if plan["titan_extra"] and "titan" in contenders else []
    bracketed_rounds(
        plan,
        "zephon" in contenders,
        lambda rnd, threads: others + (extra if threads == max(plan["threads"]) else []),
        measure,
    )

    # ---------------------------------------------------------------- zephon: restore
    log("  zephon restore vs step ...")
    restore = R.call(
        {
            "kind": "restore",
            "threads": max(plan["threads"]),
            "targets": plan["restore_steps"],
            "repeats": plan["restore_repeats"],
            "settings": settings,
        },
        timeout=3600,
    )

    # ---------------------------------------------------------------- zephon: lanes per rank
    lanes_raw: list[dict[str, Any]] = []

    def measure_lanes(L: int, threads: int, rnd: int, batch: int, steps: int, warmup: int) -> None:
        log(f"  lanes round {rnd + 1} threads={threads} lanes={L} ...")
        res = R.call(
            {
                "kind": "lanes",
                "threads": threads,
                "lanes": L,
                "batch": batch,
                "steps": steps,
                "warmup": warmup,
                "settings": settings,
            },
            timeout=1800,
        )
        if res["ok"]:
            r = res["result"]
            r.update(round=rnd)
            lanes_raw.append(r)
            log(
                f"    {r['tokens_per_s'] / 1e6:.3f} M tokens/s, first batch {r['ttfb_s']:.1f} s, "
                f"restore {r['restore_s']:.1f} s, steady RSS {r['rss_steady_mb']:.0f} MB"
            )
        else:
            lanes_raw.append({"lanes": L, "threads": threads, "round": rnd, "error": res["error"]})

    for rnd in range(plan["lanes_rounds"]):
        for threads in plan.get("lanes_threads", plan["threads"]):
            for L in plan["lanes"] if rnd % 2 == 0 else plan["lanes"][::-1]:
                measure_lanes(L, threads, rnd, plan["lanes_batch"], plan["lanes_steps"], plan["lanes_warmup"])
    big = plan.get("lanes_big")
    if big:
        for threads in plan.get("lanes_threads", plan["threads"]):
            measure_lanes(big["lanes"], threads, 0, big["batch"], big["steps"], big["warmup"])

    # ---------------------------------------------------------------- consumer wait
    waits: list[dict[str, Any]] = []
    for c in contenders:
        log(f"  consumer wait: {c}, 1 worker thread, {plan['wait_ms']} ms fake step ...")
        res = R.call(
            {
                "kind": "wait",
                "contender": c,
                "threads": 1,
                "ms": plan["wait_ms"],
                "steps": plan["wait_steps"],
                "settings": settings,
            }
        )
        if res["ok"]:
            waits.append(res["result"])

    # ---------------------------------------------------------------- profile
    profiles: dict[int, Any] = {}
    if plan["profile"] and do_profile:
        from benchmarks.profile_text import profile_zephon

        for threads in plan["threads"]:
            log(f"  py-spy profile of zephon at {threads} thread(s) ...")
            profiles[threads] = profile_zephon(R, settings, threads, plan["steps"], tmp)

    shutil.rmtree(tmp, ignore_errors=True)
    data = {
        "size": size,
        "plan": plan,
        "corpus": {k: corpus[k] for k in ("docs", "bytes")},
        "shards": len(corpus["files"]),
        "settings": {k: v for k, v in settings.items() if k != "files"},
        "machine": machine(),
        "versions": versions(),
        "skipped": skipped,
        "warm_ttfb": warm,
        "throughput": raw,
        "restore": restore,
        "lanes": lanes_raw,
        "waits": waits,
        "profiles": profiles,
        "wall_s": time.time() - started,
        "inprocess": inprocess,
    }
    data["machine"]["loadavg_start"] = load_start
    data["machine"]["loadavg_end"] = os.getloadavg()
    from benchmarks.report import write_report

    out_dir = out_dir or os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    md = write_report(data, os.path.join(out_dir, f"text_{size}"))
    log(f"[text/{size}] done in {data['wall_s']:.0f} s: {md}")
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(PLANS), default="small")
    ap.add_argument(
        "--only",
        choices=["text", "vision", "all"],
        default="all",
        help="which half: text, vision or all (both, text first; the default)",
    )
    ap.add_argument("--rounds", type=int, default=None, help="override the number of A/B rounds")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument(
        "--inprocess",
        action="store_true",
        default=None,
        help="run measurements in this process (default only at --size smoke)",
    )
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(a.worker)
        return 0

    def log(msg: str) -> None:
        print(msg, flush=True)

    if a.only in ("text", "all"):
        run_text(a.size, a.rounds, not a.no_profile, a.inprocess, log, a.out)
    if a.only in ("vision", "all"):
        from benchmarks.run_vision import run_vision

        run_vision(a.size, a.rounds, not a.no_profile, a.inprocess, log, a.out, worker_main=worker_main)
    return 0


if __name__ == "__main__":
    sys.exit(main())
