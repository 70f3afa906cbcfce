"""Caches and shared folders (issue 21 class 3): zephon's own cache files inside a dataset's
folder or glob are never read as data; a read-only or full cache folder gives the right records
and a warning, never a stopped run or a half-written cache file."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from zephon.data import index_dataset


def write_docs(folder: str, n_files: int = 3, n: int = 50) -> list[str]:
    texts = []
    for k in range(n_files):
        rows = [f"file {k} doc {i}" for i in range(n)]
        texts += rows
        with open(os.path.join(folder, f"part{k}.jsonl"), "w") as f:
            f.write("\n".join(json.dumps({"text": t}) for t in rows) + "\n")
    return texts


def all_texts(ix) -> list:
    return [t for s in range(len(ix.shards)) for t in ix.read(s, list(range(ix.shards[s].num_records)))]


@pytest.mark.parametrize("how", ["folder", "glob"])
def test_own_cache_files_in_the_dataset_folder_are_not_data(tmp_path, how):
    data = str(tmp_path / "data")
    os.makedirs(data)
    texts = write_docs(data)
    path = data if how == "folder" else os.path.join(data, "*")
    first = index_dataset("web", path, format="jsonl", cache_dir=data)  # the cache lives among the shards
    assert glob.glob(os.path.join(data, "*.npz"))
    # a lane-step count file, a lock and a leftover temporary file of zephon's
    for name in ("lane_steps-" + "0" * 32 + ".json", "lane_steps-" + "0" * 32 + ".json.lock"):
        with open(os.path.join(data, name), "w") as f:
            f.write("{}")
    again = index_dataset("web", path, format="jsonl", cache_dir=data)
    assert [m.path for m in again.shards] == [m.path for m in first.shards]
    assert len(again.shards) == 3 and all_texts(again) == texts


READ_ONLY_JOB = textwrap.dedent(
    """
    import json, os, sys, warnings
    import gzip, zlib  # noqa: F401 - imported before dropping privileges
    from zephon.data import index_dataset
    if os.geteuid() == 0:  # root ignores permissions: run the index as nobody
        os.setgid(65534); os.setuid(65534)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ix = index_dataset("web", sys.argv[1], format="jsonl", cache_dir=sys.argv[2], progress=False)
        texts = [t for s in range(len(ix.shards)) for t in ix.read(s, list(range(ix.shards[s].num_records)))]
    print(json.dumps({"texts": texts, "warnings": [str(x.message) for x in w]}))
    """
)


def run(script: str, *args: str) -> dict:
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("warm", [False, True])
def test_a_read_only_cache_gives_the_right_records(warm):
    root = tempfile.mkdtemp(prefix="zephon-ro-")
    try:
        os.chmod(root, 0o755)
        data, cache = os.path.join(root, "data"), os.path.join(root, "cache")
        os.makedirs(data)
        os.makedirs(cache)
        texts = write_docs(data)
        for f in os.listdir(data):
            os.chmod(os.path.join(data, f), 0o644)
        os.chmod(data, 0o755)
        if warm:
            index_dataset("web", os.path.join(data, "*.jsonl"), cache_dir=cache)
            for f in os.listdir(cache):
                os.chmod(os.path.join(cache, f), 0o444)
        os.chmod(cache, 0o555)
        got = run(READ_ONLY_JOB, os.path.join(data, "*.jsonl"), cache)
        assert got["texts"] == texts
        assert warm or any("cannot write the index cache" in m for m in got["warnings"]), got["warnings"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


FULL_JOB = textwrap.dedent(
    """
    import json, resource, sys, warnings
    from zephon.data import index_dataset
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # a full disk: no file grows past 1 KiB
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ix = index_dataset("web", sys.argv[1], format="jsonl", cache_dir=sys.argv[2], progress=False)
        texts = [t for s in range(len(ix.shards)) for t in ix.read(s, list(range(ix.shards[s].num_records)))]
    print(json.dumps({"texts": texts, "warnings": [str(x.message) for x in w]}))
    """
)


def test_a_full_cache_folder_gives_the_right_records(tmp_path):
    data, cache = str(tmp_path / "data"), str(tmp_path / "cache")
    os.makedirs(data)
    texts = write_docs(data, n=200)
    got = run(FULL_JOB, os.path.join(data, "*.jsonl"), cache)
    assert got["texts"] == texts
    assert any("cannot write the index cache" in m for m in got["warnings"]), got["warnings"]
    assert not glob.glob(os.path.join(cache, "*.tmp"))  # nothing half-written left behind
    # and a later run with room reads (and caches) the same
    assert all_texts(index_dataset("web", os.path.join(data, "*.jsonl"), cache_dir=cache)) == texts
