"""The block shuffle (data version 3, issue 22): a global batch draws about as many shards as a
record-level global shuffle would, on equal and very unequal shards, one or two datasets and
several lane counts; the batches are the same on every W and worker setting and after a resume
at any step; and the reads are contiguous (bytes read close to the bytes delivered)."""

from __future__ import annotations

import gzip
import os
import shutil

import numpy as np
import pytest
from shuffle_corpus import unequal_sizes, write_recipe, write_shards

from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.data.datasets.shardio import ShardFiles
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.nodes import global_batch_diversity

CORPORA = {
    "equal": {"a": [100] * 64},
    "unequal": {"a": unequal_sizes(48)},
    "two_datasets": {"a": [100] * 32, "b": unequal_sizes(24, seed=2)},
}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    out = {}
    for name, datasets in CORPORA.items():
        root = str(tmp_path_factory.mktemp(name))
        for k, (ds, sizes) in enumerate(datasets.items()):
            write_shards(root, ds, sizes, offset=5000 * k)
        out[name] = (root, list(datasets))
    return out


def diversity(recipe: Recipe, steps: int) -> tuple[float, float]:
    """Mean distinct shards per global batch, and the global-shuffle expectation, over ``steps``."""
    sizes = [[sh.num_records for sh in ix.shards] for ix in recipe.indexes]
    got, want = [], []
    with recipe.global_loader(1) as g:
        for _ in range(steps):
            a, e = global_batch_diversity(next(g)["provenance"], sizes)
            got.append(a)
            want.append(e)
    return float(np.mean(got)), float(np.mean(want))


@pytest.mark.parametrize("lanes", [4, 16])
@pytest.mark.parametrize("corpus", list(CORPORA))
def test_diversity_near_a_global_shuffle(corpora, corpus, lanes):
    root, names = corpora[corpus]
    # the default shuffle window (1024 rows: 128 steps of a lane here) and block (16 records)
    path = write_recipe(root, names, lanes=lanes, global_batch_size=32, seq_len=128, buffer=None, file=f"r{lanes}.toml")
    got, want = diversity(Recipe.from_toml(path).replace(data_version=3), 6)
    assert got >= 0.9 * want, f"{corpus}, {lanes} lanes: {got:.1f} distinct shards per batch, global shuffle {want:.1f}"


def _hashes(recipe, world, steps, workers=WorkerConfig(0), state=None):
    with recipe.global_loader(world, workers=workers) as g:
        if state is not None:
            g.load_state_dict(state)
        out = [batch_sha256(next(g)) for _ in range(steps)]
        return out, decode_state(encode_state(g.state_dict()))


@pytest.fixture(scope="module")
def small(corpora):
    root, names = corpora["two_datasets"]
    path = write_recipe(root, names, lanes=8, global_batch_size=16, seq_len=128, buffer=16, file="small.toml")
    return Recipe.from_toml(path).replace(data_version=3)


STEPS = 12


@pytest.fixture(scope="module")
def reference(small):
    assert small.spec.shuffle.block == 16
    return _hashes(small, 1, STEPS)[0]


@pytest.mark.parametrize(
    "world,workers",
    [
        (2, WorkerConfig(0)),
        (4, WorkerConfig(2, "thread")),
        (8, WorkerConfig(3, "thread")),
        (2, WorkerConfig(2, "process")),
    ],
    ids=["w2-inline", "w4-thread2", "w8-thread3", "w2-process2"],
)
def test_same_batches_on_every_w_and_workers(small, reference, world, workers):
    assert _hashes(small, world, STEPS, workers)[0] == reference


def test_resume_at_every_step_on_another_w(small, reference):
    for t in range(STEPS):
        first, state = _hashes(small, (1, 2, 4, 8)[t % 4], t)
        rest, _ = _hashes(small, (8, 4, 2, 1)[t % 4], STEPS - t, state=state)
        assert first + rest == reference, f"resume at step {t}"


def test_finite_recipe_reads_every_record_once(corpora):
    root, names = corpora["unequal"]
    path = write_recipe(
        root,
        names,
        lanes=4,
        global_batch_size=8,
        seq_len=128,
        buffer=8,
        dataset_extra='policy = "stop"',
        file="fin.toml",
    )
    r = Recipe.from_toml(path).replace(data_version=3)
    seen = set()
    with r.global_loader(2) as g:
        for b in g:
            seen |= {(s[1], s[2]) for row in b["provenance"] for s in row}
    assert seen == {(s, k) for s, sh in enumerate(r.indexes[0].shards) for k in range(sh.num_records)}


class _Reads:
    """Bytes the readers asked for (records) and bytes read from the files (``os.pread``)."""

    def __init__(self, monkeypatch):
        self.asked = self.read = self.calls = 0
        pread, ranges = os.pread, ShardFiles._read_ranges

        def counting_pread(fd, n, offset):
            data = pread(fd, n, offset)
            self.read += len(data)
            self.calls += 1
            return data

        def counting_ranges(ix, s, offs, lens):
            self.asked += sum(lens)
            return ranges(ix, s, offs, lens)

        monkeypatch.setattr(os, "pread", counting_pread)
        monkeypatch.setattr(ShardFiles, "_read_ranges", counting_ranges)


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory):
    """24 shards of 2 MB (documents of about 4 KB): shards far larger than the 64 KB gap below
    which the reader joins neighbouring ranges, as real shards are."""
    root = str(tmp_path_factory.mktemp("big"))
    write_shards(root, "a", [480] * 24, join=16)
    return root


@pytest.mark.parametrize("lanes", [8, 16])
def test_bytes_read_close_to_bytes_delivered(big_shards, monkeypatch, lanes):
    root, names = big_shards, ["a"]
    path = write_recipe(root, names, lanes=lanes, global_batch_size=lanes * 2, buffer=16, file=f"reads{lanes}.toml")
    ratios = {}
    for version in (2, 3):
        r = Recipe.from_toml(path).replace(data_version=version)
        assert r.indexes  # indexed before counting
        with monkeypatch.context() as m:
            reads = _Reads(m)
            with r.global_loader(1, workers=WorkerConfig(2, "thread")) as g:
                for _ in range(8):
                    next(g)
        ratios[version] = (reads.read / reads.asked, reads.calls)
    assert ratios[3][0] <= 1.1, ratios
    # the stripe order: each lane's ranges span its neighbours' records (1.34-1.9x by how many records a
    # mapper task holds: since read-ahead is sized in tokens, tasks are smaller and so are the ranges)
    assert ratios[2][0] > 1.25, ratios


def test_compressed_datasets_keep_the_stripe_order(tmp_path):
    """A ``.gz`` shard is decompressed whole: block visits would decompress it again and again."""
    root = str(tmp_path)
    write_shards(root, "plain", [50] * 4)
    write_shards(root, "packed", [50] * 4)
    for name in os.listdir(os.path.join(root, "packed")):
        src = os.path.join(root, "packed", name)
        with open(src, "rb") as f, gzip.open(src + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.unlink(src)
    r = Recipe.from_toml(write_recipe(root, ["plain", "packed"], lanes=4, global_batch_size=8))
    assert [d.block for d in r.prepare().plan.datasets] == [16, 0]
    assert [d.block for d in r.replace(data_version=2).prepare().plan.datasets] == [0, 0]
