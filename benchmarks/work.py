"""Work proportional to data (issue 20): tokens tokenized per token delivered, and throughput
against the tokenizer-only limit on a corpus of long documents.

    python benchmarks/work.py                 # ~4 min on 2 cores; writes results/work.{md,json}
    python benchmarks/work.py --size smoke    # seconds; what tests/system/test_benchmarks_smoke.py runs

Tokenizer work is counted at the tokenizer's calls (``TextTokenizer.encode_batch`` and
``encode_content`` wrapped in this process; thread workers), not estimated. Three counts per run:
*tokenized* (tokens the tokenizer returned), *handed on* (tokens of the documents and parts the
tokenize stage returned to its lane: delivered, or on their way in the packer and the shuffle
window) and *delivered* (the tokens of the batches taken, from their provenance). Their ratios:
``tokenized / handed on`` is the work per token (1.0 = nothing tokenized twice or thrown away);
``tokenized / delivered`` adds what the lanes hold ahead at the moment the run stops.

The corpora are built here from real text on the machine (the CPython standard library's
sources, concatenated, cut into documents at seeded offsets), under ``benchmarks/.data/work_*``:

* ratio corpus: 320 documents of 4-16 KB, ``seq_len`` 128 (so ``split_tokens`` = 516: 4 to 16
  parts per document), 1, 4, 16, 64 and 256 lanes, 1 row per lane per step, 2 thread workers,
  one pass (``policy = "stop"``) run to its end, so nothing is left read ahead;
* real-like corpus: documents of 1-8 MB, ``seq_len`` 2048 (``split_tokens`` 8,196: hundreds of
  parts per document), 16 lanes, 2 thread workers, against the tokenizer alone on 2 threads over
  the same text (64 KB pieces, already in memory).

Each configuration runs under ``data_version = 2`` (parts cut from the text) and, for the ratio,
``data_version = 1`` (every part tokenizes the whole document).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from benchmarks.common import run_chunks  # noqa: E402
from benchmarks.stamp import stamp_files  # noqa: E402

DATA = os.path.join(HERE, ".data")
SIZES = {
    # ratio corpus (docs, KB range), lanes; real-like corpus (docs, size range, unit), timed
    # seconds, rounds
    "smoke": {
        "ratio": (24, 8, 16),
        "lanes": [1, 4],
        "steps": 4,
        "real": (4, 64, 128, 1 << 10),
        "seconds": 1.0,
        "rounds": 1,
    },
    "default": {
        "ratio": (320, 8, 40),
        "lanes": [1, 4, 16, 64, 256],
        "steps": 24,
        "real": (20, 1, 8, 1 << 20),
        "seconds": 20.0,
        "rounds": 2,
    },
}


def source_text(limit: int) -> str:
    """Real text: the standard library's sources, concatenated (sorted paths: deterministic)."""
    out, n = [], 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "**", "*.py"), recursive=True)):
        try:
            with open(path, encoding="utf-8") as f:
                t = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        out.append(t)
        n += len(t)
        if n >= limit:
            break
    return "\n".join(out)


def corpus(name: str, docs: int, lo: int, hi: int, unit: int) -> str:
    """``docs`` documents of ``lo``-``hi`` units, seeded slices of the source text; a folder."""
    root = os.path.join(DATA, f"work_{name}_{docs}_{lo}_{hi}")
    path = os.path.join(root, "docs.jsonl")
    if not os.path.exists(path):
        os.makedirs(root, exist_ok=True)
        text = source_text(max(hi * unit * 2, 4 << 20))
        rng = np.random.default_rng(20)
        with open(path + ".tmp", "w") as f:
            for _ in range(docs):
                n = min(len(text) - 1, int(rng.integers(lo * unit, hi * unit + 1)))
                s = int(rng.integers(0, len(text) - n))
                f.write(json.dumps({"text": text[s : s + n]}) + "\n")
        os.replace(path + ".tmp", path)
    return root


class Counts:
    """Tokenizer work (wrapped tokenizer calls) and tokens handed on by the tokenize stage."""

    def __init__(self) -> None:
        from zephon.data.tokenizer import TextTokenizer
        from zephon.nodes import FetchTokenize

        self.tokenized = self.handed_on = 0
        lock = threading.Lock()

        def wrap(cls, name, attr):
            fn = getattr(cls, name)

            def counted(*a, **kw):
                out = fn(*a, **kw)
                with lock:
                    setattr(self, attr, getattr(self, attr) + sum(len(getattr(x, "tokens", x)) for x in out))
                return out

            setattr(cls, name, counted)

        wrap(TextTokenizer, "encode_batch", "tokenized")
        wrap(TextTokenizer, "encode_content", "tokenized")
        wrap(FetchTokenize, "__call__", "handed_on")


def recipe(root: str, lanes: int, seq_len: int, version: int, finite: bool = False):
    from zephon import Recipe

    return Recipe.from_dict(
        {
            "seed": 1,
            "lanes": lanes,
            "seq_len": seq_len,
            "global_batch_size": lanes,
            "data_version": version,
            "cache_dir": os.path.join(root, "cache"),
            "tokenizer": {"path": os.path.join(os.path.dirname(HERE), "zephon", "data", "assets", "tokenizer")},
            "datasets": [
                {"name": "long", "path": os.path.join(root, "docs.jsonl"), "policy": "stop" if finite else "repeat"}
            ],
            "shuffle": {"buffer": 16},
        },
        root,
    )


def fresh(p) -> None:
    """Empty the tokenize stage's per-process caches: a run must not reuse the previous one's."""
    for k in ("_parts_cache", "_text_cache"):
        p.text_encoder.__dict__.pop(k, None)


def delivered_tokens(batch) -> int:
    return sum(int(e[5]) - int(e[4]) for row in batch["provenance"] for e in row)


def ratio_run(counts: Counts, root: str, lanes: int, version: int) -> dict:
    """One pass over the corpus (a finite recipe, run to its end): nothing is left read ahead,
    so ``tokenized / delivered`` is the whole pass's work per token."""
    from zephon import WorkerConfig

    r = recipe(root, lanes, 128, version, finite=True)
    p = r.prepare()
    with r.global_loader(1, workers=WorkerConfig(2, "thread")) as g:
        next(g)  # a finite recipe counts its lanes' steps once (a dry run, cached on disk): not timed
    fresh(p)
    counts.tokenized = counts.handed_on = 0
    delivered = steps = 0
    t0 = time.perf_counter()
    with r.global_loader(1, workers=WorkerConfig(2, "thread")) as g:
        for b in g:
            delivered += delivered_tokens(b)
            steps += 1
    return {
        "lanes": lanes,
        "data_version": version,
        "steps": steps,
        "tokenized": counts.tokenized,
        "handed_on": counts.handed_on,
        "delivered": delivered,
        "tokenized_per_handed_on": round(counts.tokenized / max(1, counts.handed_on), 3),
        "tokenized_per_delivered": round(counts.tokenized / max(1, delivered), 3),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def early_run(counts: Counts, root: str, lanes: int, version: int, steps: int) -> dict:
    """The first ``steps`` steps of an endless run: ``tokenized / handed on`` (what a lane has
    paid for the parts it has handed on so far: the issue's 6.4x at 16 lanes)."""
    from zephon import WorkerConfig

    r = recipe(root, lanes, 128, version)
    fresh(r.prepare())
    counts.tokenized = counts.handed_on = 0
    with r.global_loader(1, workers=WorkerConfig(2, "thread")) as g:
        for _ in range(steps):
            next(g)
        tokenized, handed = counts.tokenized, counts.handed_on
    return {
        "lanes": lanes,
        "data_version": version,
        "steps": steps,
        "tokenized_per_handed_on": round(tokenized / max(1, handed), 3),
    }


def limit_run(root: str, seconds: float) -> float:
    """Tokens/s of the tokenizer alone on 2 threads over 64 KB pieces of the corpus's text."""
    from zephon.data.tokenizer import TextTokenizer

    tok = TextTokenizer(os.path.join(os.path.dirname(HERE), "zephon", "data", "assets", "tokenizer"))
    with open(os.path.join(root, "docs.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f]
    pieces = [t[i : i + 65536] for t in texts for i in range(0, len(t), 65536)]
    chunks = [pieces[i : i + 4] for i in range(0, len(pieces), 4)]
    n = tok.count_tokens(chunks[0])  # warm
    t0 = time.perf_counter()
    total, dt = 0, 0.0
    while dt < seconds:
        got, took, _ = run_chunks(lambda c: sum(len(x) for x in tok.encode_batch(c)), chunks, 2, max(n, 200_000))
        total, dt = total + got, dt + took
        if time.perf_counter() - t0 > 3 * seconds:
            break
    return total / dt


def zephon_rate(root: str, seconds: float) -> dict:
    from zephon import WorkerConfig

    r = recipe(root, 16, 2048, 2)
    fresh(r.prepare())
    t0 = time.perf_counter()
    with r.global_loader(1, workers=WorkerConfig(2, "thread")) as g:
        next(g)
        first = time.perf_counter() - t0
        # the lanes' read-ahead (chunks in flight, shuffle windows) filled while the first batch
        # was made: drain it for half the window, then time the steady state
        t1 = time.perf_counter()
        while time.perf_counter() - t1 < seconds / 2:
            next(g)
        t1 = time.perf_counter()
        delivered = 0
        while time.perf_counter() - t1 < seconds:
            b = next(g)
            delivered += int(b["input"].size) + len(b["input"])  # rows of seq_len + 1 tokens
        dt = time.perf_counter() - t1
    return {"first_batch_s": round(first, 2), "tokens_per_s": delivered / dt, "seconds": round(dt, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="default")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    cfg = SIZES[args.size]
    load0 = os.getloadavg()
    counts = Counts()
    docs, lo, hi = cfg["ratio"]
    root = corpus("ratio", docs, lo, hi, 1024)
    ratios = []
    for lanes in cfg["lanes"]:
        for version in (2, 1):
            ratios.append(ratio_run(counts, root, lanes, version))
            ratios[-1]["early"] = early_run(counts, root, lanes, version, 8)["tokenized_per_handed_on"]
            print(json.dumps(ratios[-1]), flush=True)
    docs, lo, hi, unit = cfg["real"]
    real_root = corpus("real", docs, lo, hi, unit)
    rounds = []
    for _ in range(cfg["rounds"]):  # limit, zephon, then zephon, limit: load changes cancel in the ratio
        a = limit_run(real_root, cfg["seconds"] / 2)
        z = zephon_rate(real_root, cfg["seconds"])
        b = limit_run(real_root, cfg["seconds"] / 2)
        rounds.append({"limit_tokens_per_s": (a + b) / 2, **z, "ratio_to_limit": z["tokens_per_s"] / ((a + b) / 2)})
        print(json.dumps(rounds[-1]), flush=True)
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_start": [round(x, 2) for x in load0],
            "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        },
        "size": args.size,
        "ratio_corpus": {
            "docs": cfg["ratio"][0],
            "kb": cfg["ratio"][1:],
            "seq_len": 128,
            "split_tokens": 516,
            "pass": "one epoch, run to the end",
        },
        "real_corpus": {
            "docs": cfg["real"][0],
            "bytes": [cfg["real"][1] * cfg["real"][3], cfg["real"][2] * cfg["real"][3]],
            "seq_len": 2048,
            "lanes": 16,
            "threads": 2,
        },
        "ratios": ratios,
        "throughput": rounds,
        "ratio_to_limit_median": float(np.median([x["ratio_to_limit"] for x in rounds])),
    }
    os.makedirs(args.out, exist_ok=True)
    stem = "work" if args.size == "default" else f"work_{args.size}"
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(report(result))
    stamp_files(os.path.join(args.out, stem + ".json"), os.path.join(args.out, stem + ".md"))
    return 0


def report(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# Work proportional to data (issue 20)",
        "",
        f"Machine: {m['cpus']} CPUs, Python {m['python']}; shared with other engineers: 1/5/15-min load "
        f"average {m['load_avg_start']} at the start, {m['load_avg_end']} at the end. Size `{r['size']}`; "
        "command `python benchmarks/work.py`.",
        "",
        "## Tokens tokenized per token (ratio corpus: real text, 4-16 KB documents, seq_len 128, one pass)",
        "",
        "Counted at the tokenizer's calls. *handed on*: tokens the tokenize stage returned to its lane "
        "; *delivered*: tokens of the batches (one pass run to its end, so the two agree but for BOS/EOS "
        "accounting and a record's last label). Last column: the first 8 steps of an endless run (the "
        "lanes stopped mid-document), tokens tokenized per token handed on.",
        "",
        "| lanes | data_version | steps | tokenized | handed on | delivered | tokenized / handed on "
        "| tokenized / delivered | s | first 8 steps: tokenized / handed on |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["ratios"]:
        lines.append(
            f"| {x['lanes']} | {x['data_version']} | {x['steps']} | {x['tokenized']:,} | {x['handed_on']:,} | "
            f"{x['delivered']:,} | {x['tokenized_per_handed_on']:.3f} | {x['tokenized_per_delivered']:.2f} | "
            f"{x['seconds']} | {x['early']:.2f} |"
        )
    lines += [
        "",
        "## Throughput vs the tokenizer-only limit (real-like corpus: 1-8 MB documents, 16 lanes, 2 threads)",
        "",
        "| round | limit tokens/s | zephon tokens/s | ratio | first batch s |",
        "|---|---|---|---|---|",
    ]
    for i, x in enumerate(r["throughput"]):
        lines.append(
            f"| {i + 1} | {x['limit_tokens_per_s']:,.0f} | {x['tokens_per_s']:,.0f} | {x['ratio_to_limit']:.2f} | "
            f"{x['first_batch_s']} |"
        )
    lines += ["", f"Median ratio to the limit: **{r['ratio_to_limit_median']:.2f}** (data_version 2).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
