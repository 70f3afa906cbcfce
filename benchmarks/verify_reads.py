"""What checking every read costs (issue 21): each record's CRC-32 is kept in the index and
verified on every read (``ShardFiles._verify``). This measures, on the local ``small`` text
corpus (34 MB of JSON Lines), reads with the check against the same reads with the check
switched off (the method replaced by a no-op in this process only):

* ``DatasetIndex.read`` alone: every record once, in random batches of 64 per shard (what a
  worker asks for), JSON parse included: MB/s;
* the whole loader (read, tokenize, pack, shuffle; 1 thread worker, 8 lanes, rows of 2048):
  tokens/s over 60 batches after the first;
* the check alone: the time spent inside ``_verify`` during the checked reads, as a share of
  their time (CPU work, so far less noisy on a shared machine than the two differences above).

Rounds alternate the order (on, off, then off, on, ...); the cost is the median of per-round
ratios. Results: ``benchmarks/results/verify_reads.{json,md}``.

    python benchmarks/verify_reads.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import machine  # noqa: E402
from benchmarks.corpus import text_corpus  # noqa: E402
from benchmarks.stamp import stamp_files  # noqa: E402
from benchmarks.text_contenders import Settings, build_zephon  # noqa: E402
from zephon.data import index_dataset  # noqa: E402
from zephon.data.datasets.shardio import ShardFiles  # noqa: E402
from zephon.tools.demo import TOKENIZER_DIR  # noqa: E402

_VERIFY = ShardFiles._verify
_SPENT = [0.0]
_LOADER_SHARE: list[float] = []  # time inside the check / loader time, per checked loader run


def _timed_verify(self, s, raws, crcs, locator):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    try:
        return _VERIFY(self, s, raws, crcs, locator)
    finally:
        _SPENT[0] += time.perf_counter() - t0


def verify(on: bool) -> None:
    ShardFiles._verify = _timed_verify if on else (lambda self, s, raws, crcs, locator: None)  # type: ignore[method-assign]


def read_mb_s(ix, corpus_bytes: int) -> float:
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for s in range(len(ix.shards)):
        order = rng.permutation(ix.shards[s].num_records)
        for k in range(0, len(order), 64):
            ix.read(s, order[k : k + 64].tolist())
    return corpus_bytes / (time.perf_counter() - t0) / 1e6


def loader_tokens_s(settings: Settings, batches: int = 60) -> float:
    b = build_zephon(settings, 1)
    try:
        next(b.it)
        _SPENT[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(batches):
            next(b.it)
        dt = time.perf_counter() - t0
        _LOADER_SHARE.append(_SPENT[0] / dt)
    finally:
        b.close()
    return batches * settings.batch_rows * settings.seq_len / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    corpus = text_corpus("small")
    cache = tempfile.mkdtemp(prefix="zephon-verify-bench-")
    settings = Settings(
        files=list(corpus["files"]),  # type: ignore[arg-type]
        glob=str(corpus["glob"]),
        corpus_dir=str(corpus["dir"]),
        cache_dir=cache,
        tokenizer_dir=TOKENIZER_DIR,
    )
    ix = index_dataset("web", settings.glob, cache_dir=cache)
    nbytes = int(corpus["bytes"])  # type: ignore[call-overload]
    read_mb_s(ix, nbytes)  # warm the page cache
    res: dict[str, dict[str, list[float]]] = {"read": {"on": [], "off": []}, "loader": {"on": [], "off": []}}
    share: list[float] = []
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            verify(on)
            key = "on" if on else "off"
            _SPENT[0] = 0.0
            res["read"][key].append(read_mb_s(ix, nbytes))
            if on:
                share.append(_SPENT[0] / (nbytes / 1e6 / res["read"]["on"][-1]))
            res["loader"][key].append(loader_tokens_s(settings))
            if not on:
                _LOADER_SHARE.pop()
            print(
                f"round {r} verify={key}: read {res['read'][key][-1]:.1f} MB/s, "
                f"loader {res['loader'][key][-1]:,.0f} tokens/s",
                flush=True,
            )
    verify(True)
    summary = {}
    for what, unit in (("read", "MB/s"), ("loader", "tokens/s")):
        ratios = [a / b for a, b in zip(res[what]["on"], res[what]["off"])]
        summary[what] = {
            "unit": unit,
            "on_median": statistics.median(res[what]["on"]),
            "off_median": statistics.median(res[what]["off"]),
            "ratio_median": statistics.median(ratios),
            "cost_percent": round(100 * (1 - statistics.median(ratios)), 2),
            "rounds": res[what],
        }
    summary["check_share_of_read"] = {"median_percent": round(100 * statistics.median(share), 2), "rounds": share}
    summary["check_share_of_loader"] = {
        "median_percent": round(100 * statistics.median(_LOADER_SHARE), 2),
        "rounds": _LOADER_SHARE,
    }
    out = {"corpus": {k: corpus[k] for k in ("bytes", "docs")}, "machine": machine(), "results": summary}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "verify_reads.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = [
        "# The cost of checking every read (CRC-32 per record)",
        "",
        f"Local `small` text corpus ({nbytes / 1e6:.1f} MB, {corpus['docs']} JSON Lines documents); "
        f"{args.rounds} rounds, alternating order; `python benchmarks/verify_reads.py`.",
        "",
        "| what | check on | check off | on / off (median of rounds) | cost |",
        "|---|---|---|---|---|",
    ]
    for what, label in (("read", "`DatasetIndex.read`, batches of 64"), ("loader", "loader, 1 thread worker")):
        m = summary[what]
        lines.append(
            f"| {label} | {m['on_median']:,.1f} {m['unit']} | {m['off_median']:,.1f} {m['unit']} | "
            f"{m['ratio_median']:.3f} | {m['cost_percent']:.1f}% |"
        )
    lines += [
        "",
        f"Time inside the check (CRC-32 of each record read, compared with the index's): "
        f"{summary['check_share_of_read']['median_percent']:.2f}% of the time of `DatasetIndex.read` alone (which "
        f"includes the JSON parse), {summary['check_share_of_loader']['median_percent']:.2f}% of the loader's time "
        "(medians of rounds): the cost of the check on local files. The throughput differences in the table are "
        "measured on a shared 2-core machine and carry its noise (rounds: `verify_reads.json`).",
    ]
    with open(os.path.join(args.out, "verify_reads.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    stamp_files(os.path.join(args.out, "verify_reads.json"), os.path.join(args.out, "verify_reads.md"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
