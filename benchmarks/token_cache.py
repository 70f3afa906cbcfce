"""The token cache (issue 35): second runs, ablations and concurrent jobs against the tokenizer.

    python benchmarks/token_cache.py              # ~5 min on a loaded 2-core machine; results/token_cache.{md,json}
    python benchmarks/token_cache.py --size smoke # seconds

The corpus is real text of many small documents: the CPython standard library's sources cut into
documents of 0.5-8 KB (a "code" dataset) and 2-16 KB (a "prose" dataset: its docstrings and
comments, by line), the bundled tokenizer (vocabulary < 65,536: ids stored as uint16), 16 lanes,
rows of 2048 tokens, 2 thread workers, steps for about 90 % of one pass over the corpus.

Every measurement runs in its own process and reports its wall time *and its CPU time*
(user + system of the process: the loader and its thread workers): the machine is shared, so
wall times are noisy and the CPU time is the steadier figure. Tokenizer work is also counted
exactly, as the tokens the tokenizer returned (its calls wrapped in the process).

* limit: the tokenizer alone on 2 threads over the documents' texts, already in memory;
* run 1 without a cache, run 1 with a cold cache (the overhead of writing it);
* run 2 (same recipe, warm), an ablation changing only weights, an ablation adding a regex filter;
* four concurrent jobs (different seeds) on one cold cache, and the same after ``zephon warm``.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.common import machine, measured_parser, versions  # noqa: E402
from benchmarks.stamp import write_results  # noqa: E402

DATA = os.path.join(HERE, ".data")
TOK = os.path.join(os.path.dirname(HERE), "zephon", "data", "assets", "tokenizer")
SIZES = {"smoke": {"mb": 0.5, "share": 0.9}, "default": {"mb": 3.0, "share": 0.9}}
SEQ, LANES = 2048, 16
CHAT_CONVERSATIONS, CHAT_STEPS = 6000, 12  # about 0.9 of a pass
SHORT_PAIRS = 6


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def corpus(mb: float) -> str:
    """Small documents of real text (seeded cuts of the standard library), two JSONL datasets."""
    from benchmarks.work import source_text

    root = os.path.join(DATA, f"tokcache_{mb:g}")
    if os.path.exists(os.path.join(root, "done")):
        return root
    import numpy as np

    os.makedirs(root, exist_ok=True)
    text = source_text(int(mb * 2e6))
    prose = "\n".join(ln.strip(" #\"'") for ln in text.splitlines() if ln.strip().startswith(("#", '"', "'")))
    rng = np.random.default_rng(35)
    for name, src, lo, hi, size in (("code", text, 500, 8000, mb * 0.6e6), ("prose", prose, 2000, 16000, mb * 0.4e6)):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        n, shard = 0, 0
        f = open(os.path.join(root, name, f"{shard:03d}.jsonl"), "w")
        while n < size:
            k = int(rng.integers(lo, hi))
            s = int(rng.integers(0, max(1, len(src) - k)))
            f.write(json.dumps({"text": src[s : s + k]}) + "\n")
            n += k
            if f.tell() > 512 << 10:
                f.close()
                shard += 1
                f = open(os.path.join(root, name, f"{shard:03d}.jsonl"), "w")
        f.close()
    open(os.path.join(root, "done"), "w").close()
    return root


def chat_corpus(n: int) -> str:
    """``n`` synthetic conversations (``zephon.tools.synth``), one JSONL chat dataset."""
    from zephon.tools.synth.chat import generate_conversations

    root = os.path.join(DATA, f"tokcache_chat_{n}")
    if not os.path.exists(os.path.join(root, "done")):
        os.makedirs(os.path.join(root, "chat"), exist_ok=True)
        with open(os.path.join(root, "chat", "000.jsonl"), "w") as f:
            for conv in generate_conversations(n, seed=35):
                f.write(json.dumps({"messages": conv}) + "\n")
        open(os.path.join(root, "done"), "w").close()
    return root


def chat_recipe_dict(root: str, variant: str) -> dict:
    """A chat recipe (ChatML without generation markers: each conversation rendered per prefix to
    find its assistant turns); ``variant`` "loss_on": an ablation training on the last turn only."""
    from zephon.data.chat import CHAT_TOKENIZER

    ds = {"name": "chat", "path": os.path.join(root, "chat", "*.jsonl"), "kind": "chat", "chat_template": "chatml"}
    ds |= {"long": "truncate_turns", "loss_on": "last" if variant == "loss_on" else "all"}
    return {
        "seed": 1,
        "lanes": LANES,
        "seq_len": SEQ,
        "global_batch_size": LANES,
        "cache_dir": os.path.join(root, "index"),
        "tokenizer": {"path": CHAT_TOKENIZER},
        "datasets": [ds],
        "pack": {"algorithm": "best_fit"},
        "shuffle": {"buffer": 8},
    }


def recipe_dict(root: str, variant: str, seed: int = 1) -> dict:
    weights = {"code": 0.7, "prose": 0.3} if variant != "weights" else {"code": 0.5, "prose": 0.5}
    d = {
        "seed": seed,
        "lanes": LANES,
        "seq_len": SEQ,
        "global_batch_size": LANES,
        "cache_dir": os.path.join(root, "index"),
        "tokenizer": {"path": TOK},
        "datasets": [{"name": n, "path": os.path.join(root, n, "*.jsonl"), "weight": w} for n, w in weights.items()],
        "shuffle": {"buffer": 8},
    }
    if variant == "filter":
        d["filters"] = [{"name": "no-todo", "kind": "regex", "pattern": "TODO", "action": "exclude"}]
    return d


def count_tokenizer() -> dict:
    from zephon.data.tokenizer import TextTokenizer

    got = {"tokenized": 0}
    lock = threading.Lock()
    for name in ("encode_batch", "encode_content"):
        fn = getattr(TextTokenizer, name)

        def counted(self, texts, _fn=fn):
            out = _fn(self, texts)
            with lock:
                got["tokenized"] += sum(len(x) for x in out)
            return out

        setattr(TextTokenizer, name, counted)
    return got


def one(kind: str, root: str, steps: int, variant: str, seed: int) -> dict:
    """One measurement in this process: ``limit`` or ``run``."""
    from zephon import Recipe, WorkerConfig
    from zephon.data import token_cache

    if kind == "limit":
        from benchmarks.common import run_chunks
        from zephon.data.tokenizer import TextTokenizer

        tok = TextTokenizer(TOK)
        texts = []
        for n in ("code", "prose"):
            for p in sorted(os.listdir(os.path.join(root, n))):
                with open(os.path.join(root, n, p)) as f:
                    texts += [json.loads(x)["text"] for x in f]
        chunks = [texts[i : i + 32] for i in range(0, len(texts), 32)]
        target = tok.count_tokens(texts)
        got, wall, cpu = run_chunks(lambda c: sum(len(x) for x in tok.encode_batch(c)), chunks, 2, target, cpu_s)
        return {"tokens": got, "wall": wall, "cpu": cpu, "tokenized": got}
    counts = count_tokenizer()
    if kind == "warm":
        from zephon.recipe.warm import warm_local

        r = Recipe.from_dict(recipe_dict(root, ""), root)
        r.prepare()  # as in the runs: indexing and token estimates are not counted
        counts["tokenized"] = 0
        c0, t0 = cpu_s(), time.perf_counter()
        got = warm_local(r, threads=2)
        return {
            **got,
            "documents": got["tokenized"],
            "wall": time.perf_counter() - t0,
            "cpu": cpu_s() - c0,
            "tokenized": counts["tokenized"],
        }
    cfg = chat_recipe_dict(root, variant) if kind == "chat" else recipe_dict(root, variant, seed)
    r = Recipe.from_dict(cfg, root)
    r.prepare()  # indexing and token estimates (cached on disk; estimates sample-tokenize): not timed
    counts["tokenized"] = 0
    c0, t0 = cpu_s(), time.perf_counter()
    delivered = 0
    settled = max(1, steps // 5)  # steps before the steady span: the lanes' first read-ahead and windows
    with r.global_loader(1, workers=WorkerConfig(2, "thread")) as g:
        for i in range(steps):
            if i == settled:
                s_cpu, s_tokens = cpu_s(), delivered
            b = next(g)
            delivered += int((b["document_ids"] >= 0).sum())
        steady = {"steady_cpu": cpu_s() - s_cpu, "steady_tokens": delivered - s_tokens, "settled": settled}
    cache = token_cache()
    if cache is not None:
        cache.flush(600)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    return {
        "tokens": delivered,
        "wall": wall,
        "cpu": cpu,
        "tokenized": counts["tokenized"],
        "stats": dict(cache.stats) if cache else None,
        **steady,
    }


def spawn(
    kind: str, root: str, steps: int, variant: str = "", seed: int = 1, cache: str | None = None
) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("ZEPHON_TOKEN_CACHE", None)
    if cache:
        env["ZEPHON_TOKEN_CACHE"] = cache
    cmd = [
        sys.executable,
        __file__,
        "--one",
        kind,
        "--root",
        root,
        "--steps",
        str(steps),
        "--variant",
        variant,
        "--seed",
        str(seed),
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


def result(p: subprocess.Popen) -> dict:
    out, _ = p.communicate()
    if p.returncode:
        raise RuntimeError(f"a measurement failed ({p.args})")
    return json.loads(out.strip().splitlines()[-1])


def measure(root: str, steps: int, cache: str) -> dict:
    res: dict = {}
    fresh = lambda: shutil.rmtree(cache, ignore_errors=True)  # noqa: E731
    res["limit"] = result(spawn("limit", root, steps))
    short = max(2, steps // 4)  # a quarter pass: no document is read twice, so a cold cache has no hits
    res["short_nocache"] = result(spawn("run", root, short))
    fresh()
    res["short_cold"] = result(spawn("run", root, short, cache=cache))
    res["short_nocache_again"] = result(spawn("run", root, short))
    res[
        "short_pairs"
    ] = []  # more (no cache, cold) pairs, the order alternating: the overhead is small beside the noise
    for i in range(SHORT_PAIRS):
        pair = {}
        for k in ("cold", "nocache") if i % 2 == 0 else ("nocache", "cold"):
            fresh()
            pair[k] = result(spawn("run", root, short, cache=cache if k == "cold" else None))
        res["short_pairs"].append(pair)
    res["run1_nocache"] = result(spawn("run", root, steps))
    fresh()
    res["run1_cold"] = result(spawn("run", root, steps, cache=cache))
    res["run1_nocache_again"] = result(spawn("run", root, steps))  # brackets the cold run (load drifts)
    res["run2_warm"] = result(spawn("run", root, steps, cache=cache))
    res["ablation_weights"] = result(spawn("run", root, steps, "weights", cache=cache))
    res["ablation_filter"] = result(spawn("run", root, steps, "filter", cache=cache))
    fresh()
    jobs = [spawn("run", root, steps, seed=s, cache=cache) for s in range(1, 5)]
    res["four_cold"] = [result(p) for p in jobs]
    fresh()
    res["warm_job"] = result(spawn("warm", root, steps, cache=cache))
    res["cache_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs)
    jobs = [spawn("run", root, steps, seed=s, cache=cache) for s in range(1, 5)]
    res["four_after_warm"] = [result(p) for p in jobs]
    croot = chat_corpus(CHAT_CONVERSATIONS)
    res["chat_nocache"] = result(spawn("chat", croot, CHAT_STEPS))
    fresh()
    res["chat_cold"] = result(spawn("chat", croot, CHAT_STEPS, cache=cache))
    res["chat_warm"] = result(spawn("chat", croot, CHAT_STEPS, cache=cache))
    res["chat_ablation_loss_on"] = result(spawn("chat", croot, CHAT_STEPS, "loss_on", cache=cache))
    return res


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def _per_tokenized(res: dict, lim_cpu: float) -> str:
    """The runs without a cache: the limit's CPU per token over theirs per token tokenized."""
    got = []
    for k in ("short_nocache", "short_nocache_again", "run1_nocache", "run1_nocache_again"):
        m = res[k]
        got.append(f"{k} {ratio(lim_cpu, m['cpu'] / max(m['tokenized'], 1))}x")
    return ", ".join(got)


def report(res: dict, meta: dict) -> str:
    lim = res["limit"]
    lim_rate = lim["tokens"] / lim["wall"]
    lim_cpu = lim["cpu"] / lim["tokens"]
    rows = []
    for k in (
        "short_nocache",
        "short_cold",
        "short_nocache_again",
        "run1_nocache",
        "run1_cold",
        "run1_nocache_again",
        "run2_warm",
        "ablation_weights",
        "ablation_filter",
        "chat_nocache",
        "chat_cold",
        "chat_warm",
        "chat_ablation_loss_on",
    ):
        m = res[k]
        st = m.get("stats") or {}
        seen = st.get("hits", 0) + st.get("misses", 0)
        steady = ratio(lim_cpu, m["steady_cpu"] / m["steady_tokens"]) if m.get("steady_tokens") else float("nan")
        rows.append(
            f"| {k} | {m['tokens'] / m['wall']:,.0f} | {ratio(m['tokens'] / m['wall'], lim_rate)}x | "
            f"{1e6 * m['cpu'] / m['tokens']:.2f} | {ratio(lim_cpu, m['cpu'] / m['tokens'])}x | {steady}x | "
            f"{m['tokenized']:,} | {m['tokenized'] / m['tokens']:.2f} | {st.get('hits', 0) / seen if seen else 0:.0%} |"
        )
    one_job = res["run1_nocache"]
    base_cpu = (res["short_nocache"]["cpu"] + res["short_nocache_again"]["cpu"]) / 2
    overs = [base_cpu and res["short_cold"]["cpu"] / base_cpu - 1]
    overs += [p["cold"]["cpu"] / p["nocache"]["cpu"] - 1 for p in res.get("short_pairs", [])]
    cold_over = statistics.median(overs)
    sc = res["short_cold"]["stats"]
    short_hits = sc["hits"] / max(1, sc["hits"] + sc["misses"])
    four_cold = sum(m["tokenized"] for m in res["four_cold"])
    four_warm = res["warm_job"]["tokenized"] + sum(m["tokenized"] for m in res["four_after_warm"])
    four_cold_cpu = sum(m["cpu"] for m in res["four_cold"])
    four_warm_cpu = res["warm_job"]["cpu"] + sum(m["cpu"] for m in res["four_after_warm"])
    tokens_cached = res["warm_job"]["tokens"]
    lines = [
        "# Token cache: second runs, ablations, concurrent jobs (issue 35)",
        "",
        f"Produced by `{meta['command']}` at commit {meta['commit']} in {meta['seconds']:.0f} s on {meta['machine']['cpu']}, "
        f"{meta['machine']['cores']} cores; load average at start {meta['machine']['loadavg_start']}, at the end "
        f"{meta['load_end']}. The machine is shared by other sessions: wall times are noisy; the CPU columns "
        "(user + system time of each run's process) are the steadier figures.",
        "",
        f"Corpus: {meta['corpus']}. Tokenizer-only limit: {lim_rate:,.0f} tokens/s wall on 2 threads, "
        f"{1e6 * lim_cpu:.2f} CPU-us per token. Each run: {meta['steps']} steps of {LANES} rows of {SEQ} tokens, "
        "2 thread workers.",
        "",
        "| run | tokens/s (wall) | vs limit (wall) | CPU-us per token | vs limit (CPU) | vs limit (CPU), steady "
        "| tokens tokenized | tokenized per delivered | cache hits |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "The CPU columns count from the loader's start (its construction, first read-ahead and shuffle window "
        f"included); `steady` counts the steps after the first fifth of the run (after {max(1, meta['steps'] // 5)} of "
        f"run 1's {meta['steps']} steps, {max(1, max(2, meta['steps'] // 4) // 5)} of the short run's "
        f"{max(2, meta['steps'] // 4)}), as a long training run sees it. "
        "Tokens are those delivered (not padding). A run tokenizes more than it delivers: its lanes read ahead "
        "(tasks of at most a few steps' estimated tokens in flight per lane, the shuffle window, the batches "
        "prefetched), and what is read ahead when a short run stops is tokenized but not delivered; `tokenized per "
        "delivered` says how much (at c4e1fff, with whole chunks of `[workers] chunk_size` documents in flight: "
        "3.16 for the short run, 1.94 for run 1). Without a "
        f"cache, CPU per *tokenized* token vs the limit: {_per_tokenized(res, lim_cpu)}.",
        "",
        f"* cold-run overhead (CPU of the quarter-pass run with a cold cache, {short_hits:.0%} hits, vs runs without a "
        f"cache: the table's bracketed one and {len(overs) - 1} more pairs, the order alternating; median): "
        f"{cold_over:+.1%} (target <= 3%; each: {', '.join(f'{x:+.1%}' for x in overs)}); a run of ~0.3 s CPU, so "
        "load noise is several percent either way. The steady-state figure on a larger corpus, a Llama-3-kind "
        "tokenizer: `real_mix.md`",
        f"* chat (a chat dataset of {CHAT_CONVERSATIONS:,} synthetic conversations, ChatML rendered per prefix to find "
        f"the assistant turns, {CHAT_STEPS} steps): CPU per delivered token without a cache "
        f"{1e6 * res['chat_nocache']['cpu'] / res['chat_nocache']['tokens']:.2f} us, cold "
        f"{1e6 * res['chat_cold']['cpu'] / res['chat_cold']['tokens']:.2f} us, warm "
        f"{1e6 * res['chat_warm']['cpu'] / res['chat_warm']['tokens']:.2f} us "
        f"({ratio(res['chat_nocache']['cpu'], res['chat_warm']['cpu'])}x less), an ablation training on the last turn "
        f"only {1e6 * res['chat_ablation_loss_on']['cpu'] / res['chat_ablation_loss_on']['tokens']:.2f} us "
        f"({ratio(res['chat_nocache']['cpu'], res['chat_ablation_loss_on']['cpu'])}x less); rendering, not the "
        "tokenizer, is most of a conversation's cost (the 'tokens tokenized' column counts text tokenizer calls only)",
        f"* cache size: {res['cache_bytes']:,} bytes for {tokens_cached:,} tokens = "
        f"{res['cache_bytes'] / max(tokens_cached, 1):.2f} bytes per token after `zephon warm` of every document "
        "(ids at uint16 plus a 48-byte header per entry)",
        f"* four concurrent jobs (seeds 1-4) on one cold cache: tokens tokenized {four_cold:,} = "
        f"{four_cold / max(one_job['tokenized'], 1):.2f}x one job's; process CPU {four_cold_cpu:.1f} s = "
        f"{four_cold_cpu / one_job['cpu']:.2f}x one job's",
        f"* `zephon warm` (2 threads, every document once) then the four jobs: tokens tokenized {four_warm:,} = "
        f"{four_warm / max(one_job['tokenized'], 1):.2f}x one job's (target <= 1.3x); process CPU {four_warm_cpu:.1f} s = "
        f"{four_warm_cpu / one_job['cpu']:.2f}x one job's",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = measured_parser(SIZES, os.path.join(HERE, "results"))
    ap.add_argument("--variant", default="")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.root, a.steps, a.variant, a.seed)))
        return
    t0 = time.perf_counter()
    meta = {"machine": machine(), "versions": versions(("zephon-loader", "tokenizers", "numpy"))}
    root = corpus(SIZES[a.size]["mb"])
    lim = result(spawn("limit", root, 0))
    steps = max(2, int(SIZES[a.size]["share"] * lim["tokens"] / (LANES * (SEQ + 1))))
    cache = os.path.join(DATA, "tokcache_folder")
    res = measure(root, steps, cache)
    shutil.rmtree(cache, ignore_errors=True)
    ndocs = sum(
        1 for d in ("code", "prose") for p in os.listdir(os.path.join(root, d)) for _ in open(os.path.join(root, d, p))
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
    ).stdout.strip()
    meta.update(
        command="python benchmarks/token_cache.py" + (f" --size {a.size}" if a.size != "default" else ""),
        commit=commit,
        seconds=time.perf_counter() - t0,
        load_end=os.getloadavg(),
        steps=steps,
        corpus=f"{ndocs:,} documents of CPython standard-library text ({SIZES[a.size]['mb']:g} MB), two JSONL datasets",
    )
    name = "token_cache" if a.size == "default" else f"token_cache_{a.size}"
    text = report(res, meta)
    write_results(a.out, name, {"meta": meta, "results": res}, text)
    print(text)


if __name__ == "__main__":
    main()
