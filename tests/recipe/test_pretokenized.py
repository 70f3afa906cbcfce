"""Pretokenized datasets in a recipe: mixed with raw text by tokens, byte-identical batches on
every world size, worker mode and resume, ids delivered as stored (never re-tokenized), the
tokenizer checked against what the format records."""

from __future__ import annotations

import glob
import json
import os
import sysconfig

import numpy as np
import pytest

from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.data import BUNDLED_TOKENIZER, DataError, TextTokenizer, write_mds, write_megatron, write_tokens
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.nodes import provenance_entry
from zephon.recipe import BadSamplesWarning

STEPS = 12
WEIGHTS = {"code_npy": 0.2, "code_mega": 0.2, "code_mds": 0.2, "web": 0.4}


def stdlib_texts(n: int) -> list[str]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:n]
    return [open(f, encoding="utf-8", errors="replace").read()[:6000] for f in files]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretok")
    texts = stdlib_texts(100)
    tok = TextTokenizer(BUNDLED_TOKENIZER, True, True)
    ids = [np.asarray(a) for a in tok.encode_batch(texts[:70])]
    os.makedirs(root / "npy")
    write_tokens(str(root / "npy" / "a.npy"), ids[:20], dtype="uint16")
    write_tokens(str(root / "npy" / "b.bin"), ids[20:30], dtype="int32")
    # Megatron: some documents as several sequences (--split-sentences)
    write_megatron(
        str(root / "c"), [[d[: len(d) // 2], d[len(d) // 2 :]] if i % 2 else d for i, d in enumerate(ids[30:50])]
    )
    with open(root / "web.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[70:])
    write_mds(str(root / "mds"), ids[50:70], dtype="uint32")
    stored = {"code_npy": ids[:30], "code_mega": ids[30:50], "code_mds": ids[50:70]}
    return root, stored


def make(root, **changes):
    cfg = {
        "seed": 7,
        "lanes": 8,
        "seq_len": 64,
        "global_batch_size": 16,
        "cache_dir": str(root / "cache"),
        "tokenizer": {"path": BUNDLED_TOKENIZER},
        "shuffle": {"buffer": 8},
        "workers": {"count": 0},
        "datasets": [
            {
                "name": "code_npy",
                "path": ["npy/*.npy", "npy/*.bin"],
                "format": "tokens",
                "weight": WEIGHTS["code_npy"],
                "dtype": "int32",
            },
            {"name": "code_mega", "path": "c.bin", "format": "megatron", "weight": WEIGHTS["code_mega"]},
            {"name": "code_mds", "path": "mds", "format": "mds", "weight": WEIGHTS["code_mds"]},
            {"name": "web", "path": "web.jsonl", "weight": WEIGHTS["web"]},
        ],
    }
    cfg.update(changes)
    return Recipe.from_dict(cfg, base_dir=str(root))


@pytest.fixture(scope="module")
def recipe(corpus):
    return make(corpus[0])


def hashes(recipe, world, steps, workers=WorkerConfig(0), state=None):
    with recipe.global_loader(world, workers=workers) as g:
        if state is not None:
            g.load_state_dict(state)
        out = [batch_sha256(next(g)) for _ in range(steps)]
        return out, decode_state(encode_state(g.state_dict()))


@pytest.fixture(scope="module")
def reference(recipe):
    return hashes(recipe, 1, STEPS)[0]


@pytest.mark.parametrize(
    "world,workers",
    [(2, WorkerConfig(2, "thread")), (4, WorkerConfig(2, "process")), (8, WorkerConfig(1, "thread"))],
    ids=["W2-thread2", "W4-process2", "W8-thread1"],
)
def test_identical_across_world_sizes_and_workers(recipe, reference, world, workers):
    assert hashes(recipe, world, STEPS, workers)[0] == reference


def test_resume_on_other_world_sizes(recipe, reference):
    a, st = hashes(recipe, 4, 4, WorkerConfig(2, "thread"))
    b, st = hashes(recipe, 1, 3, state=st)
    c, _ = hashes(recipe, 2, STEPS - 7, WorkerConfig(1, "process"), state=st)
    assert a + b + c == reference


def check_stored(recipe, stored, steps):
    """Every segment of a pretokenized dataset in a row is a slice of its stored document (no
    BOS/EOS added, nothing re-tokenized); returns the tokens per dataset."""
    names = [d.name for d in recipe.datasets]
    counts = np.zeros(len(names))
    checked = 0
    with recipe.global_loader(2) as g:
        for _ in range(steps):
            b = next(g)
            d = b["dataset"][b["document_ids"] >= 0]
            counts += np.bincount(d, minlength=len(names))
            for row, prov in zip(b["input"], b["provenance"]):
                pos = 0
                for e in prov:
                    p = provenance_entry(e)
                    n = p.tok_end - p.tok_start
                    name = names[p.dataset]
                    if name in stored:
                        doc = stored[name][(20 if name == "code_npy" and p.shard == 1 else 0) + p.record]
                        k = min(pos + n, len(row)) - pos
                        if k > 0:
                            assert row[pos : pos + k].tolist() == doc[p.tok_start : p.tok_start + k].tolist()
                            checked += 1
                    pos += n
    assert checked > 5 * steps // 4
    return counts


def test_ids_are_delivered_as_stored_and_mixed_by_tokens(recipe, corpus):
    names = [d.name for d in recipe.datasets]
    counts = check_stored(recipe, corpus[1], 40)
    shares = counts / counts.sum()
    for i, name in enumerate(names):
        assert abs(shares[i] - WEIGHTS[name]) < 0.03, (name, shares)
    est = recipe.estimates
    assert est["code_npy"].tokens_per_byte == 0.25 and est["code_npy"].tokens_per_record == 0.0


def test_data_version_1_cuts_parts_from_the_stored_ids(corpus):
    """Under data version 1 (split_mode "tokens") long documents are cut the same way: from the ids."""
    v1 = make(corpus[0], data_version=1)
    assert hashes(v1, 1, 6)[0] == hashes(v1, 4, 6, WorkerConfig(2, "process"))[0]
    check_stored(v1, corpus[1], 10)


def test_the_tokenizer_is_checked_against_the_data(corpus, tmp_path):
    root, stored = corpus
    # the id width bounds the vocabulary: uint8 ids cannot come from a 4096-token tokenizer
    write_tokens(str(tmp_path / "small.npy"), [np.array([1, 2, 3])] * 4, dtype="uint8")
    bad = make(
        root, datasets=[{"name": "small", "path": str(tmp_path / "small.npy"), "format": "tokens", "weight": 1.0}]
    )
    with pytest.raises(DataError, match=r"small\.npy.*stored as uint8.*4,096 ids.*another \(smaller\) tokenizer"):
        bad.prepare()
    # an id outside the vocabulary: an error naming the file and document, or a counted skip
    docs = [np.array([1, 2, 3] * 20)] * 30 + [np.array([1, 99999, 3])]
    write_tokens(str(tmp_path / "wide.npy"), docs, dtype="int32")
    ds = {"name": "wide", "path": str(tmp_path / "wide.npy"), "format": "tokens", "weight": 1.0}
    raises = pytest.raises(DataError, match=r"wide\.npy.*document 30.*token id 99999 is outside.*4096")
    with (
        raises,
        pytest.warns(BadSamplesWarning),
        make(root, datasets=[ds], shuffle={"buffer": 1}).global_loader(1) as g,
    ):
        for _ in range(50):
            next(g)
    skip = make(root, datasets=[ds | {"on_error": "skip"}], shuffle={"buffer": 1})
    with pytest.warns(BadSamplesWarning), skip.global_loader(1) as g:
        for _ in range(20):
            assert 99999 not in next(g)["input"]
