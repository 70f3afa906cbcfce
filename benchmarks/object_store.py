#!/usr/bin/env python
"""A text recipe read from an S3 server vs from local files: the node-local shard cache.

    python benchmarks/object_store.py             # writes benchmarks/results/object_store.{md,json}
    python benchmarks/object_store.py --steps 20 --tag quick

moto's standalone S3 server (a real HTTP server in its own process, on 127.0.0.1) holds the demo
corpus (web JSONL + code Parquet + books text). One rank (W = 1), inline workers, the same
recipe read five ways: local files; S3 without a cache (byte-range reads, indexing streams each
object); S3 with a cold node cache (``$ZEPHON_SHARD_CACHE`` empty, no index: every object is
downloaded once, while indexing); S3 with the cache warm and its index built (a second job on the
node); the same with download-ahead off. Per setup: time to the first batch (prepare: listing,
indexing, token estimates, first step), steady throughput (tokens per second over ``--steps``
steps after the first), the bytes fetched from the server, the record bytes the run used, and
whether the batches are those of the local files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, os.path.join(ROOT, "tests", "support")):
    if p not in sys.path:
        sys.path.insert(0, p)
from benchmarks.common import machine, versions  # noqa: E402
from benchmarks.stamp import stamp_files  # noqa: E402

RECIPE = """\
seed = 5
lanes = 8
seq_len = 1024
global_batch_size = 16
cache_dir = "{index}"

[tokenizer]
path = "{tok}"

[[datasets]]
name = "web"
path = "{root}/web/*.jsonl"
weight = 0.5

[[datasets]]
name = "code"
path = "{root}/code/*.parquet"
format = "parquet"
weight = 0.2

[[datasets]]
name = "books"
path = "{root}/books/*.txt"
format = "text"
weight = 0.3

[shuffle]
buffer = 64
"""

BUCKET = "zephon-bench"


class Bytes:
    """Counts the bytes the text readers fetch from the server and the record bytes they use."""

    def __init__(self) -> None:
        from zephon.data.datasets.shardio import ShardFiles

        self.fetched = self.used = 0
        fetch, read, download = ShardFiles._fetch_ranges, ShardFiles._read_ranges, ShardFiles._download
        stream = ShardFiles._stream
        me = self

        def fetch_ranges(ix, s, groups):
            out = fetch(ix, s, groups)
            me.fetched += sum(len(d) for d in out)
            return out

        def read_ranges(ix, s, offs, lens):
            me.used += sum(lens)
            return read(ix, s, offs, lens)

        def downloaded(ix, s, sink):
            download(ix, s, sink)
            me.fetched += sink.written

        def streamed(ix, s, doing):
            cached = ix._node_cache(s) is not None or ix._specs[s].local
            for chunk in stream(ix, s, doing):
                if not cached:  # a remote shard read whole without the cache (indexing, Parquet)
                    me.fetched += len(chunk)
                yield chunk

        ShardFiles._fetch_ranges, ShardFiles._read_ranges = fetch_ranges, read_ranges
        ShardFiles._download, ShardFiles._stream = downloaded, streamed

    def take(self) -> tuple[int, int]:
        out = (self.fetched, self.used)
        self.fetched = self.used = 0
        return out


def _recipe(root: str, index: str, path: str) -> str:
    from zephon.tools.demo import TOKENIZER_DIR

    with open(path, "w") as f:
        f.write(RECIPE.format(root=root, index=index, tok=TOKENIZER_DIR))
    return path


def _run(recipe: str, steps: int, counter: Bytes, env: dict[str, str]) -> dict:
    import s3fs

    from zephon import Recipe, WorkerConfig, batch_sha256
    from zephon.data import node_cache
    from zephon.recipe.runtime import RankBatches

    for k, v in env.items():
        os.environ[k] = v
    s3fs.S3FileSystem.clear_instance_cache()
    counter.take()
    before = dict(node_cache().stats) if node_cache() is not None else {}
    c0 = time.process_time()
    t0 = time.perf_counter()
    with RankBatches(Recipe.from_toml(recipe), 1, None, workers=WorkerConfig(0)) as g:
        hashes = [batch_sha256(g.next_step())]
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        hashes += [batch_sha256(g.next_step()) for _ in range(steps)]
        steady = time.perf_counter() - t1
        cpu = time.process_time() - c0
    cache = node_cache()
    if cache is not None:
        cache.drain()
    fetched, used = counter.take()
    return {
        "first_batch_s": round(first, 3),
        "steady_s": round(steady, 3),
        "tokens_per_s": round(steps * 16 * 1024 / steady),
        "process_cpu_s": round(cpu, 2),
        "bytes_fetched": fetched,
        "record_bytes_used": used,
        "cache": {k: v - before.get(k, 0) for k, v in cache.stats.items()} if cache is not None else None,
        "hashes": hashes,
    }


def _interleaved(recipes: dict[str, str], steps: int, block: int = 5) -> dict[str, dict]:
    """Steady throughput of loaders that are all open at once, ``block`` steps of each in turn
    (a shared machine's load drifts; taking turns spreads it evenly over the setups)."""
    from zephon import Recipe, WorkerConfig, batch_sha256
    from zephon.recipe.runtime import RankBatches

    gs = {k: RankBatches(Recipe.from_toml(r), 1, None, workers=WorkerConfig(0)) for k, r in recipes.items()}
    took = dict.fromkeys(gs, 0.0)
    hashes: dict[str, list[str]] = {k: [batch_sha256(g.next_step())] for k, g in gs.items()}
    try:
        for _ in range(0, steps, block):
            for k, g in gs.items():
                t0 = time.perf_counter()
                hashes[k] += [batch_sha256(g.next_step()) for _ in range(block)]
                took[k] += time.perf_counter() - t0
    finally:
        for g in gs.values():
            g.close()
    n = len(hashes[next(iter(gs))]) - 1
    return {
        k: {"steady_s": round(took[k], 3), "tokens_per_s": round(n * 16 * 1024 / took[k]), "hashes": hashes[k]}
        for k in gs
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="steps timed after the first (default 40)")
    ap.add_argument("--scale", type=float, default=0.3, help="demo corpus scale (1.0: about 7 MB)")
    ap.add_argument("--tag", default="object_store")
    args = ap.parse_args()
    cmd = "python benchmarks/object_store.py" + "".join(
        f" --{k} {v}"
        for k, v in (("steps", args.steps), ("scale", args.scale), ("tag", args.tag))
        if v != ap.get_default(k)
    )
    from storage_server import MotoServer

    from zephon.tools.synth import make_demo_corpus

    load0, t_all = os.getloadavg(), time.time()
    work = tempfile.mkdtemp(prefix="zephon-objstore-")
    server = MotoServer()
    try:
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=server.url,
            ZEPHON_SHARD_CACHE="",
        )
        import s3fs

        corpus = os.path.join(work, "corpus")
        make_demo_corpus(corpus, seed=11, scale=args.scale)
        fs = s3fs.S3FileSystem()
        fs.mkdir(BUCKET)
        total = 0
        for sub in ("web", "code", "books"):
            for name in sorted(os.listdir(os.path.join(corpus, sub))):
                fs.put(os.path.join(corpus, sub, name), f"{BUCKET}/corpus/{sub}/{name}")
                total += os.path.getsize(os.path.join(corpus, sub, name))
        remote = f"s3://{BUCKET}/corpus"
        local_r = _recipe(corpus, os.path.join(work, "ix-local"), os.path.join(work, "local.toml"))
        s3_direct = _recipe(remote, os.path.join(work, "ix-direct"), os.path.join(work, "direct.toml"))
        s3_cached = _recipe(remote, os.path.join(work, "ix-cached"), os.path.join(work, "cached.toml"))
        node = os.path.join(work, "node-cache")
        counter = Bytes()
        off = {"ZEPHON_SHARD_CACHE": ""}
        on = {"ZEPHON_SHARD_CACHE": node, "ZEPHON_SHARD_AHEAD": "4"}
        _run(local_r, 2, counter, off)  # index the local files once (a warm index, as a rerun has)
        rows = [
            ("local files (index warm)", _run(local_r, args.steps, counter, off)),
            ("S3, no cache (index cold)", _run(s3_direct, args.steps, counter, off)),
            ("S3, cache cold (index cold)", _run(s3_cached, args.steps, counter, on)),
            ("S3, cache warm (index warm)", _run(s3_cached, args.steps, counter, on)),
            # a cold cache under a warm index: the reads (and the hints ahead of them) download
            (
                "S3, cache cold, index warm",
                _run(s3_cached, args.steps, counter, {**on, "ZEPHON_SHARD_CACHE": node + "-2"}),
            ),
        ]
        for k, v in on.items():
            os.environ[k] = v
        turns = _interleaved({"local": local_r, "warm": s3_cached}, args.steps)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    _write(rows, turns, args, cmd, time.time() - t_all, load0, total)


def _write(rows: list, turns: dict, args: argparse.Namespace, cmd: str, took: float, load0: tuple, total: int) -> None:
    base = rows[0][1]
    out = []
    for name, r in rows:
        r = dict(r, setup=name, vs_local=round(r["tokens_per_s"] / base["tokens_per_s"], 3))
        r["same_batches_as_local"] = r.pop("hashes") == base["hashes"]
        out.append(r)
    same = turns["warm"]["hashes"] == turns["local"]["hashes"]
    ratio = turns["warm"]["tokens_per_s"] / turns["local"]["tokens_per_s"]
    steady = {k: {kk: vv for kk, vv in v.items() if kk != "hashes"} for k, v in turns.items()}
    res = os.path.join(HERE, "results")
    m = machine()
    doc = {"command": cmd, "machine": m, "versions": versions(), "corpus_bytes": total, "steps": args.steps}
    doc.update(rows=out, interleaved=dict(steady, warm_vs_local=round(ratio, 3), same_batches=same))
    with open(os.path.join(res, f"{args.tag}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    lines = [
        "# Object storage: a text recipe from an S3 server vs from local files",
        "",
        f"Produced by `{cmd}` in {took:.0f} s on {m['cpu']}, {m['cores']} cores (affinity {m['affinity']}); load "
        f"average at start {', '.join(f'{x:.2f}' for x in load0)}, at the end "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} (a shared machine: wall times are noisy).",
        "",
        "moto's standalone S3 server on 127.0.0.1 (a real HTTP server, but no network latency: a remote store "
        f"adds milliseconds per request, which the cache takes out of the steady state). The demo corpus, "
        f"{total / 1e6:.1f} MB in 9 shards (web JSONL, code Parquet, books text). One rank, 8 lanes x 2 rows of "
        f"1024 tokens per step, inline workers.",
        "",
        f"**Warm cache vs local files, taking turns** (both loaders open, {args.steps} steps each after the first, "
        f"5 steps of one then 5 of the other): local {turns['local']['tokens_per_s']:,} tokens/s, S3 with a warm "
        f"cache {turns['warm']['tokens_per_s']:,} tokens/s: **{ratio:.2f}x** of local (target >= 0.9x); same "
        f"batches: {'yes' if same else 'NO'}.",
        "",
        "**Each setup on its own** (a fresh loader: time to the first batch includes listing, indexing, token "
        f"estimates and the first step; tokens/s over {args.steps} steps after it, one after another, so load "
        "drift shows). Bytes fetched: from the server (indexing streams, downloads, range reads; Parquet reads "
        "without the cache are not counted); record bytes used: what the JSONL and text readers returned "
        "(prepare's token estimates included).",
        "",
        "| setup | first batch (s) | tokens/s | vs local | process CPU (s) | bytes fetched | record bytes used | "
        "downloads | started ahead | same batches as local |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out:
        c = r["cache"] or {}
        lines.append(
            f"| {r['setup']} | {r['first_batch_s']:.2f} | {r['tokens_per_s']:,} | {r['vs_local']:.2f}x | "
            f"{r['process_cpu_s']:.1f} | {r['bytes_fetched']:,} | {r['record_bytes_used']:,} | "
            f"{c.get('downloads', '-')} | {c.get('ahead', '-')} | {'yes' if r['same_batches_as_local'] else 'NO'} |"
        )
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()), ""]
    with open(os.path.join(res, f"{args.tag}.md"), "w") as f:
        f.write("\n".join(lines))
    stamp_files(os.path.join(res, f"{args.tag}.json"), os.path.join(res, f"{args.tag}.md"), command=cmd)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
