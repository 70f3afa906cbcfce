"""``zephon warm`` (issue 35): it fills exactly what the loader then reads (locally and as a Ray
job on a local cluster), is idempotent and resumes where a killed job stopped; ``zephon inspect``
says how much of the next steps is warm."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from text_fixtures import hashes_without_token_cache, write_corpus, write_recipe

from zephon import Recipe, WorkerConfig
from zephon.data import token_cache
from zephon.data.datasets import tokencache as tc
from zephon.recipe.warm import shard_items, warm_local, warm_shard, warm_units
from zephon.tools.cli import main, run_hashes
from zephon.tools.warm import warm_on_ray

STEPS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmcorpus")
    write_corpus(str(root), scale=0.02)
    return root


@pytest.fixture(scope="module")
def recipe_path(corpus):
    return write_recipe(str(corpus), "warm.toml", buffer=4)


@pytest.fixture(scope="module")
def baseline(recipe_path):
    return hashes_without_token_cache(recipe_path, STEPS)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    path = tmp_path / "token-cache"
    monkeypatch.setenv(tc.ENV_DIR, str(path))
    return path


def entries(folder) -> dict[str, set]:
    """Every block file's entries: name -> {(record, part, parts, ids bytes)}."""
    out = {}
    for dirpath, _, names in os.walk(folder / "blocks"):
        for n in names:
            p = os.path.join(dirpath, n)
            b = tc._Block(p, bytes.fromhex(n[:16]))
            b.refresh()
            out[n] = {(*k, b.read(k).tokens.tobytes()) for k in list(b.entries)}
            b.close()
    return out


def loader_misses(recipe_path, world=2, workers=WorkerConfig(2, "thread"), prefetch=None):
    recipe = Recipe.from_toml(recipe_path)
    if prefetch is not None:
        recipe = recipe.replace(workers={**recipe.raw.get("workers", {}), "prefetch": prefetch})
    before = dict(token_cache().stats)
    got = run_hashes(recipe, world_size=world, steps=STEPS, workers=workers, out=io.StringIO())
    return got, token_cache().stats["misses"] - before["misses"]


def test_warm_fills_what_the_loader_reads_and_is_idempotent(recipe_path, baseline, folder):
    counts = warm_local(Recipe.from_toml(recipe_path), threads=2)
    assert counts["tokenized"] == counts["items"] > 0
    for world, workers in ((1, WorkerConfig(0)), (2, WorkerConfig(2, "thread")), (4, WorkerConfig(2, "process"))):
        got, misses = loader_misses(recipe_path, world, workers)
        assert got == baseline and misses == 0, (world, workers)
    before = entries(folder)
    again = warm_local(Recipe.from_toml(recipe_path), threads=2)
    assert again["tokenized"] == 0 and entries(folder) == before


def test_warm_resumes_where_a_killed_job_stopped(recipe_path, baseline, folder):
    r = Recipe.from_toml(recipe_path)
    p = r.prepare()
    units = warm_units(p)
    first = units[: len(units) // 2]
    for u in first:  # the shards a killed job finished
        warm_shard(p.pipeline, shard_items(p.plan, u.dataset, u.shard))
    done = sum(len(shard_items(p.plan, u.dataset, u.shard)) for u in first)
    rest = warm_local(Recipe.from_toml(recipe_path), threads=1)
    assert rest["tokenized"] == rest["items"] - done
    assert loader_misses(recipe_path) == (baseline, 0)


def test_a_killed_warm_command_leaves_a_cache_the_next_one_completes(recipe_path, baseline, folder):
    cmd = [sys.executable, "-m", "zephon", "warm", recipe_path, "--threads", "1"]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    p.stderr.readline()  # the first progress line: it started
    p.kill()
    p.wait()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert loader_misses(recipe_path) == (baseline, 0)


def test_inspect_says_how_much_of_the_next_steps_is_warm(recipe_path, folder, capsys):
    assert main(["inspect", recipe_path, "--warm-steps", "10"]) == 0
    assert "are warm (0%)" in capsys.readouterr().out
    warm_local(Recipe.from_toml(recipe_path))
    assert main(["inspect", recipe_path, "--warm-steps", "10"]) == 0
    assert "are warm (100%)" in capsys.readouterr().out


def test_warm_steps_runs_the_loader(recipe_path, baseline, folder):
    assert main(["warm", recipe_path, "--steps", str(STEPS)]) == 0
    # no batches computed ahead: what a prefetching run reads past its last step is timing (tasks
    # end at a few steps' tokens, not at whole chunks), and could go past what the warm run read
    got, misses = loader_misses(recipe_path, 1, WorkerConfig(0), prefetch=0)
    assert got == baseline and misses == 0


def test_warm_refuses_without_a_cache(recipe_path, monkeypatch, capsys):
    monkeypatch.delenv(tc.ENV_DIR, raising=False)
    assert main(["warm", recipe_path]) == 2
    assert "ZEPHON_TOKEN_CACHE" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_a_ray_warm_job_fills_exactly_what_the_loader_reads(recipe_path, baseline, folder, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[dev]' or '.[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        counts = warm_on_ray(Recipe.from_toml(recipe_path))
    finally:
        ray.shutdown()
    assert counts["tokenized"] == counts["items"] > 0
    on_ray = entries(folder)
    monkeypatch.setenv(tc.ENV_DIR, str(tmp_path / "local"))
    warm_local(Recipe.from_toml(recipe_path))
    assert entries(tmp_path / "local") == on_ray  # the same blocks, entries and ids as a local warm job
    monkeypatch.setenv(tc.ENV_DIR, str(folder))
    assert loader_misses(recipe_path) == (baseline, 0)


@pytest.mark.slow  # ~22 s alone on 2 cores, a Ray cluster of its own in a subprocess
@pytest.mark.timeout(300)
def test_zephon_warm_ray_on_the_command_line_fills_what_the_loader_reads(recipe_path, baseline, folder):
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[dev]' or '.[ray]')")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local cluster of its own
    cmd = [sys.executable, "-m", "zephon", "warm", recipe_path, "--ray"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr
    assert "tokenized now" in out.stderr and " 0 tokenized" not in out.stderr
    assert loader_misses(recipe_path) == (baseline, 0)
