"""Turn the raw measurements of benchmarks/run.py into text_<size>.md, .png and .json."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.stamp import stamp_files

ORDER = ["zephon", "zephon_proc", "grain_threads", "grain_mp", "torchdata", "titan", "titan_nw2", "limit"]

DIFFERENCES = """\
All contenders read the same JSONL shards, use the same tokenizer file (zephon's bundled
4096-vocab byte-level BPE, BOS and EOS added per document), pack greedily (documents concatenated
and split across rows, no padding) into rows of 2049 tokens giving `input`/`labels` of 2048, and
deliver batches of 8 rows to a consumer that does nothing. `TOKENIZERS_PARALLELISM=false`
everywhere. What differs:

- **"Threads"** means: zephon, N worker threads (`WorkerConfig(N, "thread")`) that read, parse
  and tokenize, while the consumer's thread runs the work source, pack, shuffle and batch; Grain
  (threads), `ReadOptions(num_threads=N)` with packing/shuffle/batch in the consumer's thread;
  Grain (mp_prefetch), N worker processes (`MultiprocessingOptions(num_workers=N)`) each running the
  whole pipeline on its slice (1 read thread each) and the parent interleaving their batches;
  torchdata.nodes, `ParallelMapper(num_workers=N, method="thread", in_order=True)` with the rest in
  the consumer's thread; TorchTitan, 1 = `num_workers=0` (everything in the main process),
  2 = `num_workers=1` (one worker process plus the main process); `num_workers=2` is shown
  separately because its `IterableDataset` is not sharded over workers: every row comes twice.
  The limit: N threads calling `encode_batch_fast` on documents already parsed into memory.
- **Tokenizer calls**: zephon, Grain, torchdata and the limit call `encode_batch_fast` on chunks of
  32 documents (zephon's default `chunk_size`; for Grain a `MapDataset.batch(32)` + map +
  `FlatMapIterDataset` unbatch, the fastest way to use the tokenizer from Grain). TorchTitan's
  loader calls `HuggingFaceTokenizer.encode` once per document (its own code, unchanged).
- **Source**: Grain 0.2.18 has no JSONL source (ArrayRecord, Parquet, TFRecord only); Grain and
  torchdata read through a line-offset index over mmapped files written here
  (`JsonlSource`, any object with `__len__`/`__getitem__` is a Grain data source). zephon uses its
  own index (cached under `.data/cache`); TorchTitan goes through `datasets.load_dataset` (JSON ->
  Arrow cache, built during the warm-up run, so its time to first batch is warm).
- **Shuffle**: zephon shuffles documents by its lane work plan and rows in a seeded window of 64
  rows **per lane** (8 lanes: 512 rows buffered before the first batch); Grain shuffles document
  indices globally (`MapDataset.shuffle`) and rows with `WindowShuffleIterDataset(window_size=64)`;
  torchdata reads a seeded permutation of documents and shuffles rows in a window of 64 (node
  written here); TorchTitan does not shuffle (a map-style `datasets.Dataset`, epoch 0 unshuffled).
- **Packing**: zephon `Pack(greedy)` with `flush_every=512` documents (a partial row is padded
  at each flush point: the padding share is in the table); Grain `ConcatThenSplitIterDataset`;
  torchdata a greedy packer written here (`GreedyPack`, no flush points); TorchTitan its own
  buffer (and labels never cross a document boundary).
- **Checkpoint**: zephon, lane-keyed JSON (what `state_dict()` returns); Grain, `get_state()` as
  JSON; torchdata, `Loader.state_dict()` pickled (the packer and shuffle written here keep their
  buffers in the state); TorchTitan, `state_dict()` pickled (it holds the packing buffer).
- **Elasticity**: only zephon's batches are the same for every data-parallel size; the others
  were run at one rank, where the question does not arise.
"""


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _f(x, fmt="{:.3f}", none="n/a"):
    return none if x is None else fmt.format(x)


def _bracket(data: dict[str, Any], key: str = "tokens_per_s") -> dict[tuple, dict[str, float]]:
    """(threads, round) -> contender -> zephon's ``key`` (tokens/s; images/s in the vision half)
    around it divided by its own (geometric mean of the zephon runs right before and after it in
    the same round)."""
    runs = defaultdict(list)
    for r in data["throughput"]:
        if "error" not in r:
            runs[(r["threads"], r["round"])].append(r)
    out: dict[tuple, dict[str, float]] = {}
    for tr, rs in runs.items():
        z = {r["slot"]: r[key] for r in rs if r["contender"] == "zephon"}
        d = {}
        for r in rs:
            if r["contender"] == "zephon":
                continue
            near = [z[k] for k in (r["slot"] - 1, r["slot"] + 1) if k in z] or list(z.values())
            if near:
                zbar = float(np.exp(np.mean(np.log(near))))
                d[r["contender"]] = zbar / r[key]
        out[tr] = d
    return out


def aggregate(data: dict[str, Any]) -> dict[str, Any]:
    by = defaultdict(list)  # (contender, threads) -> results
    for r in data["throughput"]:
        if "error" not in r:
            by[(r["contender"], r["threads"])].append(r)
    errors = [r for r in data["throughput"] if "error" in r]
    br = _bracket(data)
    agg: dict[str, Any] = {}
    for (c, t), rs in by.items():
        rounds = [d for (tt, _), d in br.items() if tt == t]
        if c == "zephon":
            ratios_z = [1.0]
            ratios_l = [d["limit"] for d in rounds if "limit" in d]
        else:
            ratios_z = [d[c] for d in rounds if c in d]
            # X / limit = (zephon/limit) / (zephon/X), both bracketed within the round
            ratios_l = [d["limit"] / d[c] for d in rounds if c in d and "limit" in d] if c != "limit" else [1.0]
        st = [r.get("state") or {} for r in rs]
        agg[f"{c}@{t}"] = {
            "contender": c,
            "threads": t,
            "n": len(rs),
            "tokens_per_s": _med([r["tokens_per_s"] for r in rs]),
            "min": min(r["tokens_per_s"] for r in rs),
            "max": max(r["tokens_per_s"] for r in rs),
            "zephon_over": _med(ratios_z),
            "of_limit": _med(ratios_l),
            "zephon_over_all": ratios_z,
            "of_limit_all": ratios_l,
            "ttfb_s": _med([r.get("ttfb_s") for r in rs]),
            "peak_rss_mb": _med([r.get("peak_rss_mb") for r in rs]),
            "cpu_s_per_mtok": _med([r.get("cpu_s_per_mtok") for r in rs]),
            "state_bytes": _med([s.get("bytes_per_rank") for s in st]),
            "state_format": (st[0].get("format") if st else None),
            "max_lane_bytes": _med([s.get("max_bytes_per_lane") for s in st]),
            "pad_frac": _med([r.get("pad_frac") for r in rs]),
        }
    return {"by": agg, "errors": errors}


def _wait_stats(w: dict[str, Any]) -> dict[str, float]:
    ws = sorted(w["waits"])
    n = len(ws)
    q = lambda p: ws[min(n - 1, int(p * n))]  # noqa: E731
    return {
        "median_ms": 1000 * statistics.median(ws),
        "p90_ms": 1000 * q(0.90),
        "p99_ms": 1000 * q(0.99),
        "max_ms": 1000 * ws[-1],
        "mean_ms": 1000 * sum(ws) / n,
        "over_1ms": sum(1 for x in ws if x > 0.001) / n,
        "slowdown": sum(ws) / n / (w["ms"] / 1000),
    }


def write_report(data: dict[str, Any], stem: str) -> str:
    from benchmarks.text_contenders import LABELS

    A = aggregate(data)
    by = A["by"]
    threads = data["plan"]["threads"]
    L: list[str] = []
    m, v, c = data["machine"], data["versions"], data["corpus"]
    L.append(f"# zephon text benchmark: `{data['size']}`\n")
    L.append(
        f"Produced by `python benchmarks/run.py --size {data['size']}` in {data['wall_s']:.0f} s"
        f"{' (in-process smoke run: peak RSS is the whole process)' if data.get('inprocess') else ''}.\n"
    )
    L.append(
        "**Noise**: this is a small shared VM; the same run repeated varies by up to ±20% in absolute "
        f"speed. Load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at the end "
        f"{', '.join(f'{x:.2f}' for x in m['loadavg_end'])} (on {m['cores']} cores; the benchmark's own runs use "
        "up to all of them, so a load near the core count is the benchmark itself). "
        "Each round runs every contender back to back in alternating order "
        "(A B C ... then ... C B A) and ratios are the median of per-round ratios, so most of the noise "
        "cancels in the ratios.\n"
    )
    L.append("## Machine, versions, settings\n")
    L.append(
        f"- CPU: {m['cpu']}, {m['cores']} cores (affinity {m['affinity']}), {m['memory_gib']} GiB; {m['platform']}"
    )
    L.append("- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    s = data["settings"]
    L.append(
        f"- Corpus: {c['docs']} synthetic web documents (`zephon.tools.synth`, style `web`), {c['bytes'] / 1e6:.1f} MB "
        f"of JSONL in {data['shards']} shards; tokenizer: bundled 4096-vocab byte-level BPE"
    )
    L.append(
        f"- seq_len {s['seq_len']}, batches of {s['batch_rows']} rows, zephon lanes {s['lanes']} "
        f"(world size 1), shuffle window {s['shuffle_rows']} rows, greedy packing"
    )
    p = data["plan"]
    L.append(
        f"- {p['rounds']} round(s); per run: time to first batch, {p.get('warmup', 0)} untimed warm-up batches "
        "(so that work prefetched while the first batch was made is used up: zephon's 64-row windows "
        "make the first batch do a whole window's work plus each lane's look-ahead), then "
        f"{p['steps']} batches timed "
        f"({p['steps'] * s['batch_rows'] * s['seq_len'] / 1e6:.1f} M tokens); tokens/s = rows x seq_len "
        "delivered per second to a consumer that does nothing; each run in a fresh process"
        f"{'' if not data.get('inprocess') else ' (here: in-process)'}"
    )
    if data["skipped"]:
        L.append("- Skipped (not installed): " + ", ".join(f"{k} ({w})" for k, w in data["skipped"].items()))
    L.append("")

    # ------------------------------------------------------------------ throughput
    L.append("## Throughput (median tokens/s) and ratios\n")
    L.append(
        "Every other contender ran between two zephon runs (Z X1 Z X2 ... Z, the order reversed each "
        "round). `zephon ÷ X` is the median over rounds of (geometric mean of the two zephon runs around X) "
        "/ X; `of limit` is X / limit through the same bracketed ratios (zephon's: the zephon runs "
        "around the limit's run / the limit). Per-round ratios are listed below the table.\n"
    )
    hdr = "| contender |" + "".join(f" {t} thr: M tok/s | zephon ÷ it | of limit |" for t in threads)
    L.append(hdr)
    L.append("|---|" + "---|---|---|" * len(threads))
    for cname in ORDER:
        cells = []
        present = False
        for t in threads:
            a = by.get(f"{cname}@{t}")
            if a is None:
                cells += ["-", "-", "-"]
                continue
            present = True
            rng = f" ({a['min'] / 1e6:.2f}-{a['max'] / 1e6:.2f})" if a["n"] > 1 else ""
            cells += [
                f"{a['tokens_per_s'] / 1e6:.3f}{rng}",
                "1" if cname == "zephon" else _f(a["zephon_over"], "{:.2f}x"),
                "1" if cname == "limit" else _f(a["of_limit"], "{:.2f}"),
            ]
        if present:
            L.append(f"| {LABELS.get(cname, cname)} | " + " | ".join(cells) + " |")
    L.append(
        "\n(M tok/s: median of all runs, min-max in parentheses; zephon ran once per bracket, so it has more runs.)\n"
    )
    for t in threads:
        for cname in ORDER:
            a = by.get(f"{cname}@{t}")
            if a and cname != "zephon" and a["zephon_over_all"]:
                L.append(
                    f"- {t} thr, zephon ÷ {LABELS.get(cname, cname)} per round: "
                    + ", ".join(f"{x:.2f}" for x in a["zephon_over_all"])
                )
    L.append("")
    for e in A["errors"]:
        L.append(f"- error: {e['contender']} at {e['threads']} thread(s), round {e['round'] + 1}: `{e['error'][:300]}`")

    # ------------------------------------------------------------------ ttfb / memory / state
    L.append("## Time to first batch, peak memory, checkpoint size\n")
    L.append(
        "Time to first batch: from building the loader (zephon: including `Recipe.prepare()` with a warm "
        "index cache) to the first batch in hand. Peak RSS: the process and all its children, sampled "
        "every 50 ms. Checkpoint: the loader's state for this rank after the timed run.\n"
    )
    L.append(
        "CPU s / M tokens: user + system CPU seconds of the process tree during the timed span per million "
        "tokens delivered: the cost of the work, much less sensitive to the machine being shared than "
        "tokens/s.\n"
    )
    L.append(
        "| contender | threads | first batch (s) | peak RSS (MB) | CPU s / M tokens | checkpoint bytes / rank | max bytes / lane | padding |"
    )
    L.append("|---|---|---|---|---|---|---|---|")
    for cname in ORDER:
        for t in threads:
            a = by.get(f"{cname}@{t}")
            if a is None:
                continue
            st = f"{a['state_bytes']:.0f} ({a['state_format']})" if a["state_bytes"] is not None else "-"
            L.append(
                f"| {LABELS.get(cname, cname)} | {t} | {_f(a['ttfb_s'], '{:.2f}', '-')} | "
                f"{_f(a['peak_rss_mb'], '{:.0f}')} | {_f(a['cpu_s_per_mtok'], '{:.2f}')} | {st} | {_f(a['max_lane_bytes'], '{:.0f}', '-')} | "
                f"{_f(a['pad_frac'], '{:.2%}', '-')} |"
            )
    L.append("")

    # ------------------------------------------------------------------ restore
    rs = data["restore"]
    L.append("## zephon: restore time vs step, checkpoint size\n")
    if rs.get("ok"):
        r = rs["result"]
        L.append(
            f"{r['threads']} worker threads, 8 lanes. A loader ran to each step, saved `state_dict()`, and "
            "kept the next batch; a fresh loader then loaded the state (median of "
            f"{data['plan']['restore_repeats']}) and produced its first batch, compared byte for byte. "
            f"For scale: a fresh start's first batch took {r['fresh_first_batch_s']:.2f} s.\n"
        )
        L.append(
            "| step | load_state_dict (s) | first batch after restore (s) | restore total (s) | batch identical "
            "| max bytes / lane | mean bytes / lane | bytes / rank (8 lanes + shared) |"
        )
        L.append("|---|---|---|---|---|---|---|---|")
        for pnt in r["points"]:
            L.append(
                f"| {pnt['step']} | {pnt['load_s']:.3f} | {pnt['first_batch_s']:.3f} | {pnt['restore_s']:.3f} | "
                f"{'yes' if pnt['identical'] else '**NO**'} | {pnt['max_lane_bytes']} | {pnt['mean_lane_bytes']:.0f} | {pnt['rank_bytes']} |"
            )
    else:
        L.append(f"restore measurement failed: `{rs.get('error')}`")
    L.append("")

    # ------------------------------------------------------------------ process workers
    L.extend(process_table(by, threads))

    # ------------------------------------------------------------------ lanes
    L.extend(lanes_section(data))

    # ------------------------------------------------------------------ waits
    L.append("## Consumer wait behind a fake training step\n")
    if data["waits"]:
        ms = data["waits"][0]["ms"]
        L.append(
            f"1 worker (thread, process or TorchTitan `num_workers=1`), a fake step of {ms} ms (`time.sleep`: "
            "the host thread idles while an accelerator computes) between batches, "
            f"{len(data['waits'][0]['waits'])} steps after the first batch. Wait = time spent in `next()`.\n"
        )
        L.append(
            "| contender | median (ms) | p90 (ms) | p99 (ms) | max (ms) | mean (ms) | steps waiting > 1 ms | loop slowed by |"
        )
        L.append("|---|---|---|---|---|---|---|---|")
        for w in data["waits"]:
            st = _wait_stats(w)
            L.append(
                f"| {LABELS.get(w['contender'], w['contender'])} | {st['median_ms']:.2f} | {st['p90_ms']:.2f} | "
                f"{st['p99_ms']:.1f} | {st['max_ms']:.0f} | {st['mean_ms']:.2f} | {st['over_1ms']:.0%} | {st['slowdown']:.1%} |"
            )
    L.append("")

    # ------------------------------------------------------------------ profile
    if data["profiles"]:
        L.append("## Profile of zephon's text path (py-spy)\n")
        L.append(
            "`py-spy record -r 200 --threads`, CPU-active samples of all threads during a throughput run. "
            "The tokenizer's Rust code is attributed to the Python line calling `encode_batch_fast` "
            "(`TextTokenizer._encodings`).\n"
        )
        for t, prof in sorted(data["profiles"].items(), key=lambda kv: int(kv[0])):
            if "error" in prof:
                L.append(f"- {t} thread(s): {prof['error']}")
                continue
            L.append(
                f"### {t} worker thread(s): {prof['samples']} samples, "
                f"{prof['tokens_per_s_under_profiler'] / 1e6:.3f} M tokens/s under the profiler\n"
            )
            L.append("Threads: " + ", ".join(f"{n} {p}%" for n, p in prof["threads"]) + "\n")
            L.extend(profile_table(prof))

    return finish_report(L, data, stem, DIFFERENCES, lambda png: plot(data, A, png))


def process_table(by: dict[str, Any], threads: list[int]) -> list[str]:
    """zephon's process workers (results through shared memory) against its thread workers."""
    L = ["## zephon: process workers vs thread workers\n"]
    if not any(f"zephon_proc@{t}" in by for t in threads):
        return L + ["(not measured)\n"]
    L.append(
        'The same pipeline with `WorkerConfig(N, "process")`: each chunk is tokenized in a worker '
        "process and its token arrays come back through the worker's shared-memory arena (views, no "
        "copy). Bracketed like every contender: the ratio is the process run over the geometric mean of "
        "the thread runs right before and after it, median over rounds.\n"
    )
    L.append("| workers | process ÷ thread (median) | per round | CPU s / M tok: threads | CPU s / M tok: processes |")
    L.append("|---|---|---|---|---|")
    for t in threads:
        a, z = by.get(f"zephon_proc@{t}"), by.get(f"zephon@{t}")
        if not a or not z:
            continue
        per = [1 / x for x in a["zephon_over_all"] if x]
        L.append(
            f"| {t} | {_f(_med(per), '{:.2f}x')} | {', '.join(f'{x:.2f}' for x in per)} | "
            f"{_f(z['cpu_s_per_mtok'], '{:.2f}')} | {_f(a['cpu_s_per_mtok'], '{:.2f}')} |"
        )
    return L + [""]


def lanes_section(data: dict[str, Any]) -> list[str]:
    """Throughput, start-up, restore and memory against the number of lanes on one rank."""
    L = ["## zephon: lanes per rank\n"]
    runs = [r for r in data["lanes"] if "error" not in r]
    for r in data["lanes"]:
        if "error" in r:
            L.append(f"- error: {r['lanes']} lanes, round {r['round'] + 1}: `{r['error'][:300]}`")
    if not runs:
        return L + [""]
    p = data["plan"]
    lb = p["lanes_batch"]
    big = p.get("lanes_big")
    L.append(
        f"World size 1, {' and '.join(map(str, p.get('lanes_threads', p['threads'])))} worker thread(s), global batch {lb} rows "
        f"(rows per lane = {lb} / lanes: {', '.join(f'{x}: {lb // x}' for x in p['lanes'])}), shuffle window "
        f"{runs[0]['kw'].get('shuffle_rows')} rows per lane, {p.get('lanes_warmup', 0)} warm-up batches, then "
        f"{p['lanes_steps']} batches timed ({p['lanes_steps'] * lb * 2048 / 1e6:.0f} M tokens: more than the "
        f"work queued at start, so start-up does not dominate), {p['lanes_rounds']} rounds in alternating "
        "order; `vs 8 lanes` is the median of per-round ratios. Each run then saves its state, keeps the "
        "next batch, and restores the state into a fresh loader: `restore` is `load_state_dict` plus the "
        "first batch, compared byte for byte. Memory: resident set of the process tree after the timed "
        f"span; per lane = (RSS at L lanes - RSS at {p['lanes'][0]} lanes) / (L - {p['lanes'][0]})."
        + (
            f" {big['lanes']} lanes ran once with a global batch of {big['batch']} rows (1 per lane), "
            f"{big['warmup']} warm-up and {big['steps']} timed batches."
            if big
            else ""
        )
        + "\n"
    )
    L.append(
        "| lanes | M tokens/s (min-max) | vs 8 lanes (per round) | CPU s / M tok | first batch (s) | restore (s) "
        "| restored batch identical | RSS steady (MB) | RSS per lane (MB) | max bytes / lane | bytes / rank |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    g: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        g[r["lanes"]].append(r)
    base_l = p["lanes"][0]
    base_rss = _med([r["rss_steady_mb"] for r in g.get(base_l, [])])
    by_round = {(r["round"], r["lanes"]): r for r in runs}
    for ln in sorted(g):
        rr = g[ln]
        tps = [r["tokens_per_s"] for r in rr]
        per = [
            by_round[(rnd, ln)]["tokens_per_s"] / by_round[(rnd, base_l)]["tokens_per_s"]
            for rnd in sorted({r["round"] for r in rr})
            if (rnd, base_l) in by_round and (ln != base_l) and not (big and ln == big["lanes"])
        ]
        rss = _med([r["rss_steady_mb"] for r in rr])
        per_lane = (rss - base_rss) / (ln - base_l) if ln != base_l and base_rss is not None else None
        L.append(
            f"| {ln} | {_med(tps) / 1e6:.3f} ({min(tps) / 1e6:.2f}-{max(tps) / 1e6:.2f}) | "
            f"{'1' if ln == base_l else (_f(_med(per), '{:.2f}') + ' (' + ', '.join(f'{x:.2f}' for x in per) + ')') if per else '-'} | "
            f"{_med([r['cpu_s_per_mtok'] for r in rr]):.2f} | {_med([r['ttfb_s'] for r in rr]):.1f} | "
            f"{_med([r['restore_s'] for r in rr]):.1f} | {'yes' if all(r['restore_identical'] for r in rr) else '**NO**'} | "
            f"{rss:.0f} | {_f(per_lane, '{:.2f}', '-')} | {_med([r['state']['max_bytes_per_lane'] for r in rr]):.0f} | "
            f"{_med([r['state']['bytes_per_rank'] for r in rr]):.0f} |"
        )
    loads = [r.get("loadavg_1m") for r in runs if r.get("loadavg_1m") is not None]
    if loads:
        L.append(f"\n1-minute load average at the start of these runs: {min(loads):.1f}-{max(loads):.1f}.")
    return L + [""]


def profile_table(prof: dict[str, Any], top: int = 12) -> list[str]:
    """Markdown rows: the top functions of a py-spy summary by self and by inclusive samples."""
    L = ["| self % | function | | inclusive % | function |", "|---|---|---|---|---|"]
    for (fs, ps), (fi, pi) in zip(prof["self"][:top], prof["inclusive"][:top]):
        L.append(f"| {ps} | `{fs}` | | {pi} | `{fi}` |")
    return L + [""]


def finish_report(
    L: list[str], data: dict[str, Any], stem: str, differences: str, plot_png: Callable[[str], None]
) -> str:
    """Append what differs (and the contenders' notes), write ``stem``.md / .json / .png."""
    L.append("## What differs between the contenders\n")
    L.append(differences)
    notes = {n for r in data["throughput"] for n in r.get("notes", [])}
    for n in sorted(notes):
        L.append(f"- note: {n}")
    md = stem + ".md"
    with open(md, "w") as f:
        f.write("\n".join(L) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1, default=str)
    stamp_files(stem + ".json", md)
    try:
        plot_png(stem + ".png")
    except ImportError as e:
        with open(md, "a") as f:
            f.write(f"\n(no plot: {e}; pip install matplotlib)\n")
    return md


def plot(data: dict[str, Any], A: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by = A["by"]
    threads = data["plan"]["threads"]
    fig, axs = plt.subplots(2, 4, figsize=(24, 10))
    names = [c for c in ORDER if any(f"{c}@{t}" in by for t in threads)]
    short = {
        "zephon": "zephon",
        "zephon_proc": "zephon proc",
        "grain_threads": "Grain thr",
        "grain_mp": "Grain mp",
        "torchdata": "torchdata",
        "titan": "Titan",
        "titan_nw2": "Titan nw=2",
        "limit": "limit",
    }

    ax = axs[0, 0]
    w = 0.8 / len(threads)
    for i, t in enumerate(threads):
        ys = [(by.get(f"{c}@{t}") or {}).get("tokens_per_s") or 0 for c in names]
        ax.bar(np.arange(len(names)) + i * w, [y / 1e6 for y in ys], w, label=f"{t} thread(s)")
    ax.set_xticks(np.arange(len(names)) + w * (len(threads) - 1) / 2, [short[c] for c in names], rotation=20)
    ax.set_ylabel("M tokens/s (median)")
    ax.set_title("Tokens/s delivered to an idle consumer")
    ax.legend()

    ax = axs[0, 1]
    others = [c for c in names if c not in ("zephon",)]
    for i, t in enumerate(threads):
        ys = []
        for c in others:
            a = by.get(f"{c}@{t}") or {}
            z = by.get(f"zephon@{t}") or {}
            ys.append(z.get("of_limit") if c == "limit" else a.get("zephon_over"))
        ax.bar(np.arange(len(others)) + i * w, [y or 0 for y in ys], w, label=f"{t} thread(s)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.9, color="r", lw=0.8, ls="--", label="0.9: target for zephon ÷ limit")
    ax.set_xticks(np.arange(len(others)) + w * (len(threads) - 1) / 2, [short[c] for c in others], rotation=20)
    ax.set_title("zephon ÷ contender (median per-round ratio)")
    ax.legend()

    ax = axs[0, 2]
    t = max(threads)
    tt = [(by.get(f"{c}@{t}") or {}).get("ttfb_s") for c in names if c != "limit"]
    rss = [(by.get(f"{c}@{t}") or {}).get("peak_rss_mb") for c in names if c != "limit"]
    xs = np.arange(len(tt))
    ax.bar(xs - 0.2, [y or 0 for y in tt], 0.4, label="first batch (s)")
    ax2 = ax.twinx()
    ax2.bar(xs + 0.2, [y or 0 for y in rss], 0.4, color="tab:orange", label="peak RSS (MB)")
    ax.set_xticks(xs, [short[c] for c in names if c != "limit"], rotation=20)
    ax.set_ylabel("time to first batch (s)")
    ax2.set_ylabel("peak RSS (MB)")
    ax.set_title(f"Time to first batch and peak memory ({t} threads)")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")

    ax = axs[1, 0]
    rs = data["restore"]
    if rs.get("ok"):
        pts = rs["result"]["points"]
        xs = np.arange(len(pts))
        ax.bar(xs - 0.2, [p["restore_s"] for p in pts], 0.4, label="restore: load + first batch (s)")
        ax.axhline(rs["result"]["fresh_first_batch_s"], color="k", ls="--", lw=0.8, label="fresh start, first batch")
        ax2 = ax.twinx()
        ax2.bar(
            xs + 0.2, [p["max_lane_bytes"] for p in pts], 0.4, color="tab:green", label="max checkpoint bytes / lane"
        )
        ax2.axhline(1024, color="tab:green", ls=":", lw=0.8)
        ax.set_xticks(xs, [f"step {p['step']}" for p in pts])
        ax.set_ylabel("seconds")
        ax2.set_ylabel("bytes per lane")
        ax.set_ylim(0, max(p["restore_s"] for p in pts) * 1.6)
        ax2.set_ylim(0, 1600)
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="upper right", fontsize=8)
    ax.set_title("zephon restore time and state size vs step (must be flat)")

    ax = axs[1, 1]
    g = defaultdict(list)
    for r in data["lanes"]:
        if "error" not in r:
            g[(r["lanes"], r["threads"])].append(r["tokens_per_s"])
    lanes = data["plan"]["lanes"]
    for t in threads:
        ys = [_med(g.get((ln, t), [])) for ln in lanes]
        ax.plot([str(x) for x in lanes], [(y or 0) / 1e6 for y in ys], marker="o", label=f"{t} thread(s)")
    for t in threads:
        lim = (by.get(f"limit@{t}") or {}).get("tokens_per_s")
        if lim:
            ax.axhline(lim / 1e6, ls=":", lw=0.8, color="gray")
    ax.set_xlabel("lanes per rank")
    ax.set_ylabel("M tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("zephon scaling with lanes per rank (dotted: limit)")
    ax.legend()

    ax = axs[1, 2]
    if data["waits"]:
        ws = data["waits"]
        ax.boxplot([np.array(w["waits"]) * 1000 for w in ws], whis=(0, 100))
        ax.set_xticks(range(1, len(ws) + 1), [short.get(w["contender"], w["contender"]) for w in ws], rotation=20)
        ax.set_yscale("symlog", linthresh=1)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("wait per step (ms, symlog)")
        ax.set_title(f"Consumer wait behind a {ws[0]['ms']} ms step, 1 worker")
    ax = axs[0, 3]
    for i, t in enumerate(threads):
        ys = [(by.get(f"{c}@{t}") or {}).get("cpu_s_per_mtok") or 0 for c in names]
        ax.bar(np.arange(len(names)) + i * w, ys, w, label=f"{t} thread(s)")
    ax.set_xticks(np.arange(len(names)) + w * (len(threads) - 1) / 2, [short[c] for c in names], rotation=20)
    ax.set_ylabel("CPU seconds per M tokens (lower is better)")
    ax.set_title("Cost: CPU time of the process tree per M tokens")
    ax.legend()

    ax = axs[1, 3]
    lab = [short.get(c, c) for c in names if c != "limit"]
    sb = [(by.get(f"{c}@{max(threads)}") or {}).get("state_bytes") or 0 for c in names if c != "limit"]
    ax.bar(range(len(sb)), sb)
    ax.set_yscale("log")
    ax.set_xticks(range(len(sb)), lab, rotation=20)
    ax.set_ylabel("bytes (log)")
    ax.set_title("Checkpoint bytes per rank (zephon: 8 lanes, JSON)")

    fig.suptitle(
        f"zephon text benchmark ({data['size']}); shared {data['machine']['cores']}-core machine, "
        f"{data['corpus']['bytes'] / 1e6:.0f} MB JSONL, seq_len 2048, batch 8"
    )
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
