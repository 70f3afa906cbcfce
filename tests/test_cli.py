import subprocess
import sys


def test_demo_runs_and_hashes_match():
    out = subprocess.run([sys.executable, "-m", "zephon", "demo"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "identical global batches across world sizes, workers and resume: YES" in out.stdout
