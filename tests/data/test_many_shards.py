"""Startup at scale: one metadata table per dataset (not one file per shard), rows checked one by
one; the short-shard scanner; and indexing spread over the ranks of a job (real processes, gloo)."""

from __future__ import annotations

import glob
import gzip
import json
import os
import pickle
import socket
import sysconfig
import time

import pytest
import torch.multiprocessing as tmp_mp
from hypothesis import given, settings
from hypothesis import strategies as st
from index_spread_worker import arrays_digest, batch_hashes, run
from text_fixtures import TOKENIZER_DIR

from zephon import Recipe
from zephon.data import DataError, DatasetIndex, index_dataset
from zephon.data.datasets._scan import LineScanner, scan_small
from zephon.data.datasets.resolve import _realpath

SHARDS = 37  # not a multiple of 2 or 4: the slices differ in size


def real_lines() -> list[str]:
    """Lines of real text: the standard library's json package, comments and code alike."""
    out: list[str] = []
    for p in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py"))):
        with open(p, encoding="utf-8") as f:
            out += [ln.rstrip("\n") for ln in f if ln.strip()]
    return out


def write_shards(folder: str, n: int = SHARDS) -> str:
    os.makedirs(folder, exist_ok=True)
    lines = real_lines()
    for i in range(n):
        docs = [" ".join(lines[(i * 13 + j * 5 + k) % len(lines)] for k in range(3 + (i + j) % 4)) for j in range(4)]
        with open(os.path.join(folder, f"s{i:04d}.jsonl"), "w") as f:
            f.write("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return os.path.join(folder, "*.jsonl")


def counting(monkeypatch) -> list[int]:
    built: list[int] = []
    original = DatasetIndex._build_arrays

    def build(self, s):
        built.append(s)
        return original(self, s)

    monkeypatch.setattr(DatasetIndex, "_build_arrays", build)
    return built


def fresh(path: str) -> DatasetIndex:
    return index_dataset("web", path, format="jsonl", cache_dir=None, progress=False)


def test_one_table_per_dataset_and_only_changed_shards_are_indexed_again(tmp_path, monkeypatch):
    path = write_shards(str(tmp_path / "d"))
    cache = str(tmp_path / "cache")
    built = counting(monkeypatch)
    first = index_dataset("web", path, format="jsonl", cache_dir=cache)
    assert sorted(built) == list(range(SHARDS))
    assert len(os.listdir(cache)) == 1  # one table, not one file per shard; no temporary file left
    built.clear()
    warm = index_dataset("web", path, format="jsonl", cache_dir=cache)
    assert built == [] and all(warm._cached) and warm.fingerprint == first.fingerprint
    # one shard rewritten, one added, one removed: those alone are indexed, the rest from the table
    changed = str(tmp_path / "d" / "s0007.jsonl")
    with open(changed, "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    with open(str(tmp_path / "d" / "s9999.jsonl"), "w") as f:
        f.write(json.dumps({"text": "a new shard"}) + "\n")
    os.remove(str(tmp_path / "d" / "s0003.jsonl"))
    built.clear()
    after = index_dataset("web", path, format="jsonl", cache_dir=cache)
    names = [os.path.basename(m.path) for m in after.shards]
    assert sorted(names[s] for s in built) == ["s0007.jsonl", "s9999.jsonl"]
    want = fresh(path)
    assert after.fingerprint == want.fingerprint != first.fingerprint
    assert arrays_digest(after) == arrays_digest(want)
    assert after.read(names.index("s0007.jsonl"), [4]) == ["one more document"]
    assert len(os.listdir(cache)) == 1
    built.clear()
    assert index_dataset("web", path, format="jsonl", cache_dir=cache).fingerprint == want.fingerprint and built == []


def test_a_pickled_index_reads_its_arrays_back_from_the_table(tmp_path):
    path = write_shards(str(tmp_path / "d"))
    cache = str(tmp_path / "cache")
    ix = index_dataset("web", path, format="jsonl", cache_dir=cache)
    blob = pickle.dumps(ix)
    assert len(blob) < 20_000  # the arrays stay in the table; the copy reloads them
    copy = pickle.loads(blob)
    assert arrays_digest(copy) == arrays_digest(ix)
    assert copy.read(5, [0, 3]) == ix.read(5, [0, 3])
    for f in os.listdir(cache):  # the table cleaned away: the copy indexes the (unchanged) shard again
        os.remove(os.path.join(cache, f))
    assert pickle.loads(blob).read(9, [1]) == ix.read(9, [1])


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(
        st.sampled_from(["", " ", "\t \r", "a", "bc d", " lead", "x\r", "\r", "\ufeffbom", "ü€", '{"text": "t"}']),
        max_size=30,
    ),
    trailing=st.booleans(),
    bom=st.booleans(),
)
def test_the_short_shard_scan_finds_what_the_scanner_finds(lines, trailing, bom):
    data = ("\ufeff" if bom else "").encode() + ("\n".join(lines) + ("\n" if trailing else "")).encode("utf-8")
    sc = LineScanner()
    sc.feed(data)
    want = sc.finish()
    got = scan_small(data)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tolist() == want[k].tolist(), k


def test_realpath_per_folder_agrees_with_os_realpath(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.jsonl").write_text("x\n")
    os.symlink(tmp_path / "real", tmp_path / "linked")
    os.symlink(tmp_path / "real" / "a.jsonl", tmp_path / "real" / "b.jsonl")
    dirs: dict[str, str] = {}
    for p in ("real/a.jsonl", "linked/a.jsonl", "linked/b.jsonl", "real/b.jsonl", "real/../real/a.jsonl"):
        q = str(tmp_path / p)
        assert _realpath(q, dirs) == os.path.realpath(q)


# -- spread over ranks: real processes ----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, job: dict, timeout: float = 240) -> list[dict]:
    ctx = tmp_mp.start_processes(run, args=(world, free_port(), job), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world} ranks did not finish within {timeout} s (a collective left waiting?)")
    out = []
    for r in range(world):
        with open(os.path.join(job["out"], f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


RECIPE = """\
seed = 5
lanes = 4
seq_len = 64
global_batch_size = 8
cache_dir = "{cache}"

[tokenizer]
path = "{tok}"

[[datasets]]
name = "web"
path = "{path}"
format = "jsonl"
"""


@pytest.mark.parametrize("world,shared", [(2, True), (4, False)])
def test_indexing_spread_over_ranks_is_the_one_process_index(tmp_path, world, shared):
    path = write_shards(str(tmp_path / "d"))
    cache = str(tmp_path / ("cache" if shared else "cache{rank}"))
    recipe = str(tmp_path / "r{rank}.toml")
    for r in range(world):
        with open(recipe.format(rank=r), "w") as f:
            f.write(RECIPE.format(cache=cache.format(rank=r), tok=TOKENIZER_DIR, path=path))
    with open(str(tmp_path / "alone.toml"), "w") as f:
        f.write(RECIPE.format(cache=str(tmp_path / "alone-cache"), tok=TOKENIZER_DIR, path=path))
    alone = Recipe.from_toml(str(tmp_path / "alone.toml"))
    want_batches = batch_hashes(alone, 3)
    want = fresh(path)
    (tmp_path / "out").mkdir()
    got = spawn(world, {"path": path, "cache": cache, "out": str(tmp_path / "out"), "recipe": recipe})
    assert all("error" not in g for g in got), got
    for g in got:
        assert g["fingerprint"] == g["fingerprint_again"] == want.fingerprint
        assert g["arrays"] == arrays_digest(want) and g["records"] == want.num_records
        assert g["built_again"] == 0 and g["cached"]
        assert g["batches"] == want_batches
    per_rank = [g["built"] for g in got]
    assert sum(per_rank) == SHARDS and max(per_rank) <= -(-SHARDS // world)  # each rank its slice
    tables = glob.glob(os.path.join(cache.format(rank="*"), "*.npz"))
    assert len(tables) == (1 if shared else world)


def test_a_bad_shard_fails_every_rank_and_none_waits(tmp_path):
    write_shards(str(tmp_path / "d"))
    bad = str(tmp_path / "d" / "s0030.jsonl.gz")
    with open(bad, "wb") as f:
        f.write(gzip.compress(b'{"text": "x"}\n' * 500)[:40])
    (tmp_path / "out").mkdir()
    pattern = str(tmp_path / "d" / "s*")
    got = spawn(3, {"path": pattern, "cache": str(tmp_path / "cache"), "out": str(tmp_path / "out")})
    for g in got:
        assert "error" in g and "s0030.jsonl.gz" in g["error"] and "truncated" in g["error"], g
    with pytest.raises(DataError, match="s0030.jsonl.gz"):
        index_dataset("web", pattern, format="jsonl", cache_dir=None)
