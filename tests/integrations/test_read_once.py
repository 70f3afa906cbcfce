"""Read once per data-parallel rank: the model-parallel peers of a DP rank share one pipeline.

Real processes on gloo (``torchrun``), TorchTitan's mesh order (``tp`` innermost: rank r is DP rank
r // tp). The batches each peer is handed are byte-identical to the per-peer way's, the loader's
work (records fetched) is done once per DP rank instead of once per peer, the checkpoint holds each
lane once (the leader's), and TorchTitan's CheckpointManager resumes it on another DP degree and
another model-parallel degree with the uninterrupted run's batches.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan")

from zephon import Recipe, batch_sha256

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support")
sys.path.insert(0, HERE)
from text_fixtures import write_corpus, write_recipe  # noqa: E402


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("read_once"))
    write_corpus(root)
    # 8 lanes, 16 rows of 64 tokens per step; no batches computed ahead, so the records a pipeline
    # fetches (its work, compared below) do not depend on how far a prefetch got
    return write_recipe(root, extra="\n[workers]\nprefetch = 0\n")


def _env(tmp_path):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["ZEPHON_CACHE_DIR"] = str(tmp_path / "zcache")
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    return env


def _torchrun(n, args, env, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *args]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert p.returncode == 0, f"torchrun of {n} failed (rc {p.returncode}):\n{p.stdout[-6000:]}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_peers_get_the_same_bytes_and_the_work_is_done_once(recipe_path, tmp_path):
    """DP = 2 x TP = 2: per-peer and read-once hand every rank the same slices; with read-once
    the followers fetch no record and hold no lane, the leaders fetch what each peer fetched
    before and hold the same lane states."""
    out = tmp_path / "out"
    worker = os.path.join(HERE, "read_once_worker.py")
    args = [worker, "--recipe", recipe_path, "--out", str(out), "--tp", "2", "--steps", "3"]
    _torchrun(4, args + ["--local-batch-size", "2"], _env(tmp_path))
    got = {}
    for path in glob.glob(str(out / "rank*_*.json")):
        with open(path) as f:
            r = json.load(f)
        got[(r["rank"], os.path.basename(path).split("_", 1)[1][:-5])] = r
    assert len(got) == 8
    for rank in range(4):
        before, now = got[(rank, "per_peer")], got[(rank, "read_once")]
        assert len(now["hashes"]) == 3 * 4  # 3 steps x 4 microbatches of 2 rows (8 rows per DP rank)
        assert now["hashes"] == before["hashes"], f"rank {rank}: read-once slices differ from the per-peer way's"
        assert now["hashes"] == got[(rank ^ 1, "read_once")]["hashes"]  # its peer's
        assert before["role"] == "alone" and before["records_fetched"] > 0
        if rank % 2 == 0:
            assert now["role"] == "leader"
            assert now["records_fetched"] == before["records_fetched"]
            assert now["state"] == before["state"]  # the DP rank's lanes, the same values
        else:
            assert now["role"] == "follower"
            assert now["records_fetched"] == 0, "a follower ran the pipeline"
            assert now["state"] == {}
    assert got[(0, "read_once")]["hashes"] != got[(2, "read_once")]["hashes"]  # two DP ranks, two lane blocks
    per_peer = sum(got[(r, "per_peer")]["records_fetched"] for r in range(4))
    read_once = sum(got[(r, "read_once")]["records_fetched"] for r in range(4))
    assert per_peer == 2 * read_once  # the work of TP = 2 peers, done once


def _lane_hashes(folder):
    out = {}
    for path in glob.glob(os.path.join(folder, "hashes_rank*.jsonl")):
        with open(path) as f:
            for rec in map(json.loads, f):
                for lane, h in rec["lanes"].items():
                    assert (rec["step"], int(lane)) not in out, "a lane delivered twice"
                    out[(rec["step"], int(lane))] = h
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_read_once_checkpoint_resumes_on_other_dp_and_tp(recipe_path, tmp_path):
    """TorchTitan's CheckpointManager (DCP): 2 steps at DP = 2 x TP = 2 (read-once), resumed at
    DP = 1 x TP = 2 (read-once), then DP = 4 x TP = 1 with every peer reading alone: every lane's
    rows at every step equal an uninterrupted single-process run's, and every peer got its leader's."""
    dump, out = tmp_path / "run", tmp_path / "hashes"
    worker = os.path.join(HERE, "titan_ckpt_worker.py")
    env = _env(tmp_path)
    for n, tp, load, steps, extra in [(4, 2, 0, 2, []), (2, 2, 2, 1, []), (4, 1, 3, 1, ["--per-peer"])]:
        args = [worker, "--recipe", recipe_path, "--dump", str(dump), "--out", str(out), "--tp", str(tp)]
        args += ["--load-step", str(load), "--steps", str(steps), "--local-batch-size", "2", *extra]
        _torchrun(n, args, env)
    got = _lane_hashes(str(out))
    rec = Recipe.from_toml(recipe_path)
    ref = {}
    with rec.global_loader(1) as gl:
        for step in range(1, 5):
            b = next(gl)
            for lane in range(rec.lanes):
                rows = slice(lane * rec.rows_per_lane, (lane + 1) * rec.rows_per_lane)
                ref[(step, lane)] = batch_sha256({k: b[k][rows] for k in ("input", "labels", "positions")})
    assert got == ref
    for path in glob.glob(str(out / "peer_hashes_rank*.jsonl")):
        with open(path) as f:
            for r in map(json.loads, f):
                assert all(got[(r["step"], int(lane))] == h for lane, h in r["lanes"].items())
