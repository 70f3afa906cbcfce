"""The work benchmark (``benchmarks/work.py``, issue 20) at its tiny size, so it cannot rot: it
runs end to end and writes well-formed results. Its numbers are not checked here (tests/recipe/
test_tokenize_work.py asserts the work ratio)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_work_benchmark_smoke(tmp_path):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "work.py"), "--size", "smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads((tmp_path / "work_smoke.json").read_text())
    assert {(x["lanes"], x["data_version"]) for x in r["ratios"]} == {(1, 1), (1, 2), (4, 1), (4, 2)}
    assert all(x["tokenized"] > 0 and x["handed_on"] > 0 for x in r["ratios"])
    assert r["throughput"] and r["throughput"][0]["tokens_per_s"] > 0
    md = (tmp_path / "work_smoke.md").read_text()
    assert "## Tokens tokenized per token" in md and "## Throughput vs the tokenizer-only limit" in md
