"""The lane-step cache of a finite recipe (issue 21): a count file is used only if its own
record says it was counted for exactly this recipe, data and zephon version (counts from another
version once ended a run early, dropping real data); a full or read-only cache folder counts
without keeping the result instead of stopping the run; two jobs on one cold cache agree."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
from text_fixtures import write_corpus, write_recipe

from zephon import Recipe
from zephon.recipe import DATA_VERSION
from zephon.recipe.lanesteps import lane_steps_key

STOP = 'policy = "stop"\n'


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lanesteps")
    write_corpus(str(root), scale=0.03)
    return str(root)


def finite(corpus, cache=None):
    r = Recipe.from_toml(write_recipe(corpus, "f.toml", buffer=4, web_extra=STOP, code_extra=STOP, books_extra=STOP))
    return r.replace(end="drop", **({"cache_dir": cache} if cache else {}))


def steps(recipe) -> tuple[int, tuple]:
    with recipe.global_loader(1) as g:
        n = sum(1 for _ in g)
        return n, tuple(g.end.lane_steps)


def test_counts_from_another_version_or_recipe_are_recounted(corpus, tmp_path):
    cache = str(tmp_path / "cache")
    n, counts = steps(finite(corpus, cache))
    (path,) = glob.glob(os.path.join(cache, "lane_steps-*.json"))
    with open(path) as f:
        rec = json.load(f)
    assert rec["lane_steps"] == list(counts) and rec["zephon"] and rec["data_version"] == DATA_VERSION

    def tamper(**fields):
        bad = dict(rec, lane_steps=[max(0, c - 1) for c in rec["lane_steps"]], **fields)
        with open(path, "w") as f:
            json.dump(bad, f)

    tamper(zephon="0.0.1")  # counted by another zephon version
    assert steps(finite(corpus, cache)) == (n, counts)
    tamper(fingerprint="0" * 32)  # counted for another recipe
    assert steps(finite(corpus, cache)) == (n, counts)


def test_the_key_names_the_data_version():
    p1 = type("P", (), {})()
    p1.estimates, p1.fingerprint = {}, "f"
    p1.spec = type("S", (), {"data_version": 1})()
    p2 = type("P", (), {})()
    p2.estimates, p2.fingerprint = {}, "f"
    p2.spec = type("S", (), {"data_version": 2})()
    assert lane_steps_key(p1) != lane_steps_key(p2)


RUN = textwrap.dedent(
    """
    import json, resource, sys, warnings
    from zephon import Recipe
    r = Recipe.from_toml(sys.argv[1]).replace(end="drop", cache_dir=sys.argv[2])
    if sys.argv[3] == "full":  # no file may grow past 64 bytes: every cache write fails (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with r.global_loader(1) as g:
            n = sum(1 for _ in g)
            counts = list(g.end.lane_steps)
    print(json.dumps({"steps": n, "counts": counts, "warnings": [str(x.message) for x in w]}))
    """
)


def run_job(corpus, cache, mode="normal") -> subprocess.Popen:
    recipe = write_recipe(corpus, "f.toml", buffer=4, web_extra=STOP, code_extra=STOP, books_extra=STOP)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(
        [sys.executable, "-c", RUN, recipe, cache, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_full_cache_folder_does_not_stop_the_run(corpus, tmp_path):
    want = steps(finite(corpus, str(tmp_path / "ref")))
    got = result(run_job(corpus, str(tmp_path / "full"), "full"))
    assert (got["steps"], tuple(got["counts"])) == want
    assert any("lane step cache" in m for m in got["warnings"]), got["warnings"]
    assert not glob.glob(os.path.join(str(tmp_path / "full"), "*.tmp"))  # nothing half-written left


def test_two_jobs_on_one_cold_cache_agree(corpus, tmp_path):
    want = steps(finite(corpus, str(tmp_path / "ref")))
    cache = str(tmp_path / "shared")
    a, b = run_job(corpus, cache), run_job(corpus, cache)
    for got in (result(a), result(b)):
        assert (got["steps"], tuple(got["counts"])) == want
    assert steps(finite(corpus, cache)) == want  # and what they left is right
