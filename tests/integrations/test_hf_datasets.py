"""HF ``datasets`` objects and folders as sources: each gives the batches of the same files read
directly, byte for byte (same records, same plan), on several world sizes."""

from __future__ import annotations

import json
import os
import shutil

import pytest

datasets = pytest.importorskip("datasets")

from zephon import Recipe, batch_sha256  # noqa: E402
from zephon.data import BUNDLED_TOKENIZER, DataError  # noqa: E402
from zephon.integrations.hf_datasets import hf_source  # noqa: E402


def texts():
    import glob
    import sysconfig

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:40]
    return [open(f, encoding="utf-8", errors="replace").read()[:3000] for f in files]


def recipe(root, src):
    cfg = {
        "seed": 3,
        "lanes": 4,
        "seq_len": 64,
        "global_batch_size": 8,
        "cache_dir": str(root / "zcache"),
        "tokenizer": {"path": BUNDLED_TOKENIZER},
        "shuffle": {"buffer": 4},
        "workers": {"count": 0},
        "datasets": [{"name": "web", "weight": 1.0, **src}],
    }
    return Recipe.from_dict(cfg, base_dir=str(root))


def hashes(r, world=1, steps=5):
    with r.global_loader(world) as g:
        return [batch_sha256(next(g)) for _ in range(steps)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    with open(root / "web.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts())
    ds = datasets.load_dataset("json", data_files=str(root / "web.jsonl"), split="train", cache_dir=str(root / "c"))
    ds.save_to_disk(str(root / "saved"))
    ds.to_parquet(str(root / "web.parquet"))
    hub = root / "hub" / "datasets--org--web"
    os.makedirs(hub / "snapshots" / "r1" / "data")
    os.makedirs(hub / "refs")
    (hub / "refs" / "main").write_text("r1")
    shutil.copy(root / "web.parquet", hub / "snapshots" / "r1" / "data" / "train-00000-of-00001.parquet")
    shutil.copy(root / "web.parquet", hub / "snapshots" / "r1" / "data" / "test-00000-of-00001.parquet")
    return root, ds


def test_a_dataset_and_its_folders_give_the_batches_of_their_files(data):
    root, ds = data
    saved = hashes(recipe(root, {"path": "saved", "format": "arrow"}))
    assert hashes(recipe(root, hf_source(ds))) == saved  # the Dataset's own cache files
    assert hashes(recipe(root, hf_source(str(root / "saved")))) == saved  # a load_from_disk folder
    loaded = datasets.load_from_disk(str(root / "saved"))
    assert hashes(recipe(root, hf_source(loaded)), world=2) == saved
    # an IterableDataset streamed from files, and the hub cache folder: their files' batches
    direct = hashes(recipe(root, {"path": "web.jsonl"}))
    streamed = datasets.load_dataset("json", data_files=str(root / "web.jsonl"), split="train", streaming=True)
    assert hashes(recipe(root, hf_source(streamed)), world=4) == direct
    assert hashes(recipe(root, hf_source(ds.to_iterable_dataset()))) == saved
    parquet = hashes(recipe(root, {"path": "web.parquet"}))
    src = hf_source(str(root / "hub" / "datasets--org--web"), split="train")
    assert len(src["path"]) == 1 and hashes(recipe(root, src)) == parquet


def test_what_zephon_would_not_read_as_given_is_refused(data):
    root, ds = data
    with pytest.raises(DataError, match="flatten_indices"):
        hf_source(ds.select([3, 1]))
    with pytest.raises(DataError, match="view of 5 of its files' 40 rows"):
        hf_source(ds.select(range(5)))
    with pytest.raises(DataError, match="lives in memory"):
        hf_source(datasets.Dataset.from_dict({"text": ["a"]}))
    streamed = datasets.load_dataset("json", data_files=str(root / "web.jsonl"), split="train", streaming=True)
    with pytest.raises(DataError, match="transformations"):
        hf_source(streamed.map(lambda x: x))
    with pytest.raises(DataError, match="split"):
        hf_source(datasets.DatasetDict({"train": ds}))
