"""The node's token cache (issue 35): batches are byte-identical with the cache absent, cold,
warm, partial or corrupted (inline, thread and process workers; W = 1, 2, 4; after a resume on
another W; both split modes); a changed shard or tokenizer never reads a stale entry; two
processes writing at once leave a valid cache; a torn append is repaired; the size cap evicts;
an unusable folder means no cache and one warning; ids are stored at the tokenizer's width."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
from text_fixtures import hashes_without_token_cache, use_token_cache_folder, write_corpus, write_recipe

from zephon import Recipe, WorkerConfig
from zephon.data import TextTokenizer, token_cache
from zephon.data.datasets import tokenblock
from zephon.data.datasets import tokencache as tc
from zephon.recipe.warm import warm_local
from zephon.tools.cli import run_hashes

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
STEPS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokcorpus")
    write_corpus(str(root), scale=0.02)
    return root


@pytest.fixture(scope="module")
def recipe_path(corpus):
    return write_recipe(str(corpus), "tok.toml", buffer=4)


@pytest.fixture
def recipe(recipe_path, folder):
    """The recipe, built with the test's cache folder set (a pipeline reads the setting when it is built)."""
    return Recipe.from_toml(recipe_path)


@pytest.fixture(scope="module")
def baseline(recipe_path):
    """The batches without a token cache (any W and worker count gives these)."""
    return hashes_without_token_cache(recipe_path, STEPS)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    return use_token_cache_folder(tmp_path, monkeypatch)


def blocks(folder) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(folder / "blocks"):
        out += [os.path.join(dirpath, n) for n in names]
    return sorted(out)


def run(recipe, world, workers, steps=STEPS, **kw):
    got = run_hashes(recipe, world_size=world, steps=steps, workers=workers, out=io.StringIO(), **kw)
    cache = token_cache()
    assert cache is not None
    cache.flush()
    return got, dict(cache.stats)


def valid(path: str) -> bool:
    """Every byte of block ``path`` is a complete frame whose CRC matches."""
    with open(path, "rb") as f:
        buf = f.read()
    tag = bytes.fromhex(os.path.basename(path)[:16])
    b = tc._Block(path, tag)
    b.fd = os.open(path, os.O_RDONLY)
    try:
        end = b.parse(buf, 0)
        return end == len(buf) and all(b.read(k) is not None for k in list(b.entries))
    finally:
        b.close()


WORKERS = [(1, WorkerConfig(0)), (2, WorkerConfig(2, "thread")), (4, WorkerConfig(2, "process"))]


@pytest.mark.parametrize("world,workers", WORKERS, ids=["W1-inline", "W2-thread", "W4-process"])
def test_batches_are_the_same_cold_then_warm(recipe, baseline, folder, world, workers):
    before = dict(token_cache().stats)
    got, _ = run(recipe, world, workers)  # cold
    assert got == baseline
    assert blocks(folder), "the cold run wrote nothing"
    assert all(valid(p) for p in blocks(folder))
    for w2, wk2 in WORKERS:  # warm, on every worker kind and W
        got, stats = run(recipe, w2, wk2)
        assert got == baseline, (w2, wk2)
    if workers.backend != "process":  # this process did the tokenizing: the warm runs were all hits
        assert stats["hits"] > before["hits"] and stats["corrupt"] == 0


def test_a_warm_run_tokenizes_nothing(recipe, baseline, folder):
    # no batches computed ahead: how far a prefetching run reads past its last step is timing
    # (tasks end at a few steps' tokens, not at whole chunks), so the second run could read
    # further than the first did
    recipe = recipe.replace(workers={**recipe.raw.get("workers", {}), "prefetch": 0})
    run(recipe, 1, WorkerConfig(0))
    cache = token_cache()
    misses = cache.stats["misses"]
    got, stats = run(recipe, 1, WorkerConfig(0))  # the same run again: every document in the cache
    assert got == baseline
    assert stats["misses"] == misses  # every document of the second run came from the cache


def test_a_partial_cache_gives_the_same_batches(recipe, baseline, folder):
    run(recipe, 2, WorkerConfig(2, "thread"))
    for p in blocks(folder)[::2]:  # half the blocks gone
        os.unlink(p)
    for p in blocks(folder)[::3]:  # others cut in the middle of a frame
        size = os.path.getsize(p)
        with open(p, "r+b") as f:
            f.truncate(size // 2)
    got, _ = run(recipe, 4, WorkerConfig(2, "thread"))
    assert got == baseline
    tc._CACHES.clear()  # a fresh process: torn tails it finds are not used
    assert run(recipe, 1, WorkerConfig(0))[0] == baseline


def test_corrupt_entries_are_retokenized_and_replaced(recipe, baseline, folder):
    run(recipe, 1, WorkerConfig(0))
    for p in blocks(folder):  # flip the last byte (ids of the last entry) of every block
        with open(p, "r+b") as f:
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 0xFF]))
    corrupt = token_cache().stats["corrupt"]
    tc._CACHES.clear()  # a fresh process's view (no entry known yet)
    got, stats = run(recipe, 2, WorkerConfig(2, "thread"))
    assert got == baseline
    assert stats["corrupt"] > corrupt >= 0
    tc._CACHES.clear()
    got, stats = run(recipe, 2, WorkerConfig(0))
    assert got == baseline and stats["corrupt"] == 0  # replaced: the newer frame is read


def test_resume_on_another_world_size_with_a_warm_cache(recipe, baseline, folder, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = run_hashes(
        recipe, world_size=2, steps=3, workers=WorkerConfig(2, "thread"), save_at=3, checkpoint=ckpt, out=io.StringIO()
    )
    token_cache().flush()
    rest = run_hashes(
        recipe,
        world_size=4,
        steps=STEPS - 3,
        workers=WorkerConfig(2, "process"),
        resume=ckpt,
        out=io.StringIO(),
        err=io.StringIO(),
    )
    assert first + rest == baseline


def test_the_tokens_split_mode_too(recipe, folder):
    old = recipe.replace(data_version=1)
    os.environ.pop(tc.ENV_DIR)
    try:
        want = run_hashes(
            recipe.replace(data_version=1), world_size=1, steps=STEPS, workers=WorkerConfig(0), out=io.StringIO()
        )
    finally:
        os.environ[tc.ENV_DIR] = str(folder)
    assert run(old, 2, WorkerConfig(2, "thread"))[0] == want
    assert run(old, 4, WorkerConfig(0))[0] == want


def test_a_changed_tokenizer_never_reads_a_stale_entry(recipe, folder):
    run(recipe, 1, WorkerConfig(0))  # warm for the recipe's tokenizer settings
    other = recipe.replace(tokenizer={**recipe.raw["tokenizer"], "add_eos": False})
    os.environ.pop(tc.ENV_DIR)
    try:
        want = run_hashes(other.replace(), world_size=1, steps=STEPS, workers=WorkerConfig(0), out=io.StringIO())
    finally:
        os.environ[tc.ENV_DIR] = str(folder)
    assert run(other, 2, WorkerConfig(2, "thread"))[0] == want


def test_a_changed_shard_never_reads_a_stale_entry(corpus, folder, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(corpus, root, ignore=shutil.ignore_patterns("cache", "*.toml"))
    r = Recipe.from_toml(write_recipe(str(root), "tok.toml", buffer=4))
    run(r, 1, WorkerConfig(0))
    web = sorted((root / "web").iterdir())[0]
    lines = web.read_text().splitlines()
    lines = [json.dumps({"text": json.loads(x)["text"].replace("e", "E")}) for x in lines]  # same sizes
    web.write_text("\n".join(lines) + "\n")
    r = Recipe.from_toml(write_recipe(str(root), "tok.toml", buffer=4))  # indexes the changed file
    os.environ.pop(tc.ENV_DIR)
    try:
        want = run_hashes(r.replace(), world_size=1, steps=STEPS, workers=WorkerConfig(0), out=io.StringIO())
    finally:
        os.environ[tc.ENV_DIR] = str(folder)
    assert run(r, 2, WorkerConfig(2, "thread"))[0] == want


def test_two_processes_writing_at_once_leave_a_valid_cache(recipe, recipe_path, baseline, folder, tmp_path):
    env = dict(os.environ, PYTHONPATH=SUPPORT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    jobs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(SUPPORT, "token_cache_job.py"),
                recipe_path,
                str(tmp_path / f"ix{j}"),
                "2",
                str(STEPS),
                "2",
                "thread",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for j in range(2)
    ]
    outs = []
    for p in jobs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert [o["hashes"] for o in outs] == [baseline, baseline]
    assert all(valid(p) for p in blocks(folder))
    got, stats = run(recipe, 1, WorkerConfig(0))
    assert got == baseline and stats["misses"] == 0  # everything the two jobs read is there


def entry(n: int, top: int = 1000) -> tc.TokenEntry:
    return tc.TokenEntry(np.random.default_rng(n).integers(0, top, n).astype(np.int32))


def test_a_torn_append_is_repaired_by_the_next_writer(tmp_path):
    cache = tc.TokenCache(str(tmp_path / "c"), 1 << 30)
    path, tag = cache.block_path("s", "shard", 0)
    cache.append(path, tag, 2, [((i, 0, 1), entry(10 + i)) for i in range(5)])
    good = os.path.getsize(path)
    with open(path, "ab") as f:  # a writer killed in the middle of its frame
        f.write(tc.frame(tag, (9, 0, 1), entry(50), 2)[:37])
    fresh = tc.TokenCache(str(tmp_path / "c"), 1 << 30)  # another process
    assert [e is not None for e in fresh.get_many(path, tag, [(i, 0, 1) for i in range(6)])] == [True] * 5 + [False]
    fresh.append(path, tag, 2, [((5, 0, 1), entry(15))])
    assert os.path.getsize(path) > good and valid(path)
    got = tc.TokenCache(str(tmp_path / "c"), 1 << 30).get_many(path, tag, [(i, 0, 1) for i in range(6)])
    assert [e.tokens.tolist() for e in got] == [entry(10 + i).tokens.tolist() for i in range(6)]


def test_ids_are_stored_at_the_tokenizers_width(tmp_path):
    cache = tc.TokenCache(str(tmp_path / "c"), 1 << 30)
    for width, top in ((2, 60_000), (4, 128_000)):
        path, tag = cache.block_path(f"w{width}", "shard", 0)
        e = entry(1000, top)
        cache.append(path, tag, width, [((0, 0, 1), e)])
        assert os.path.getsize(path) == tokenblock._FRAME + 1000 * width
        assert cache.get_many(path, tag, [(0, 0, 1)])[0].tokens.tolist() == e.tokens.tolist()
    assert tc.width_of(65_536) == 2 and tc.width_of(65_537) == 4


def test_the_size_cap_evicts_the_least_recently_used_blocks(tmp_path):
    cache = tc.TokenCache(str(tmp_path / "c"), 64_000)
    paths = []
    for b in range(20):  # 20 blocks of ~8 KB under a 64 KB cap
        path, tag = cache.block_path("s", f"shard{b}", 0)
        cache.append(path, tag, 2, [((0, 0, 1), entry(4000))])
        paths.append(path)
    assert cache.size_bytes() <= 64_000 and cache.stats["evictions"] > 0
    assert os.path.exists(paths[-1]) and not os.path.exists(paths[0])


def test_a_folder_that_cannot_be_used_means_no_cache_and_one_warning(recipe_path, baseline, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv(tc.ENV_DIR, str(tmp_path / "file" / "cache"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = run_hashes(
            Recipe.from_toml(recipe_path),
            world_size=2,
            steps=STEPS,
            workers=WorkerConfig(2, "thread"),
            out=io.StringIO(),
        )
    assert got == baseline
    said = [x for x in w if "token cache" in str(x.message)]
    assert len(said) == 1 and tc.ENV_DIR in str(said[0].message)


FILTERS = """
[[filters]]
name = "no-the"
kind = "regex"
pattern = "\\\\bthe\\\\b"
action = "exclude"
datasets = ["code"]

[[filters]]
name = "caps"
kind = "transform"
function = "user_filters:upper"
datasets = ["web"]
"""


def test_an_ablation_with_filters_reads_the_cache_a_transform_does_not(corpus, recipe, folder):
    from zephon.recipe.warm import warm_local

    # long rows: documents are not cut into parts (whose cuts follow the token estimates, which a
    # filter changes), so every kept document of the ablation has the plain recipe's key
    warm_local(recipe.replace(seq_len=1024))  # every document of the plain recipe
    path = write_recipe(str(corpus), "filtered.toml", buffer=4, extra=FILTERS)
    os.environ.pop(tc.ENV_DIR)
    try:
        want = run_hashes(
            Recipe.from_toml(path).replace(seq_len=1024),
            world_size=1,
            steps=2,
            workers=WorkerConfig(0),
            out=io.StringIO(),
        )
    finally:
        os.environ[tc.ENV_DIR] = str(folder)
    before = dict(token_cache().stats)
    got = run_hashes(
        Recipe.from_toml(path).replace(seq_len=1024),
        world_size=2,
        steps=2,
        workers=WorkerConfig(2, "thread"),
        out=io.StringIO(),
    )
    assert got == want  # the rewritten "web" texts are tokenized, never read from the raw entries
    assert token_cache().stats["hits"] > before["hits"]  # the filtered code and the books documents are


def test_loader_metrics_report_the_token_cache(recipe, folder):
    from zephon.recipe import LoaderMetrics

    recipe = recipe.replace(workers={**recipe.raw.get("workers", {}), "prefetch": 0})  # see the warm-run test
    m = LoaderMetrics(recipe)
    outs = []
    for steps in (STEPS + 8, STEPS):  # cold, then warm (within the cold run's reach: its read-ahead is timing's)
        with recipe.router(world_size=1, rank=0, workers=WorkerConfig(0)) as router:
            for _ in range(steps):
                m.record(next(router))
            token_cache().flush()
            outs.append(m.collect(router.summary_metrics()))
    cold, warm = outs
    assert cold["zephon/token_cache/misses"] > 0 and cold["zephon/token_cache/bytes_written"] > 0
    assert warm["zephon/token_cache/hit_share"] == 1.0 and warm["zephon/token_cache/bytes_read"] > 0


def test_a_warm_cache_gives_the_token_estimates_without_tokenizing(recipe_path, folder, monkeypatch):
    """Every run's prepare measures tokens per byte on a seeded sample: with the cache warm the
    sampled whole records' lengths come from it (the same estimates), nothing is tokenized."""
    # rows long enough that no document is cut into parts (a part's entry is not its whole record's)
    long_rows = Recipe.from_toml(recipe_path).replace(seq_len=8192)
    os.environ.pop(tc.ENV_DIR)
    try:
        want = long_rows.replace().prepare().estimates
    finally:
        os.environ[tc.ENV_DIR] = str(folder)
    warm_local(long_rows.replace())
    calls = {"n": 0}
    encode = TextTokenizer.encode_content

    def counted(self, texts):
        calls["n"] += len(texts)
        return encode(self, texts)

    monkeypatch.setattr(TextTokenizer, "encode_content", counted)
    got = long_rows.replace().prepare().estimates
    assert got == want
    assert calls["n"] == 0
