"""The benchmark harness at its tiny size, so it cannot rot: both halves (text, vision) run end
to end and write well-formed results files. No timed assertions: the numbers themselves are not
checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "benchmarks", "run.py")


def run_smoke(out, half: str):
    """``benchmarks/run.py --size smoke --only HALF`` into ``out``: (out, stdout)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    p = subprocess.run(
        [sys.executable, RUN, "--size", "smoke", "--only", half, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, f"benchmarks/run.py --only {half} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return out, p.stdout


def assert_files(out, stem: str) -> None:
    for ext in ("md", "json", "png"):
        assert (out / f"{stem}.{ext}").exists(), f"{stem}.{ext} missing"
    with open(out / f"{stem}.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return run_smoke(tmp_path_factory.mktemp("bench"), "text")


def test_results_files_written(smoke):
    out, _ = smoke
    assert_files(out, "text_smoke")
    # stamped: the commit, machine and command that made them (benchmarks/stamp.py)
    st = json.loads((out / "text_smoke.json").read_text())["stamp"]
    assert st["from"] == "run" and len(st["commit"]) == 40 and "--size smoke" in st["command"], st
    assert {"cores", "loadavg_start"} <= set(st["machine"])
    assert f"_Made at commit `{st['commit'][:12]}`" in (out / "text_smoke.md").read_text()


def test_markdown_is_well_formed(smoke):
    out, _ = smoke
    md = (out / "text_smoke.md").read_text()
    for heading in (
        "## Machine, versions, settings",
        "## Throughput (median tokens/s) and ratios",
        "## Time to first batch, peak memory, checkpoint size",
        "## zephon: restore time vs step",
        "## zephon: lanes per rank",
        "## Consumer wait behind a fake training step",
        "## What differs between the contenders",
    ):
        assert heading in md, heading
    assert "**Noise**" in md and "Load average at start" in md
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert any(line.startswith("| zephon (thread workers) |") for line in rows)
    assert any(line.startswith("| limit: encode_batch_fast alone |") for line in rows)
    for line in rows:  # table rows are closed (no cell text spilled past the table)
        assert line.rstrip().endswith("|"), line
    assert "**NO**" not in md, "a restored batch differed from the uninterrupted run"


def test_json_has_every_measurement(smoke):
    out, stdout = smoke
    data = json.loads((out / "text_smoke.json").read_text())
    got = {(r["contender"], r["threads"]) for r in data["throughput"] if "error" not in r}
    assert ("zephon", 1) in got and ("limit", 1) in got
    errors = [r for r in data["throughput"] if "error" in r]
    assert not errors, errors
    # contenders that are not installed are skipped with a note, never silently
    for name, why in data["skipped"].items():
        assert "not installed" in why
        assert f"skipping {name}" in stdout
    for r in data["throughput"]:
        assert r["tokens_per_s"] > 0
    assert data["restore"]["ok"], data["restore"]
    for p in data["restore"]["result"]["points"]:
        assert p["identical"], p
        assert p["max_lane_bytes"] < 1024, p
    assert data["lanes"] and data["waits"]


# --------------------------------------------------------------------------- vision half
@pytest.fixture(scope="module")
def vsmoke(tmp_path_factory):
    return run_smoke(tmp_path_factory.mktemp("vbench"), "vision")


def test_vision_results_files_written(vsmoke):
    out, _ = vsmoke
    assert_files(out, "vision_smoke")
    assert not (out / "text_smoke.md").exists(), "--only vision ran the text half too"


def test_vision_markdown_is_well_formed(vsmoke):
    out, _ = vsmoke
    md = (out / "vision_smoke.md").read_text()
    for heading in (
        "## Headline",
        "## Machine, versions, settings",
        "## Throughput (median images/s) and ratios",
        "## Time to first batch, peak memory, CPU per image, checkpoint size",
        "## What differs between the contenders",
    ):
        assert heading in md, heading
    assert "**Noise**" in md and "Load average at start" in md
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    for label in ("zephon (thread workers)", "limit: Pillow decode alone", "reference: per-image work alone"):
        assert any(line.startswith(f"| {label} |") for line in rows), label
    assert any(line.startswith("| zephon ÷ decode-only limit >= 0.8 |") for line in rows)
    for line in rows:
        assert line.rstrip().endswith("|"), line


def test_vision_json_has_every_measurement(vsmoke):
    from benchmarks.run_vision import VCONTENDERS

    out, stdout = vsmoke
    data = json.loads((out / "vision_smoke.json").read_text())
    errors = [r for r in data["throughput"] if "error" in r]
    assert not errors, errors
    got = {r["contender"] for r in data["throughput"]}
    for name in VCONTENDERS + ["limit", "work"]:
        if name in data["skipped"]:
            assert "not installed" in data["skipped"][name] and f"skipping {name}" in stdout
        else:
            assert name in got, name
    for r in data["throughput"]:
        assert r["images_per_s"] > 0 and r["images"] > 0
        if r["contender"] not in ("limit", "work"):
            assert r["state"]["bytes_per_rank"] > 0
    z = [r for r in data["throughput"] if r["contender"] == "zephon"]
    assert z and all(r["state"]["format"] == "JSON" and r["state"]["max_bytes_per_lane"] < 1024 for r in z)


# --------------------------------------------------------------------------- scaling script
SCALE = os.path.join(ROOT, "benchmarks", "scale.py")


@pytest.fixture(scope="module")
def scale_smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    p = subprocess.run(
        [sys.executable, SCALE, "--size", "smoke", "--workers", "1,2", "--backends", "thread,process"]
        + ["--timed-s", "0.3", "--warmup-s", "0", "--budget-s", "300", "--out", str(out), "--tag", "smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, f"benchmarks/scale.py failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return out, p.stdout


def test_scale_script_writes_its_table(scale_smoke):
    out, stdout = scale_smoke
    assert_files(out, "scale_smoke")
    md = (out / "scale_smoke.md").read_text()
    assert "## text: tokens/s" in md and "## vision: images/s" in md
    data = json.loads((out / "scale_smoke.json").read_text())
    errors = [r for r in data["results"] if "error" in r]
    assert not errors, errors
    got = {(r["half"], r["contender"], r["backend"], r["workers"]) for r in data["results"]}
    for half in ("text", "vision"):
        for b in ("thread", "process"):
            for n in (1, 2):
                assert (half, "zephon", b, n) in got
    for name, why in data["skipped"].items():  # a missing contender is named, never silently dropped
        assert "not installed" in why and f"skipping {name}" in stdout
        assert f"| {'Grain' if name == 'grain' else name} | thread workers | skipped |" in md


def test_scale_report_names_what_is_missing(tmp_path):
    from benchmarks import scale

    assert scale.missing(["json", "surely_not_a_module_zephon"]) == ["surely_not_a_module_zephon"]
    args = scale.main.__globals__["argparse"].Namespace(
        workers="1,2", halves="text", contenders="zephon,grain", backends="thread", size="smoke", budget_s=1.0
    )
    data = {
        "args": vars(args),
        "machine": {"cpu": "x", "cores": 16, "affinity": 16, "loadavg_start": (0, 0, 0), "loadavg_end": (0, 0, 0)},
        "versions": {"torch": "2.11.0", "grain": "not installed"},
        "skipped": {"grain": "not installed here: grain"},
        "half_skipped": {},
        "notes": [],
        "workers": [1, 2],
        "results": [
            {
                "half": "text",
                "contender": "zephon",
                "backend": "thread",
                "workers": 1,
                "per_s": 1e6,
                "cpu_per_unit": 1e-6,
            },
            {
                "half": "text",
                "contender": "zephon",
                "backend": "thread",
                "workers": 2,
                "error": "not run: budget used up",
            },
        ],
        "wall_s": 1.0,
    }
    md = open(scale.write_report(data, str(tmp_path / "scale_fake"))).read()
    assert (
        "| Grain | thread workers | skipped | skipped |" in md and "**skipped grain**: not installed here: grain" in md
    )
    assert "| zephon | thread workers | 1.00 M | not run |" in md
