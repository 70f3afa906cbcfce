"""The zephon command: demo, hashes (save / resume on another W), inspect, errors."""

import json
import os

import pytest
from text_fixtures import write_corpus, write_recipe
from warm_process import run_zephon


def zephon(*args, timeout=300):
    return run_zephon(*args, timeout=timeout)  # a fresh process, without the 2-4 s of imports


@pytest.fixture(scope="module")
def recipe_path(text_corpus):
    return os.path.join(text_corpus, "recipe.toml")  # the run's shared corpus (tests/conftest.py)


def test_demo(tmp_path):
    out = zephon("demo", "--root", tmp_path / "demo")
    assert out.returncode == 0, out.stderr
    assert "identical across world sizes, workers and resume: YES" in out.stdout
    assert "row 0:" in out.stdout
    # what a newcomer just saw: the batch, the elastic check's verdict, the recipe, what next, what to read
    for needle in (
        "a global batch: 32 rows of 256 tokens",
        "the elastic check passed",
        "demo.toml (16 lanes",
        "zephon inspect",
        "Read next: docs/",
    ):
        assert needle in out.stdout, needle


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
    out = zephon("inspect", recipe_path, "--show", 8, "--world-size", 2)  # rows with a document boundary
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
        "declared vs realized token shares: web",
        "memory budget per lane:",
        "of the 32 GB limit",
        "shuffle: block shuffle, blocks of 16 records",
        "a record-level global shuffle:",
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


def message_only(out, *needles, lines=4):
    """Exit status 2, one short message naming ``needles``, no traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) <= lines, out.stderr
    for n in needles:
        assert n in out.stderr, (n, out.stderr)


@pytest.fixture(scope="module")
def bad_json(tmp_path_factory):
    root = tmp_path_factory.mktemp("badjson")
    write_corpus(str(root))
    for shard in (root / "web").glob("*.jsonl"):  # a bad line early in every shard: every lane meets one
        lines = shard.read_text().splitlines()
        lines[1:9] = ['{"text": "unterminated'] * 8
        shard.write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_bad_record_reads_as_a_message(bad_json, backend):
    path = write_recipe(str(bad_json), f"{backend}.toml", extra=f'[workers]\ncount = 2\nbackend = "{backend}"\n')
    out = zephon("hashes", path, "--steps", 40)
    message_only(out, "web-000", ".jsonl', line ", "invalid JSON", 'on_error = "skip"', "--debug")
    debug = zephon("hashes", path, "--steps", 40, "--debug")
    assert debug.returncode == 2 and "worker traceback:" in debug.stderr and "Traceback" in debug.stderr


def test_argument_errors_read_as_messages(recipe_path, tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir()
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(open(recipe_path, "rb").read().replace(b"seed = 77", b"# caf\xe9\nseed = 77"))
    cases = [
        (["hashes", tmp_path, "--steps", 1], ["is a directory, not a TOML file"]),
        (["hashes", latin1, "--steps", 1], ["latin1.toml", "is not UTF-8"]),
        (["hashes", recipe_path, "--steps", 2, "--save-at", 5, "--checkpoint", tmp_path / "ck"], ["--save-at 5"]),
        (["hashes", recipe_path, "--steps", 2, "--save-at", 1, "--checkpoint", tmp_path / "afile"], ["is a file"]),
        (["hashes", recipe_path, "--resume", tmp_path / "missing"], ["does not exist"]),
        (["hashes", recipe_path, "--resume", tmp_path / "empty"], ["has no zephon_state.json", "--save-at"]),
        (["hashes", recipe_path, "--workers", 100000], ["--workers 100000 is above the limit"]),
    ]
    for args, needles in cases:
        message_only(zephon(*args), *needles)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("bad", [["--save-at", 0], ["--save-at", -1], ["--steps", -3], ["--steps", 0]])
def test_counts_must_be_positive(recipe_path, tmp_path, bad):
    out = zephon("hashes", recipe_path, *bad, "--checkpoint", tmp_path / "ck")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "expected an integer >= 1" in out.stderr


def test_save_at_must_be_a_step_the_resumed_run_computes(recipe_path, tmp_path):
    ck = tmp_path / "ck"
    assert zephon("hashes", recipe_path, "--steps", 3, "--save-at", 3, "--checkpoint", ck).returncode == 0
    out = zephon("hashes", recipe_path, "--steps", 2, "--resume", ck, "--save-at", 2, "--checkpoint", tmp_path / "c2")
    message_only(out, "--save-at 2 is not one of the steps this run computes (4..5)")
    state = json.loads((ck / "zephon_state.json").read_text())
    state["step"] = 4  # an edited checkpoint
    (ck / "zephon_state.json").write_text(json.dumps(state))
    message_only(zephon("hashes", recipe_path, "--resume", ck), "zephon_state.json", "shared entries do not match")


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


def test_every_option_says_what_it_does():
    from zephon.tools.cli import build_parser as _parser

    missing, stack = [], [("zephon", _parser())]
    while stack:
        name, p = stack.pop()
        for a in p._actions:
            if a.__class__.__name__ == "_SubParsersAction":
                stack.extend((f"{name} {k}", sp) for k, sp in a.choices.items())
            elif a.dest != "help" and not (a.help or "").strip():
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
    assert not missing, f"options without help: {missing}"
    out = zephon("hashes", "--help")
    assert "MORE after the resumed step" in out.stdout and "--ledger DIR" in out.stdout


def test_save_and_resume_say_what_they_did(recipe_path, tmp_path):
    ck = tmp_path / "ck"
    saved = zephon("hashes", recipe_path, "--steps", 3, "--save-at", 2, "--checkpoint", ck)
    assert saved.returncode == 0, saved.stderr
    from zephon.tools.cli import STATE_FILE

    assert f"saved the state after step 1 to {ck / STATE_FILE}; --resume {ck} continues at step 2" in saved.stderr
    resumed = zephon("hashes", recipe_path, "--steps", 4, "--world-size", 2, "--resume", ck)
    assert [t for t, _ in steps(resumed)] == ["2", "3", "4", "5"]
    assert f"resumed after step 1 from {ck}; --steps 4 computes the next 4 steps (2..5)" in resumed.stderr


def test_hashes_writes_a_ledger_on_a_cpu(recipe_path, tmp_path):
    led = tmp_path / "ledger"
    out = zephon("hashes", recipe_path, "--steps", 4, "--world-size", 2, "--ledger", led)
    assert out.returncode == 0, out.stderr
    assert f"wrote the batch ledger of 2 rank(s) to {led}" in out.stderr
    assert sorted(p.name for p in led.iterdir()) == ["rank_00000.jsonl", "rank_00001.jsonl"]
    shown = zephon("ledger", "show", led)
    assert shown.returncode == 0, shown.stderr
    expected = steps(zephon("hashes", recipe_path, "--steps", 4, "--digest", "ledger"))
    assert [tuple(l.split()[1:]) for l in shown.stdout.splitlines() if l.startswith("step ")] == expected
    same = zephon("ledger", "diff", led, recipe_path, "--steps", 4)
    assert same.returncode == 0, same.stdout + same.stderr
