"""The zephon command: demo, hashes (save / resume on another W), inspect, errors."""

import subprocess
import sys

import pytest
from text_fixtures import write_corpus, write_recipe


def zephon(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "zephon", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    write_corpus(str(root))
    return write_recipe(str(root))


def test_demo(tmp_path):
    out = zephon("demo", "--root", tmp_path / "demo")
    assert out.returncode == 0, out.stderr
    assert "identical across world sizes, workers and resume: YES" in out.stdout
    assert "row 0:" in out.stdout


def steps(out):
    assert out.returncode == 0, out.stderr
    lines = [l for l in out.stdout.splitlines() if l.startswith("step ")]
    return [tuple(l.split()[1:]) for l in lines]


def test_hashes_across_world_sizes_and_resume(recipe_path, tmp_path):
    ref = steps(zephon("hashes", recipe_path, "--steps", 8))
    assert [int(t) for t, _ in ref] == list(range(8)) and all(len(h) == 64 for _, h in ref)
    assert steps(zephon("hashes", recipe_path, "--steps", 8, "--world-size", 4, "--workers", 2)) == ref
    assert (
        steps(zephon("hashes", recipe_path, "--steps", 8, "--world-size", 2, "--workers", 2, "--backend", "process"))
        == ref
    )
    ck = tmp_path / "ck"
    first = steps(zephon("hashes", recipe_path, "--steps", 3, "--world-size", 4, "--save-at", 3, "--checkpoint", ck))
    rest = steps(zephon("hashes", recipe_path, "--steps", 5, "--world-size", 8, "--resume", ck))
    assert first + rest == ref


def test_inspect(recipe_path):
    out = zephon("inspect", recipe_path, "--show", 2, "--world-size", 2)
    assert out.returncode == 0, out.stderr
    for needle in (
        "web",
        "code",
        "books",
        "tok/byte",
        "target",
        "expected",
        "rank 1/2: lanes 4..7",
        "row 1:",
        "‖",
        "packing efficiency",
        "realized token shares",
    ):
        assert needle in out.stdout, needle


def test_errors_exit_2_with_a_message(recipe_path, tmp_path):
    out = zephon("hashes", recipe_path, "--world-size", 3)
    assert out.returncode == 2 and "Valid world sizes for lanes = 8: [1, 2, 4, 8]" in out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text(open(recipe_path).read().replace("lanes = 8", "lanes = 8\nlane = 3"))
    out = zephon("inspect", bad)
    assert out.returncode == 2 and "unknown key 'lane'" in out.stderr
    out = zephon("inspect", tmp_path / "missing.toml")
    assert out.returncode == 2 and "does not exist" in out.stderr


@pytest.fixture(scope="module")
def finite_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_finite")
    write_corpus(str(root))
    stop = 'policy = "stop"\n'
    return write_recipe(str(root), "finite.toml", web_extra=stop, code_extra=stop, books_extra=stop)


def test_hashes_past_the_end_of_a_finite_recipe(finite_path, tmp_path):
    out = zephon("hashes", finite_path, "--steps", 1000, "--world-size", 2)
    got = steps(out)  # exit 0
    n = len(got)
    assert 10 < n < 1000 and [int(t) for t, _ in got] == list(range(n))
    assert f"the data ended after {n} steps (end = 'pad'" in out.stderr
    assert f"printed steps 0..{n - 1} of the 1000 asked for" in out.stderr and "Traceback" not in out.stderr
    assert steps(zephon("hashes", finite_path, "--steps", 1000, "--world-size", 8, "--workers", 2)) == got
    # a checkpoint a few steps before the end, resumed on another W: exactly the rest
    ck = tmp_path / "ck"
    head = steps(
        zephon("hashes", finite_path, "--steps", n - 3, "--world-size", 4, "--save-at", n - 3, "--checkpoint", ck)
    )
    rest = zephon("hashes", finite_path, "--steps", 10, "--world-size", 2, "--resume", ck)
    assert head + steps(rest) == got and len(steps(rest)) == 3
    assert f"printed steps {n - 3}..{n - 1} of the 10 asked for" in rest.stderr
    # a checkpoint at the end resumes ended, on any W
    head = steps(zephon("hashes", finite_path, "--steps", n, "--world-size", 1, "--save-at", n, "--checkpoint", ck))
    ended = zephon("hashes", finite_path, "--steps", 5, "--world-size", 8, "--resume", ck)
    assert steps(ended) == [] and "printed no step" in ended.stderr
