"""The block shuffle (data version 3, issue 22) against the stripe order (versions 1-2).

On a local corpus of 64 uncompressed JSON Lines shards of 1.9 MB (synthetic web prose), one
recipe (16 lanes, 4 rows of 512 tokens per lane and step, a window of 128 rows) run under data version 2
(stripe) and under version 3 with ``[shuffle] block`` = 1, 4, 16 (the default), 64, 256:

* distinct shards per global batch, against a record-level global shuffle's expectation
  (``sum(1 - (1 - p_s) ** n)``, :func:`zephon.nodes.global_batch_diversity`), mean over steps;
* bytes read from the files (``os.pread``) / bytes of the records asked for, and reads per
  record (what a request-priced object store charges);
* tokens/s of the whole loader (1 thread worker, the run from opening the loader), stripe vs
  default block, rounds alternating.

Results: ``benchmarks/results/block_shuffle.{json,md}``.

    python benchmarks/block_shuffle.py [--rounds 3] [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import machine  # noqa: E402
from benchmarks.corpus import DATA, TOKENIZER_DIR, synth  # noqa: E402
from benchmarks.stamp import stamp_files  # noqa: E402
from zephon import Recipe, WorkerConfig  # noqa: E402
from zephon.data.datasets.shardio import ShardFiles  # noqa: E402
from zephon.tools.diversity import shard_diversity  # noqa: E402

SHARDS, DOCS, POOL = 64, 1000, 4000
LANES, BATCH, SEQ, BUFFER = 16, 64, 512, 128
BLOCKS = (1, 4, 16, 64, 256)


def corpus() -> str:
    """64 shards of 1,000 documents (about 1.9 MB each): each a different stretch of one pool of
    synthetic documents (distinct files, so distinct shards; generating each apart took minutes)."""
    root = os.path.join(DATA, "shuffle64")
    marker = root + ".json"
    if not os.path.exists(marker):
        os.makedirs(root, exist_ok=True)
        s = synth()
        pool = s.generate_documents("web", POOL, seed=500)
        for k in range(SHARDS):
            start = (k * 613) % POOL
            docs = [pool[(start + i) % POOL] for i in range(DOCS)]
            s.write_jsonl(os.path.join(root, f"web-{k:05d}.jsonl"), docs)
        with open(marker, "w") as f:
            json.dump({"shards": SHARDS, "docs": DOCS}, f)
    return root


def recipe(root: str, version: int, block: int | None) -> Recipe:
    path = os.path.join(DATA, f"shuffle64-v{version}-b{block}.toml")
    extra = "" if block is None else f"block = {block}\n"
    with open(path, "w") as f:
        f.write(
            f"data_version = {version}\nseed = 1\nlanes = {LANES}\nseq_len = {SEQ}\nglobal_batch_size = {BATCH}\n"
            f'cache_dir = "{DATA}/shuffle64-cache"\n[tokenizer]\npath = "{TOKENIZER_DIR}"\n'
            f'[[datasets]]\nname = "web"\npath = "{root}/*.jsonl"\nformat = "jsonl"\n'
            f"[shuffle]\nbuffer = {BUFFER}\n{extra}"
        )
    return Recipe.from_toml(path)


class Reads:
    """Counts bytes and calls of ``os.pread`` and the bytes and records the readers asked for."""

    def __init__(self) -> None:
        self.read = self.calls = self.asked = self.records = 0
        self._pread, self._ranges = os.pread, ShardFiles._read_ranges

    def __enter__(self) -> Reads:
        pread, ranges = self._pread, self._ranges

        def counting_pread(fd: int, n: int, offset: int) -> bytes:
            data = pread(fd, n, offset)
            self.read += len(data)
            self.calls += 1
            return data

        def counting_ranges(ix, s, offs, lens):  # type: ignore[no-untyped-def]
            self.asked += sum(lens)
            self.records += len(lens)
            return ranges(ix, s, offs, lens)

        os.pread = counting_pread  # type: ignore[assignment]
        ShardFiles._read_ranges = counting_ranges  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        os.pread = self._pread  # type: ignore[assignment]
        ShardFiles._read_ranges = self._ranges  # type: ignore[method-assign]


def measure(r: Recipe, steps: int) -> dict[str, float]:
    """Diversity (of the ``steps`` global batches after the first), reads, and tokens/s of the
    whole run (1 thread worker; from opening the loader, so the shuffle windows' first fill, the
    same work under both orders, is counted: steadier on a shared machine than the steps alone)."""
    assert r.indexes
    t0 = time.perf_counter()
    with Reads() as reads, r.global_loader(1, workers=WorkerConfig(1, "thread")) as g:
        batches = [next(g) for _ in range(steps + 1)]
        dt = time.perf_counter() - t0
    got, want = shard_diversity(r, batches[1:])
    return {
        "distinct_shards": round(got, 2),
        "global_shuffle": round(want, 2),
        "ratio": round(got / want, 3),
        "read_over_asked": round(reads.read / reads.asked, 3),
        "reads_per_record": round(reads.calls / reads.records, 3),
        "tokens_per_s": round((steps + 1) * BATCH * SEQ / dt),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    root = corpus()
    rows: dict[str, dict[str, float]] = {"stripe (v2)": measure(recipe(root, 2, None), args.steps)}
    for b in BLOCKS:
        rows[f"block {b}" + (" (v3 default)" if b == 16 else "")] = measure(recipe(root, 3, b), args.steps)
    speed: dict[str, list[float]] = {"stripe (v2)": [], "block 16 (v3 default)": []}
    for k in range(args.rounds):  # alternate the order: stripe first, then block first, ...
        order = [(2, None), (3, 16)] if k % 2 == 0 else [(3, 16), (2, None)]
        for version, block in order:
            name = "stripe (v2)" if version == 2 else "block 16 (v3 default)"
            speed[name].append(measure(recipe(root, version, block), args.steps)["tokens_per_s"])
    ratios = [b / s for b, s in zip(speed["block 16 (v3 default)"], speed["stripe (v2)"])]
    out = {
        "machine": machine(),
        "corpus": {"shards": SHARDS, "docs_per_shard": DOCS, "format": "jsonl, uncompressed, local"},
        "recipe": {"lanes": LANES, "global_batch_size": BATCH, "seq_len": SEQ, "buffer": BUFFER},
        "rows": rows,
        "throughput_rounds": speed,
        "block_over_stripe_median": round(statistics.median(ratios), 3),
    }
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "block_shuffle.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = [
        "# Block shuffle (data version 3) vs stripe order (versions 1-2)",
        "",
        f"{SHARDS} local uncompressed JSONL shards x {DOCS} documents; {LANES} lanes, {BATCH} rows of {SEQ} "
        f"tokens per step, window {BUFFER} rows; {args.steps} steps after the first; `python benchmarks/block_shuffle.py`.",
        "",
        "| order | distinct shards / batch | global shuffle | ratio | bytes read / asked | reads / record | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in rows.items():
        lines.append(
            f"| {name} | {m['distinct_shards']} | {m['global_shuffle']} | {m['ratio']} | {m['read_over_asked']} "
            f"| {m['reads_per_record']} | {m['tokens_per_s']:,} |"
        )
    lines += [
        "",
        f"Throughput, {args.rounds} alternating rounds (1 thread worker, tokens/s of the run from opening the loader): stripe "
        f"{[round(x) for x in speed['stripe (v2)']]}, block 16 {[round(x) for x in speed['block 16 (v3 default)']]}; "
        f"block / stripe, median of rounds: {out['block_over_stripe_median']}.",
    ]
    with open(os.path.join(HERE, "results", "block_shuffle.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    stamp_files(os.path.join(HERE, "results", "block_shuffle.json"), os.path.join(HERE, "results", "block_shuffle.md"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
