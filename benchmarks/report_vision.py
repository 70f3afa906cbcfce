"""Turn the raw measurements of the vision half into vision_<size>.md, .png and .json."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Any

import numpy as np

if __name__ == "__main__":  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import _bracket, _f, _med, finish_report, profile_table

ORDER = ["zephon", "zephon_proc", "zephon_proc_noshm", "grain_threads", "grain_mp", "titan", "limit", "work"]
SHORT = {
    "zephon": "zephon",
    "zephon_proc": "zephon proc",
    "zephon_proc_noshm": "proc no shm",
    "grain_threads": "Grain thr",
    "grain_mp": "Grain mp",
    "titan": "Titan MM",
    "limit": "decode limit",
    "work": "work ref",
}
TARGETS = {"grain_threads": 1.0, "grain_mp": 1.0, "titan": 1.0}  # zephon ÷ X at least this
LIMIT_TARGET = 0.8  # zephon ÷ decode-only limit at least this
PROCESS_TARGET = 0.9  # zephon's process workers ÷ its thread workers at least this

DIFFERENCES = """\
All contenders read the same WebDataset tar shards (an image, `.jpg` or `.png`, and a `.txt`
caption per key), decode to RGB, resize bicubically to the Qwen-VL pixel budget (the same
`smart_resize` arithmetic everywhere: sides multiples of 32, `min_pixels <= h x w <= max_pixels`),
normalise with mean = std = 0.5 to float32, cut 2 x 16 x 16 patches in TorchTitan's block order
(each image repeated to `temporal_patch_size = 2` frames: `patch_dim = 1536`), tokenize the
caption with the same tokenizer file (zephon's bundled BPE plus the four Qwen-VL vision tokens),
lay a sample out as `[BOS] <|vision_start|> <|image_pad|> x N <|vision_end|> caption [EOS]`
(N = patches / 4), pack whole samples (never split) into rows and deliver batches of rows plus
`pixel_values` and `grid_thw` to a consumer that does nothing. No MRoPE positions (TorchTitan's
`build_mrope_positions = False`, zephon's `mrope = false`), no row shuffle (the issue's vision
work has none; zephon `[shuffle] buffer = 1`). What differs:

- **Workers.** zephon: N worker threads (`WorkerConfig(N, "thread")`; *process*: N worker
  processes) that read, decode, resize, patchify and tokenize chunks of 8 samples, while the
  consumer's thread runs the lanes' work sources, packing and batching. Grain (threads):
  `ReadOptions(num_threads=N, prefetch_buffer_size=64)` runs the per-sample map; packing and
  batching in the consumer's thread. Grain (mp_prefetch): N worker processes each running the
  whole pipeline on its slice (1 read thread each). TorchTitan: `num_workers = N` DataLoader worker
  processes, each running its `IterableDataset` (reading, decoding, tokenizing) *and* the collator;
  the main process only receives batches (its streaming dataset is sharded over the workers by
  tar file, so no sample comes twice). The limit: N threads calling `Image.open(bytes).convert("RGB")`
  on images already in memory (decode only: no resize, no normalisation, no patches, no tokens,
  no batches). The work reference: the same N threads doing the whole per-image work (decode,
  resize, normalise, patchify, caption tokens) with the image function zephon and Grain use, no
  packing or batching.
- **Image code.** zephon and Grain (and the work reference) call the same function,
  `zephon.nodes.images.preprocess_patches` (Pillow decode + EXIF transpose, Pillow bicubic resize,
  uint8 patchify, then one exact float32 table lookup per byte for the normalisation; bit-identical
  to normalising in float32 then patchifying, at about half the cost of those two steps), so the
  ratios measure the loaders, not two implementations of the image work. TorchTitan: its own `process_image` (uint8 -> torch, bicubic antialiased
  `interpolate` on uint8, float32, normalise) on PIL images decoded by `datasets`' `Image` feature,
  and `vision_to_patches` (einops) in its collator. torchvision is not installed (the only
  torchvision 0.28 wheel on PyPI is a CUDA build that does not load with this CPU torch), so the
  five torchvision functions TorchTitan calls come from a shim in `vision_contenders.py` that
  does what torchvision does on CPU (`pil_to_tensor`, `resize` = torch's native uint8 bicubic
  antialiased `interpolate`, `to_dtype`, `normalize`, `pad`). Its resize is therefore torch's,
  not Pillow's: the pixel values differ slightly, the work is the same.
- **Reading.** zephon: its own tar index (member offsets, image headers; cached under
  `.data/cache`), one `pread` per member. Grain 0.2.18 has no tar source: `WdsSource` here (a
  member-offset index over mmapped tars; any object with `__len__`/`__getitem__` is a Grain data
  source) with `MapDataset.shuffle` of the sample indices. TorchTitan: `datasets.load_dataset(
  "webdataset", streaming=True)` in file order (no shuffle), with the features given
  (`jpg`, `png`: `Image()`, `txt`) because the webdataset builder infers them from the first 5
  samples, which cannot hold both extensions; registered as an `MM_DATASETS` entry whose
  `sample_processor` is TorchTitan's `_process_cc12_wd_sample` taking the image from `.jpg` *or*
  `.png` (its own reads `.jpg` only), calling TorchTitan's `_process_mm_sample` unchanged.
- **Tokenizer calls.** zephon: one `encode_batch_fast` per chunk of 8 captions. Grain:
  `Tokenizer.encode` per caption. TorchTitan: `HuggingFaceTokenizer.encode` of the caption with
  the placeholder tokens spelt out as text (`<|image_pad|>` x N), per sample.
- **Packing.** zephon: `MMPack` first-fit into the lane's micro-batch (4 lanes x 1 row: a row is
  emitted when the next sample does not fit; padding to the row end), flush point every 512
  samples. Grain: `FirstFitPackIterDataset(length_struct={"tokens": seq_len + 1},
  num_packing_bins=rows, meta_features=("pixel_values", "grid_thw"))` (pixel arrays travel as
  per-row lists) then `batch(rows, batch_fn=...)` concatenating them. **TorchTitan: no packing**
  (`packing_buffer_size = 0`: one sample per row, padded to `seq_len`; it therefore runs 10 times
  as many batches, so that its timed span holds about as many images as the others'). Its packer
  (`MMSamplePacker`) cannot be used on this data: it emits a row only when the scanned samples
  fill it *exactly* (`current_length < max_seq_length` keeps the row in the buffer), so with
  ~190-token image samples its buffer grows until subset sums hit `seq_len`. Measured once on the
  `small` corpus with `packing_buffer_size = 32` and 2 workers: 49 s to the first batch, 9 GB RSS
  and a 5.9 GB checkpoint per rank (the buffered pixel tensors, in every worker's snapshot), more
  than this shared machine can give to a benchmark run.
- **Batch format.** zephon and Grain: `pixel_values` float32 `[patches in the batch, 1536]`
  (images concatenated). TorchTitan's collator pads every image to the batch's largest:
  `[images, max patches, 1536]` (more bytes per image than the others).
- **Checkpoint.** zephon: lane-keyed JSON (`state_dict()`; holds no buffered data); Grain:
  `get_state()` as JSON; TorchTitan: `state_dict()` pickled (with its packer on, the buffered
  samples, pixel tensors included, are in the state: see above).
- **Elasticity.** Only zephon's batches are the same for every data-parallel size; all ran at
  one rank.
"""


def aggregate(data: dict[str, Any]) -> dict[str, Any]:
    by = defaultdict(list)
    for r in data["throughput"]:
        if "error" not in r:
            by[(r["contender"], r["threads"])].append(r)
    errors = [r for r in data["throughput"] if "error" in r]
    br = _bracket(data, "images_per_s")
    agg: dict[str, Any] = {}
    for (c, t), rs in by.items():
        rounds = [d for (tt, _), d in br.items() if tt == t]
        if c == "zephon":
            over = [1.0]
            of_limit = [d["limit"] for d in rounds if "limit" in d]
            of_work = [d["work"] for d in rounds if "work" in d]
        else:
            over = [d[c] for d in rounds if c in d]
            of_limit = [d["limit"] / d[c] for d in rounds if c in d and "limit" in d]
            of_work = [d["work"] / d[c] for d in rounds if c in d and "work" in d]
        st = [r.get("state") or {} for r in rs]
        ips = [r["images_per_s"] for r in rs]
        agg[f"{c}@{t}"] = {
            "contender": c,
            "threads": t,
            "n": len(rs),
            "images_per_s": _med(ips),
            "min": min(ips),
            "max": max(ips),
            "tokens_per_s": _med([r.get("tokens_per_s") for r in rs]),
            "zephon_over": _med(over),
            "of_limit": _med(of_limit),
            "of_work": _med(of_work),
            "zephon_over_all": over,
            "of_limit_all": of_limit,
            "ttfb_s": _med([r.get("ttfb_s") for r in rs]),
            "peak_rss_mb": _med([r.get("peak_rss_mb") for r in rs]),
            "cpu_ms_per_image": _med([r.get("cpu_ms_per_image") for r in rs]),
            "state_bytes": _med([s.get("bytes_per_rank") for s in st]),
            "state_format": st[0].get("format") if st else None,
            "max_lane_bytes": _med([s.get("max_bytes_per_lane") for s in st]),
            "ignored_frac": _med([r.get("ignored_frac") for r in rs]),
            "images_per_batch": _med([r["images"] / r["steps"] for r in rs if r.get("steps")]),
            "load": _med([r.get("loadavg_1m") for r in rs]),
        }
    return {"by": agg, "errors": errors}


def write_vision_report(data: dict[str, Any], stem: str) -> str:
    from benchmarks.vision_contenders import VLABELS

    A = aggregate(data)
    by = A["by"]
    threads = data["plan"]["threads"]
    m, v, c, s, p = data["machine"], data["versions"], data["corpus"], data["settings"], data["plan"]
    L: list[str] = []
    L.append(f"# zephon vision-language benchmark: `{data['size']}`\n")
    L.append(
        f"Produced by `python benchmarks/run.py --only vision --size {data['size']}` in {data['wall_s']:.0f} s"
        f"{' (in-process smoke run: peak RSS is the whole process)' if data.get('inprocess') else ''}.\n"
    )
    loads = [r.get("loadavg_1m") for r in data["throughput"] if r.get("loadavg_1m") is not None]
    L.append(
        "**Noise**: this is a small shared VM; the same run repeated varies by up to ±20% in absolute "
        f"speed. Load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at the end "
        f"{', '.join(f'{x:.2f}' for x in m['loadavg_end'])} (on {m['cores']} cores)"
        + (
            f"; 1-minute load when each run started: median {_med(loads):.2f}, range {min(loads):.2f}-{max(loads):.2f}"
            if loads
            else ""
        )
        + " (the benchmark's own runs use up to all cores, so a load near the core count is the benchmark "
        "itself). Each round runs every contender between two "
        "zephon runs in alternating order and ratios are the median of per-round ratios, so most of the "
        "noise cancels in the ratios.\n"
    )

    # ------------------------------------------------------------------ headline
    L.append("## Headline\n")
    for t in threads:
        z = by.get(f"zephon@{t}")
        if not z:
            continue
        parts = [f"zephon {z['images_per_s']:.0f} images/s"]
        for cname in ("grain_threads", "grain_mp", "titan"):
            a = by.get(f"{cname}@{t}")
            if a and a["zephon_over"] is not None:
                parts.append(f"{a['zephon_over']:.2f}x {VLABELS[cname]} ({a['images_per_s']:.0f})")
        if z["of_limit"] is not None:
            parts.append(f"{z['of_limit']:.2f} of the decode-only limit")
        if z["of_work"] is not None:
            parts.append(f"{z['of_work']:.2f} of the per-image work done alone")
        L.append(f"- **{t} worker(s)**: " + "; ".join(parts) + ".")
    L.append("")
    L.append(
        "Targets (issues): zephon at least 1.0x Grain and TorchTitan's MMDataLoader, at least 0.8x the "
        "decode-only limit; its process workers at least 0.9x its thread workers.\n"
    )
    L.append("| target | " + " | ".join(f"{t} worker(s)" for t in threads) + " |")
    L.append("|---|" + "---|" * len(threads))
    for cname, goal in TARGETS.items():
        cells = []
        for t in threads:
            a = by.get(f"{cname}@{t}")
            r = a["zephon_over"] if a else None
            cells.append("n/a" if r is None else f"{r:.2f}x {'met' if r >= goal else '**not met**'}")
        L.append(f"| zephon ÷ {VLABELS[cname]} >= {goal:.1f} | " + " | ".join(cells) + " |")
    cells = []
    for t in threads:
        z = by.get(f"zephon@{t}")
        r = z["of_limit"] if z else None
        cells.append("n/a" if r is None else f"{r:.2f} {'met' if r >= LIMIT_TARGET else '**not met**'}")
    L.append(f"| zephon ÷ decode-only limit >= {LIMIT_TARGET} | " + " | ".join(cells) + " |")
    cells = []
    for t in threads:
        a = by.get(f"zephon_proc@{t}")
        r = 1 / a["zephon_over"] if a and a["zephon_over"] else None
        cells.append("n/a" if r is None else f"{r:.2f}x {'met' if r >= PROCESS_TARGET else '**not met**'}")
    L.append(f"| zephon process workers ÷ thread workers >= {PROCESS_TARGET} | " + " | ".join(cells) + " |")
    L.append("")
    for t in threads:
        wk = by.get(f"work@{t}")
        if wk and wk["of_limit"]:
            L.append(
                f"- {t} worker(s): the per-image work done alone, with no loader at all, runs at "
                f"{wk['of_limit']:.2f} of the decode-only limit (CPU {_f(wk['cpu_ms_per_image'], '{:.1f}')} ms "
                f"per image against {_f((by.get(f'limit@{t}') or {}).get('cpu_ms_per_image'), '{:.1f}')} ms for the "
                "decode): resizing to the pixel budget, normalising and copying patches cost several times the "
                "decode, so no loader doing this work can reach 0.8 of the decode-only limit on these images; "
                "the work reference is the meaningful ceiling."
            )
    L.append("")

    # ------------------------------------------------------------------ settings
    L.append("## Machine, versions, settings\n")
    L.append(
        f"- CPU: {m['cpu']}, {m['cores']} cores (affinity {m['affinity']}), {m['memory_gib']} GiB; {m['platform']}"
    )
    L.append("- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    L.append(
        f"- Corpus: {c['images']} synthetic image-caption pairs ({c['jpg']} JPEG photo-like, {c['png']} PNG "
        f"graphics-like; sides {c['min_side']}-{c['max_side']} px, mean {c['mean_pixels'] / 1e3:.0f} k pixels), "
        f"{c['bytes'] / 1e6:.1f} MB in {data['shards']} WebDataset tar shards (`benchmarks/corpus.py`); captions of "
        "8-37 words"
    )
    L.append(
        f"- seq_len {s['seq_len']}, batches of {s['batch_rows']} rows (zephon: {s['lanes']} lanes x 1 row, world "
        f"size 1); patch {s['patch_size']}, temporal patch {s['temporal_patch_size']}, merge {s['merge_size']}; "
        f"pixel budget {s['min_pixels']}-{s['max_pixels']} pixels ({int(s['min_pixels'] ** 0.5)}²-"
        f"{int(s['max_pixels'] ** 0.5)}²); mean = std = 0.5; at most {s['max_images_per_batch']} images per batch"
    )
    L.append(
        f"- {p['rounds']} round(s); per run: time to first batch, {p.get('warmup', 0)} untimed warm-up batches, "
        f"then {p['steps']} batches timed; images/s = images in the timed batches / seconds, delivered to a "
        "consumer that does nothing; tokens/s = rows x seq_len per second; each run in a fresh process"
        f"{'' if not data.get('inprocess') else ' (here: in-process)'}. The limit and the work reference run "
        f"until {p['target_images']} images."
    )
    if data["skipped"]:
        L.append("- Skipped (not installed): " + ", ".join(f"{k} ({w})" for k, w in data["skipped"].items()))
    L.append("")

    # ------------------------------------------------------------------ throughput
    L.append("## Throughput (median images/s) and ratios\n")
    L.append(
        "Every other contender ran between two zephon runs (Z X1 Z X2 ... Z, the order reversed each round). "
        "`zephon ÷ it` is the median over rounds of (geometric mean of the two zephon runs around X) / X; "
        "`of limit` and `of work` are X / the decode-only limit and X / the per-image work reference through "
        "the same bracketed ratios.\n"
    )
    L.append(
        "| contender |" + "".join(f" {t} w: images/s | M tok/s | zephon ÷ it | of limit | of work |" for t in threads)
    )
    L.append("|---|" + "---|---|---|---|---|" * len(threads))
    for cname in ORDER:
        cells, present = [], False
        for t in threads:
            a = by.get(f"{cname}@{t}")
            if a is None:
                cells += ["-"] * 5
                continue
            present = True
            rng = f" ({a['min']:.0f}-{a['max']:.0f})" if a["n"] > 1 else ""
            cells += [
                f"{a['images_per_s']:.1f}{rng}",
                "-" if cname in ("limit", "work") else _f((a["tokens_per_s"] or 0) / 1e6, "{:.3f}"),
                "1" if cname == "zephon" else _f(a["zephon_over"], "{:.2f}x"),
                "1" if cname == "limit" else _f(a["of_limit"], "{:.2f}"),
                "1" if cname == "work" else _f(a["of_work"], "{:.2f}"),
            ]
        if present:
            L.append(f"| {VLABELS.get(cname, cname)} | " + " | ".join(cells) + " |")
    L.append(
        "\n(images/s: median of all runs, min-max in parentheses; zephon ran once per bracket, so it has more runs.)\n"
    )
    for t in threads:
        for cname in ORDER:
            a = by.get(f"{cname}@{t}")
            if a and cname != "zephon" and a["zephon_over_all"]:
                L.append(
                    f"- {t} w, zephon ÷ {VLABELS.get(cname, cname)} per round: "
                    + ", ".join(f"{x:.2f}" for x in a["zephon_over_all"])
                )
    L.append("")
    for e in A["errors"]:
        L.append(f"- error: {e['contender']} at {e['threads']} worker(s), round {e['round'] + 1}: `{e['error'][:300]}`")
    if A["errors"]:
        L.append("")

    # ------------------------------------------------------------------ process workers
    L.extend(process_section(data, by, threads))

    # ------------------------------------------------------------------ scaling
    if len(threads) > 1:
        t0, t1 = threads[0], threads[-1]
        L.append(f"## Scaling with workers ({t0} -> {t1})\n")
        L.append(f"| contender | {t0} w: images/s | {t1} w: images/s | speed-up |")
        L.append("|---|---|---|---|")
        for cname in ORDER:
            a, b = by.get(f"{cname}@{t0}"), by.get(f"{cname}@{t1}")
            if a and b:
                L.append(
                    f"| {VLABELS.get(cname, cname)} | {a['images_per_s']:.1f} | {b['images_per_s']:.1f} | "
                    f"{b['images_per_s'] / a['images_per_s']:.2f}x |"
                )
        L.append("")

    # ------------------------------------------------------------------ ttfb / memory / state
    L.append("## Time to first batch, peak memory, CPU per image, checkpoint size\n")
    L.append(
        "Time to first batch: from building the loader (zephon: including `Recipe.prepare()` with a warm index "
        "cache) to the first batch in hand. Peak RSS: the process and all its children, sampled every 50 ms. "
        "CPU ms / image: user + system CPU of the process tree during the timed span per image delivered (less "
        "sensitive to the shared machine than images/s). Checkpoint: the loader's state for this rank after "
        "the timed run. Ignored labels: share of label positions that are -100 (image placeholders and "
        "padding).\n"
    )
    L.append(
        "| contender | workers | first batch (s) | peak RSS (MB) | CPU ms / image | images / batch | checkpoint bytes / rank | ignored labels |"
    )
    L.append("|---|---|---|---|---|---|---|---|")
    for cname in ORDER:
        for t in threads:
            a = by.get(f"{cname}@{t}")
            if a is None:
                continue
            st = f"{a['state_bytes']:.0f} ({a['state_format']})" if a["state_bytes"] is not None else "-"
            L.append(
                f"| {VLABELS.get(cname, cname)} | {t} | {_f(a['ttfb_s'], '{:.2f}', '-')} | "
                f"{_f(a['peak_rss_mb'], '{:.0f}')} | {_f(a['cpu_ms_per_image'], '{:.2f}')} | "
                f"{_f(a['images_per_batch'], '{:.1f}', '-')} | {st} | {_f(a['ignored_frac'], '{:.1%}', '-')} |"
            )
    L.append("")

    # ------------------------------------------------------------------ profile
    if data.get("profiles"):
        L.append("## Profile of zephon's vision path (py-spy)\n")
        L.append(
            "`py-spy record -r 200 --threads`, CPU-active samples of all threads during a throughput run. "
            "Pillow's and numpy's C code is attributed to the Python line that calls it; the table of lines "
            "tells decode (`im.load()`), resize (`im.resize`), normalisation and patch copies apart.\n"
        )
        for t, prof in sorted(data["profiles"].items(), key=lambda kv: int(kv[0])):
            if "error" in prof:
                L.append(f"- {t} worker(s): {prof['error']}")
                continue
            L.append(
                f"### {t} worker thread(s): {prof['samples']} samples, "
                f"{prof['images_per_s_under_profiler']:.1f} images/s under the profiler\n"
            )
            L.append("Threads: " + ", ".join(f"{n} {q}%" for n, q in prof["threads"]) + "\n")
            L.append("| self % | line | source |")
            L.append("|---|---|---|")
            for fn, src, q in prof.get("lines", [])[:15]:
                L.append(f"| {q} | `{fn}` | `{src.replace('|', '/')}` |")
            L.append("")
            L.extend(profile_table(prof))

    return finish_report(L, data, stem, DIFFERENCES, lambda png: plot(data, A, png))


def process_section(data: dict[str, Any], by: dict[str, Any], threads: list[int]) -> list[str]:
    """zephon's process workers, results through shared memory or pickled, against its threads."""
    from benchmarks.vision_contenders import VLABELS

    L = ["## zephon: process workers vs thread workers\n"]
    if not any(f"zephon_proc@{t}" in by for t in threads):
        return L + ["(not measured)\n"]
    L.append(
        'The same pipeline with `WorkerConfig(N, "process")`: with shared memory (the default) each '
        "worker writes a chunk's patches and token arrays into its arena once and the consumer gets views; "
        "with `shm_mb = 0` every result is pickled through the pipe (what process workers did before). "
        "Bracketed like every contender; ratio = the process run / the thread runs around it, median over "
        "rounds (target: >= 0.9x with shared memory).\n"
    )
    L.append(
        "| workers | contender | process ÷ thread (median) | per round | CPU ms / image | thread CPU ms / image "
        "| results via shm / pickled | peak live arena MB | arena pages touched MB |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|")
    for t in threads:
        z = by.get(f"zephon@{t}")
        for cname in ("zephon_proc", "zephon_proc_noshm"):
            a = by.get(f"{cname}@{t}")
            if not a or not z:
                continue
            per = [1 / x for x in a["zephon_over_all"] if x]
            runs = [r for r in data["throughput"] if r.get("contender") == cname and r.get("threads") == t]
            pools = [p for r in runs for p in r.get("pools", [])]
            shm = sum(p.get("shm_results", 0) for p in pools)
            inband = sum(p.get("inband_results", 0) for p in pools)
            via = f"{shm} / {inband}" if any(p.get("shm") == "on" for p in pools) else "off: all pickled"
            peak = _med([p.get("peak_live_bytes") for p in pools if "peak_live_bytes" in p])
            touched = _med([p.get("touched_bytes") for p in pools if "touched_bytes" in p])
            L.append(
                f"| {t} | {VLABELS[cname]} | {_f(_med(per), '{:.2f}x')} | {', '.join(f'{x:.2f}' for x in per)} | "
                f"{_f(a['cpu_ms_per_image'], '{:.2f}')} | {_f(z['cpu_ms_per_image'], '{:.2f}')} | "
                f"{via} | {_f(peak and peak / 2**20, '{:.0f}', '-')} | "
                f"{_f(touched and touched / 2**20, '{:.0f}', '-')} |"
            )
    return L + [""]


def rewrite(json_path: str) -> str:
    """Redraw the .md and .png of a results file from its .json (after a change to this module)."""
    with open(json_path) as f:
        data = json.load(f)
    return write_vision_report(data, json_path[: -len(".json")])


def plot(data: dict[str, Any], A: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = A["by"]
    threads = data["plan"]["threads"]
    names = [c for c in ORDER if any(f"{c}@{t}" in by for t in threads)]
    fig, axs = plt.subplots(2, 3, figsize=(20, 10))
    w = 0.8 / len(threads)

    ax = axs[0, 0]
    for i, t in enumerate(threads):
        ys = [(by.get(f"{c}@{t}") or {}).get("images_per_s") or 0 for c in names]
        ax.bar(np.arange(len(names)) + i * w, ys, w, label=f"{t} worker(s)")
    ax.set_xticks(np.arange(len(names)) + w * (len(threads) - 1) / 2, [SHORT[c] for c in names], rotation=20)
    ax.set_ylabel("images/s (median)")
    ax.set_title("Images/s delivered to an idle consumer")
    ax.legend()

    ax = axs[0, 1]
    others = [c for c in names if c != "zephon"]
    for i, t in enumerate(threads):
        z = by.get(f"zephon@{t}") or {}
        ys = []
        for c in others:
            if c == "limit":
                ys.append(z.get("of_limit"))
            elif c == "work":
                ys.append(z.get("of_work"))
            else:
                ys.append((by.get(f"{c}@{t}") or {}).get("zephon_over"))
        ax.bar(np.arange(len(others)) + i * w, [y or 0 for y in ys], w, label=f"{t} worker(s)")
    ax.axhline(1.0, color="k", lw=0.8, label="1.0: target vs Grain / TorchTitan")
    ax.axhline(LIMIT_TARGET, color="r", lw=0.8, ls="--", label=f"{LIMIT_TARGET}: target vs decode limit")
    ax.set_xticks(np.arange(len(others)) + w * (len(threads) - 1) / 2, [SHORT[c] for c in others], rotation=20)
    ax.set_title("zephon ÷ contender (median per-round ratio)")
    ax.legend(fontsize=8)

    ax = axs[0, 2]
    for c in [n for n in names if n != "limit"]:  # the decode-only limit is 5-7x higher: in the table
        ys = [(by.get(f"{c}@{t}") or {}).get("images_per_s") for t in threads]
        if all(y is not None for y in ys):
            ax.plot(
                [str(t) for t in threads], ys, marker="o", label=SHORT[c], ls=":" if c in ("limit", "work") else "-"
            )
    ax.set_xlabel("workers")
    ax.set_ylabel("images/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Scaling with workers (decode-only limit left out: see the table)")
    ax.legend(fontsize=8)

    t = max(threads)
    loaders = [c for c in names if c not in ("limit", "work")]
    ax = axs[1, 0]
    xs = np.arange(len(loaders))
    ax.bar(xs - 0.2, [(by.get(f"{c}@{t}") or {}).get("ttfb_s") or 0 for c in loaders], 0.4, label="first batch (s)")
    ax2 = ax.twinx()
    ax2.bar(
        xs + 0.2,
        [(by.get(f"{c}@{t}") or {}).get("peak_rss_mb") or 0 for c in loaders],
        0.4,
        color="tab:orange",
        label="peak RSS (MB)",
    )
    ax.set_xticks(xs, [SHORT[c] for c in loaders], rotation=20)
    ax.set_ylabel("time to first batch (s)")
    ax2.set_ylabel("peak RSS (MB)")
    ax.set_title(f"Time to first batch and peak memory ({t} workers)")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")

    ax = axs[1, 1]
    for i, tt in enumerate(threads):
        ys = [(by.get(f"{c}@{tt}") or {}).get("cpu_ms_per_image") or 0 for c in names]
        ax.bar(np.arange(len(names)) + i * w, ys, w, label=f"{tt} worker(s)")
    ax.set_xticks(np.arange(len(names)) + w * (len(threads) - 1) / 2, [SHORT[c] for c in names], rotation=20)
    ax.set_ylabel("CPU ms per image (lower is better)")
    ax.set_title("Cost: CPU time of the process tree per image")
    ax.legend()

    ax = axs[1, 2]
    sb = [(by.get(f"{c}@{t}") or {}).get("state_bytes") or 0 for c in loaders]
    ax.bar(range(len(sb)), sb)
    ax.set_yscale("log")
    ax.set_xticks(range(len(sb)), [SHORT[c] for c in loaders], rotation=20)
    ax.set_ylabel("bytes (log)")
    ax.set_title(f"Checkpoint bytes per rank ({t} workers)")

    c = data["corpus"]
    s = data["settings"]
    fig.suptitle(
        f"zephon vision-language benchmark ({data['size']}); shared {data['machine']['cores']}-core machine, "
        f"{c['images']} images ({c['jpg']} JPEG / {c['png']} PNG), seq_len {s['seq_len']}, "
        f"batch {s['batch_rows']} rows, pixels {s['min_pixels']}-{s['max_pixels']}"
    )
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


if __name__ == "__main__":  # python benchmarks/report_vision.py benchmarks/results/vision_small.json
    print(rewrite(sys.argv[1]))
