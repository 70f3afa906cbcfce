"""A held-out mix of real text, steady state: zephon against the tokenizer-only limit (issue 35).

    python benchmarks/real_mix.py               # ~6 min on 2 cores; results/real_mix.{md,json}
    python benchmarks/real_mix.py --size smoke  # seconds

The corpus is this machine's own text, many small documents in three JSONL datasets: the CPython
standard library's sources (a file a document), manual pages (the English troff sources of
``/usr/share/man``, a page a document) and package documentation (``/usr/share/doc`` copyright
files and changelogs, the site-packages' README / LICENSE / .md / .rst / .txt files, a file a
document, cut at 64 KB). The machine has no fortune files. The tokenizer is Llama 3's kind: a
byte-level BPE with Llama 3's pre-tokenizer pattern and its 128,256-id vocabulary size (ids
stored at 32 bits), trained here on the *other* files of the same sources (held out: a file is
either in the training text or in the corpus, by a hash of its path), since nothing may come from
a model hub; its vocabulary reaches what that training text supports.

Each measurement runs in its own process over the same documents, steady state: zephon (16 lanes,
2 thread workers, rows of 2048 tokens, mixture 0.5 / 0.25 / 0.25) after ``warmup`` steps, timed
over ``steps`` steps (the lanes' first read-ahead and shuffle window are done before the clock
starts, as in a long training run); the limit: the same tokenizer alone on 2 threads over the
documents' texts already in memory, in chunks of 32. Rounds alternate limit / zephon without a
cache / zephon with a cold token cache / limit; ratios are taken within a round (the machine is
shared) and the median over rounds is reported. CPU time (user + system of the process) is the
steadier figure; wall time is listed too.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.common import machine, measured_parser, run_chunks, versions  # noqa: E402
from benchmarks.stamp import write_results  # noqa: E402

DATA = os.path.join(HERE, ".data")
SIZES = {
    "smoke": {"mb": 1.5, "warmup": 4, "steps": 8, "rounds": 1},
    "default": {"mb": 24.0, "warmup": 24, "steps": 96, "rounds": 3},
}
SEQ, LANES, VOCAB = 2048, 16, 128_256
CUT = 64 << 10
# Llama 3's pre-tokenizer pattern (tiktoken's cl100k kind)
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _read(path: str) -> str | None:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read(CUT)
        else:
            with open(path, "rb") as f:
                raw = f.read(CUT)
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, zlib.error):
        return None


def sources() -> dict[str, list[str]]:
    """The files of each dataset, sorted (deterministic on one machine)."""
    lib = os.path.dirname(os.__file__)
    site = [p for p in sys.path if p.endswith("site-packages")]
    docs = sorted(glob.glob("/usr/share/doc/*/copyright") + glob.glob("/usr/share/doc/*/changelog*.gz"))
    for s in site:
        for ext in ("md", "rst", "txt"):
            docs += sorted(glob.glob(os.path.join(s, "**", f"*.{ext}"), recursive=True))
    return {
        "code": sorted(glob.glob(os.path.join(lib, "**", "*.py"), recursive=True)),
        "man": sorted(glob.glob("/usr/share/man/man[1-8]/*.gz")),
        "docs": [p for p in docs if os.path.getsize(p) > 64],
    }


def held_out(path: str) -> bool:
    """A file is in the training text (True) or in the corpus (False), by a hash of its path."""
    return zlib.crc32(path.encode()) % 4 == 0


def corpus(mb: float) -> tuple[str, str]:
    """The corpus folder (three JSONL datasets) and the tokenizer folder, built once."""
    root = os.path.join(DATA, f"realmix_{mb:g}")
    tok_dir = os.path.join(DATA, "realmix_tokenizer")
    if not os.path.exists(os.path.join(root, "done")):
        os.makedirs(root, exist_ok=True)
        share = {"code": 0.5, "man": 0.25, "docs": 0.25}
        for name, paths in sources().items():
            budget, n, shard = mb * 1e6 * share[name], 0, 0
            os.makedirs(os.path.join(root, name), exist_ok=True)
            f = open(os.path.join(root, name, f"{shard:03d}.jsonl"), "w")
            for p in paths:
                if n >= budget:
                    break
                if held_out(p) or (text := _read(p)) is None or not text.strip():
                    continue
                f.write(json.dumps({"text": text, "source": p}) + "\n")
                n += len(text)
                if f.tell() > 1 << 20:
                    f.close()
                    shard += 1
                    f = open(os.path.join(root, name, f"{shard:03d}.jsonl"), "w")
            f.close()
        open(os.path.join(root, "done"), "w").close()
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        train_tokenizer(tok_dir)
    return root, tok_dir


def train_tokenizer(out: str) -> None:
    """A Llama-3-kind tokenizer trained on the held-out files (byte-level BPE, Llama 3's pattern)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        n = 0
        for paths in sources().values():
            for p in paths:
                if held_out(p) and (t := _read(p)):
                    n += len(t)
                    yield t
                if n > 40e6:
                    return

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": specials[1]}, f)


def recipe_dict(root: str, tok: str) -> dict:
    weights = {"code": 0.5, "man": 0.25, "docs": 0.25}
    return {
        "seed": 3,
        "lanes": LANES,
        "seq_len": SEQ,
        "global_batch_size": LANES,
        "cache_dir": os.path.join(root, "index"),
        "tokenizer": {"path": tok},
        "datasets": [{"name": n, "path": os.path.join(root, n, "*.jsonl"), "weight": w} for n, w in weights.items()],
        "shuffle": {"buffer": 8},
    }


def one(kind: str, root: str, tok_dir: str, warmup: int, steps: int) -> dict:
    """One measurement in this process: ``limit`` or ``zephon``."""
    from zephon import Recipe, WorkerConfig
    from zephon.data import token_cache
    from zephon.data.tokenizer import TextTokenizer

    if kind == "limit":
        tok = TextTokenizer(tok_dir)
        texts = []
        for n in ("code", "man", "docs"):
            for p in sorted(glob.glob(os.path.join(root, n, "*.jsonl"))):
                with open(p) as f:
                    texts += [json.loads(x)["text"] for x in f]
        chunks = [texts[i : i + 32] for i in range(0, len(texts), 32)]
        target = steps * LANES * SEQ
        got, wall, cpu = run_chunks(lambda c: sum(len(x) for x in tok.encode_batch(c)), chunks, 2, target, cpu_s)
        return {"tokens": got, "wall": wall, "cpu": cpu}
    r = Recipe.from_dict(recipe_dict(root, tok_dir), root)
    r.prepare()
    delivered = start = 0
    s0 = cpu_s()
    with r.global_loader(1, workers=WorkerConfig(2, "thread")) as g:
        for _ in range(warmup):
            start += int((next(g)["document_ids"] >= 0).sum())
        c0, t0 = cpu_s(), time.perf_counter()
        for _ in range(steps):
            b = next(g)
            delivered += int((b["document_ids"] >= 0).sum())
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    # from the loader's start: the first read-ahead and shuffle window included
    cache = token_cache()
    return {
        "tokens": delivered,
        "wall": wall,
        "cpu": cpu,
        "run_tokens": start + delivered,
        "run_cpu": cpu + c0 - s0,
        "cache": dict(cache.stats) if cache else None,
    }


def spawn(kind: str, root: str, tok: str, warmup: int, steps: int, cache: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("ZEPHON_TOKEN_CACHE", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
        env["ZEPHON_TOKEN_CACHE"] = cache
    cmd = [sys.executable, __file__, "--one", kind, "--root", root, "--tok", tok]
    cmd += ["--warmup", str(warmup), "--steps", str(steps)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"a measurement failed ({cmd}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def describe(root: str, tok_dir: str) -> dict:
    from zephon.data.tokenizer import TextTokenizer

    out: dict = {"vocab": TextTokenizer(tok_dir).vocab_size}
    for n in ("code", "man", "docs"):
        lens = []
        for p in glob.glob(os.path.join(root, n, "*.jsonl")):
            with open(p) as f:
                lens += [len(json.loads(x)["text"]) for x in f]
        out[n] = {"documents": len(lens), "mb": round(sum(lens) / 1e6, 2), "median_chars": int(statistics.median(lens))}
    return out


def report(rounds: list[dict], meta: dict) -> str:
    def per_tok(m: dict) -> float:
        return m["cpu"] / m["tokens"]

    cpu_no = [per_tok(r["limit"]) / per_tok(r["nocache"]) for r in rounds]
    cpu_cold = [per_tok(r["limit"]) / per_tok(r["cold"]) for r in rounds]
    wall_no = [
        (r["nocache"]["tokens"] / r["nocache"]["wall"]) / (r["limit"]["tokens"] / r["limit"]["wall"]) for r in rounds
    ]
    over = [per_tok(r["cold"]) / per_tok(r["nocache"]) - 1 for r in rounds]
    whole = [per_tok(r["limit"]) / (r["nocache"]["run_cpu"] / r["nocache"]["run_tokens"]) for r in rounds]
    hits = [
        r["cold"]["cache"]["hits"] / max(1, r["cold"]["cache"]["hits"] + r["cold"]["cache"]["misses"]) for r in rounds
    ]
    rows = []
    for i, r in enumerate(rounds):
        for k in ("limit", "nocache", "cold"):
            m = r[k]
            rows.append(
                f"| {i + 1} | {k} | {m['tokens']:,} | {m['tokens'] / m['wall']:,.0f} | {1e6 * per_tok(m):.3f} |"
            )
    c = meta["corpus"]
    lines = [
        "# A held-out mix of real text, steady state (issue 35)",
        "",
        f"Produced by `{meta['command']}` at commit {meta['commit']} in {meta['seconds']:.0f} s on "
        f"{meta['machine']['cpu']}, {meta['machine']['cores']} cores; load average at start "
        f"{meta['machine']['loadavg_start']}, at the end {meta['load_end']} (a shared machine: the CPU figures are "
        "the steadier ones).",
        "",
        f"Corpus: {c['code']['documents']:,} CPython standard-library files ({c['code']['mb']} MB, median "
        f"{c['code']['median_chars']:,} characters), {c['man']['documents']:,} manual pages ({c['man']['mb']} MB, median "
        f"{c['man']['median_chars']:,}), {c['docs']['documents']:,} package documents ({c['docs']['mb']} MB, median "
        f"{c['docs']['median_chars']:,}); tokenizer: Llama 3's kind (byte-level BPE, its pattern), trained here on held-out "
        f"files: {c['vocab']:,} ids. zephon: {LANES} lanes, 2 thread workers, rows of {SEQ} tokens, "
        f"{meta['warmup']} steps before the clock, {meta['steps']} timed; limit: the tokenizer alone on 2 threads.",
        "",
        f"**zephon vs the tokenizer-only limit (CPU per delivered token, median of {len(rounds)} rounds): "
        f"{statistics.median(cpu_no):.2f}x** without a cache (rounds: {', '.join(f'{x:.2f}' for x in cpu_no)}); "
        f"{statistics.median(cpu_cold):.2f}x with a cold token cache (writing every document it tokenizes; "
        f"{max(hits):.0%} of its lookups hit); "
        f"wall tokens/s {statistics.median(wall_no):.2f}x of the limit's. Cold-cache overhead (CPU per token vs the run "
        f"without a cache in the same round): {statistics.median(over):+.1%} (rounds: "
        f"{', '.join(f'{x:+.1%}' for x in over)}; target <= 3%). Counted from the loader's start instead (its first "
        f"{meta['warmup']} steps, which read ahead and fill the shuffle window, included: a run of "
        f"{meta['warmup'] + meta['steps']} steps): {statistics.median(whole):.2f}x without a cache.",
        "",
        "| round | run | tokens | tokens/s (wall) | CPU-us per token |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = measured_parser(SIZES, os.path.join(HERE, "results"))
    ap.add_argument("--tok", default="")
    ap.add_argument("--warmup", type=int, default=0)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.root, a.tok, a.warmup, a.steps)))
        return
    t0 = time.perf_counter()
    cfg = SIZES[a.size]
    meta = {"machine": machine(), "versions": versions(("zephon-loader", "tokenizers", "numpy"))}
    root, tok = corpus(cfg["mb"])
    cache = os.path.join(DATA, "realmix_cache")
    rounds = []
    for i in range(cfg["rounds"]):
        order = ["limit", "nocache", "cold"] if i % 2 == 0 else ["cold", "nocache", "limit"]
        got = {}
        for k in order:
            kind = "limit" if k == "limit" else "zephon"
            got[k] = spawn(kind, root, tok, cfg["warmup"], cfg["steps"], cache if k == "cold" else None)
        rounds.append(got)
    shutil.rmtree(cache, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    meta.update(
        command="python benchmarks/real_mix.py" + (f" --size {a.size}" if a.size != "default" else ""),
        commit=commit.stdout.strip(),
        seconds=time.perf_counter() - t0,
        load_end=os.getloadavg(),
        warmup=cfg["warmup"],
        steps=cfg["steps"],
        corpus=describe(root, tok),
    )
    name = "real_mix" if a.size == "default" else f"real_mix_{a.size}"
    text = report(rounds, meta)
    write_results(a.out, name, {"meta": meta, "rounds": rounds}, text)
    print(text)


if __name__ == "__main__":
    main()
