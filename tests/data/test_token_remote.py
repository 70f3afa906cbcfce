"""The token cache's object-storage tier (issue 35) against moto's standalone S3 server: two
"nodes" (two local folders, one bucket): the second tokenizes nothing once the first published;
a corrupted remote version is never used (a torn object and an entry with a bad CRC), and the
node's own version replaces it for the next node; with the server killed the run goes on with
one warning; ``zephon warm`` publishes what it warmed. Batches are those without a cache in
every case; a plain folder serves as the tier too; the loader metrics count what came from
the tier; a Ray warm job publishes for the other nodes."""

from __future__ import annotations

import io
import time
import warnings

import pytest
from storage_server import moto_bucket
from text_fixtures import hashes_without_token_cache, write_corpus, write_recipe

pytest.importorskip("moto", reason="moto[server] is not installed (pip install -e '.[dev]')")
pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")

from zephon import Recipe, WorkerConfig
from zephon.data import token_cache
from zephon.data.datasets import tokencache as tc
from zephon.data.datasets import tokenremote
from zephon.data.datasets.tokenremote import version_of
from zephon.recipe import LoaderMetrics
from zephon.tools.cli import main, run_hashes
from zephon.tools.warm import warm_on_ray

BUCKET = "zephon-tokens"
REMOTE = f"s3://{BUCKET}/cache"
STEPS = 6
#: steps of a run that warms the cache for another: two passes over every dataset (~40,000 tokens,
#: 1,024 a step). What a run reads ahead of its last step depends on timing (tasks pending at its
#: end run or not), so only a run that read every record covers any other run's read-ahead
WARM_STEPS = 20 * STEPS


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("remotecorpus")
    write_corpus(str(root), scale=0.02)
    return write_recipe(str(root), "remote.toml", buffer=4)


@pytest.fixture(scope="module")
def baseline(recipe_path):
    return hashes_without_token_cache(recipe_path, STEPS)


@pytest.fixture
def s3(monkeypatch):
    """A fresh S3 server with an empty bucket, the environment pointing at it and at the tier."""
    monkeypatch.setenv(tc.ENV_REMOTE, REMOTE)
    monkeypatch.delenv(tc.ENV_GB, raising=False)
    with moto_bucket(monkeypatch, BUCKET) as got:
        yield got


def run_node(recipe_path, folder, monkeypatch, steps=STEPS):
    """The first :data:`STEPS` batches of a run of ``steps`` steps (2 thread workers) on the node
    whose token cache is ``folder``, what its cache counted during the run, and the cache (its
    queued entries written, not yet published). A run that warms for another reads
    :data:`WARM_STEPS`: what the loader reads ahead of step 6 depends on timing."""
    monkeypatch.setenv(tc.ENV_DIR, str(folder))
    cache = token_cache()
    before = dict(cache.stats)
    r = Recipe.from_toml(recipe_path)
    got = run_hashes(r, world_size=1, steps=steps, workers=WorkerConfig(2, "thread"), out=io.StringIO())
    cache.flush()
    return got[:STEPS], {k: v - before[k] for k, v in cache.stats.items()}, cache


def versions(fs) -> list[str]:
    fs.invalidate_cache()
    return sorted(fs.find(f"{BUCKET}/cache/blocks"))


def test_a_second_node_tokenizes_nothing_after_the_first_published(recipe_path, baseline, s3, tmp_path, monkeypatch):
    _, fs = s3
    got, counted, cache = run_node(recipe_path, tmp_path / "node-a", monkeypatch, WARM_STEPS)
    assert got == baseline and counted["written"] > 0 and counted["remote_hits"] == 0
    cache.close()  # publishes what the background publisher has not yet
    published = versions(fs)
    assert cache.stats["published"] >= len(published) > 0
    assert all(version_of(fs.cat_file(p)) == p.rsplit("/", 1)[1] for p in published)  # named by digest
    got, counted, other = run_node(recipe_path, tmp_path / "node-b", monkeypatch)
    assert got == baseline
    assert counted["misses"] == counted["written"] == 0 and counted["remote_hits"] > 0 and counted["hits"] > 0
    assert counted["remote_bytes"] > 0 and counted["remote_corrupt"] == 0
    other.close()
    assert versions(fs) == published  # node b wrote nothing of its own: nothing new to publish


def test_blocks_are_published_in_the_background_once_quiet(recipe_path, baseline, s3, tmp_path, monkeypatch):
    _, fs = s3
    monkeypatch.setattr(tokenremote, "QUIET_S", 0.2)
    got, counted, cache = run_node(recipe_path, tmp_path / "node-a", monkeypatch)
    assert got == baseline and counted["written"] > 0
    deadline = time.monotonic() + 30
    up = 0  # bytes of the blocks' current versions (a publisher removes its older ones)
    while up != counted["bytes_written"] and time.monotonic() < deadline:
        time.sleep(0.2)  # nothing closes the cache: the publisher thread publishes
        up = sum(fs.size(p) for p in versions(fs))
    assert up == counted["bytes_written"]


def corrupt(fs, published: list[str]) -> None:
    """Tear the first version (bytes changed, name kept) and give the second an entry whose ids
    fail their CRC (under the digest of its new bytes, so only the entry check can refuse it)."""
    torn = bytearray(fs.cat_file(published[0]))
    torn[len(torn) // 2] ^= 0xFF
    fs.pipe_file(published[0], bytes(torn))
    bad = bytearray(fs.cat_file(published[1]))
    bad[-1] ^= 0xFF
    fs.rm_file(published[1])
    fs.pipe_file(published[1].rsplit("/", 1)[0] + "/" + version_of(bytes(bad)), bytes(bad))


def test_a_corrupted_remote_version_is_never_used(recipe_path, baseline, s3, tmp_path, monkeypatch):
    _, fs = s3
    run_node(recipe_path, tmp_path / "node-a", monkeypatch, WARM_STEPS)[2].close()
    published = versions(fs)
    assert len(published) >= 2
    corrupt(fs, published)
    got, counted, cache = run_node(recipe_path, tmp_path / "node-b", monkeypatch, WARM_STEPS)
    assert got == baseline
    assert counted["remote_corrupt"] >= 2 and counted["remote_hits"] > 0
    assert counted["misses"] >= counted["written"] > 0  # what the corrupt versions held: tokenized again
    cache.close()
    assert cache.stats["published"] > 0  # node b's own versions now stand beside the corrupt ones
    got, counted, _ = run_node(recipe_path, tmp_path / "node-c", monkeypatch)
    assert got == baseline and counted["misses"] == counted["written"] == 0


def test_a_killed_server_means_one_warning_and_the_local_cache(recipe_path, baseline, s3, tmp_path, monkeypatch):
    server, _ = s3
    run_node(recipe_path, tmp_path / "node-a", monkeypatch)[2].close()
    server.stop()
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got, counted, cache = run_node(recipe_path, tmp_path / "node-b", monkeypatch)
        cache.close()  # publishing to the dead server: given up already, nothing waits
    said = [str(w.message) for w in seen if "remote tier" in str(w.message)]
    assert got == baseline and counted["written"] > 0 and counted["remote_hits"] == 0
    assert len(said) == 1 and REMOTE in said[0] and "unset $ZEPHON_TOKEN_CACHE_REMOTE" in said[0]
    assert time.monotonic() - t0 < 60
    got, counted, _ = run_node(recipe_path, tmp_path / "node-b", monkeypatch)  # the local cache still serves
    assert got == baseline and counted["hits"] > 0 and counted["remote_hits"] == 0


def test_zephon_warm_publishes_what_it_warmed(recipe_path, baseline, s3, tmp_path, monkeypatch):
    _, fs = s3
    monkeypatch.setenv(tc.ENV_DIR, str(tmp_path / "warm-node"))
    assert main(["warm", recipe_path, "--threads", "2"]) == 0
    assert versions(fs)
    got, counted, _ = run_node(recipe_path, tmp_path / "node-b", monkeypatch)
    assert got == baseline and counted["misses"] == counted["written"] == 0 and counted["remote_hits"] > 0


def test_a_shared_folder_serves_as_the_tier_and_the_metrics_count_it(recipe_path, tmp_path, monkeypatch):
    monkeypatch.setenv(tc.ENV_REMOTE, str(tmp_path / "shared"))  # any fsspec URL: here a plain folder
    run_node(recipe_path, tmp_path / "node-a", monkeypatch, 3 * STEPS)[2].close()
    monkeypatch.setenv(tc.ENV_DIR, str(tmp_path / "node-b"))
    recipe = Recipe.from_toml(recipe_path)
    m = LoaderMetrics(recipe)
    with recipe.router(world_size=1, rank=0, workers=WorkerConfig(0)) as router:
        for _ in range(STEPS):
            m.record(next(router))
        got = m.collect(router.summary_metrics())
    assert got["zephon/token_cache/remote_hits"] > 0 and got["zephon/token_cache/remote_bytes"] > 0
    assert got["zephon/token_cache/misses"] == 0 and got["zephon/token_cache/hit_share"] == 1.0


@pytest.mark.slow  # a local Ray cluster and an S3 server: ~25 s on 2 cores
@pytest.mark.timeout(300)
def test_a_ray_warm_job_publishes_for_the_other_nodes(recipe_path, baseline, s3, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[dev]' or '.[ray]')")
    _, fs = s3
    monkeypatch.setenv(tc.ENV_DIR, str(tmp_path / "ray-node"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # its workers get this environment
    try:
        counts = warm_on_ray(Recipe.from_toml(recipe_path))
    finally:
        ray.shutdown()
    assert counts["tokenized"] == counts["items"] > 0 and versions(fs)
    got, counted, _ = run_node(recipe_path, tmp_path / "node-b", monkeypatch)
    assert got == baseline and counted["misses"] == counted["written"] == 0 and counted["remote_hits"] > 0
