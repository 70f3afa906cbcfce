"""Mixing holds under skips (issue 31): a dataset whose bad records are skipped under
``on_error = "skip"`` still realizes its declared token share, from data version 5. Token
estimation weighs a sampled bad record's planned bytes with no tokens, as the plan weighs it and a
skip delivers it; before version 5 the tokens per byte were measured on the good records alone,
and half bad records made a 0.50 dataset realize about 0.32 (kept under ``data_version = 4``)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from zephon import Recipe, WorkerConfig
from zephon.recipe.chat import realized_shares
from zephon.recipe.estimate import BadSamplesWarning
from zephon.tools.chat_demo import write_chat_recipe
from zephon.tools.demo import TOKENIZER_DIR
from zephon.tools.synth import generate_documents

STEPS = 40


def _write(root: str, name: str, docs: list[str], bad_every: int = 0) -> str:
    """A JSONL dataset of ``docs``; with ``bad_every`` = k, every k-th line lacks the text field
    (a bad record of the same size as a good one)."""
    os.makedirs(os.path.join(root, name), exist_ok=True)
    lines = [json.dumps({"body" if bad_every and i % bad_every == 0 else "text": d}) for i, d in enumerate(docs)]
    with open(os.path.join(root, name, "a.jsonl"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return os.path.join(root, name, "*.jsonl")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Recipe:
    root = str(tmp_path_factory.mktemp("skipshares"))
    docs = [d[:600] for d in generate_documents("web", 1200, seed=3)]
    ds = [
        {"name": "clean", "path": _write(root, "clean", docs[:600]), "weight": 0.5},
        {"name": "half_bad", "path": _write(root, "half_bad", docs[600:], 2), "weight": 0.5, "on_error": "skip"},
    ]
    cfg = {
        "seed": 5,
        "lanes": 4,
        "seq_len": 256,
        "global_batch_size": 8,
        "cache_dir": os.path.join(root, "cache"),
        "tokenizer": {"path": TOKENIZER_DIR},
        "datasets": ds,
        "shuffle": {"buffer": 4},
    }
    return Recipe.from_dict(cfg, root)


def shares(recipe: Recipe, version: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSamplesWarning)  # said before the run: half the records are bad
        with recipe.replace(data_version=version).global_loader(1, workers=WorkerConfig(0)) as g:
            return realized_shares([next(g) for _ in range(STEPS)], 2)


def test_half_bad_dataset_realizes_its_weight_from_version_5(recipe):
    got = shares(recipe, 5)
    assert abs(got[1] - 0.5) < 0.05, f"version 5: the half-bad dataset realized {got[1]:.3f} of the tokens"


def test_version_4_keeps_its_short_share(recipe):
    """Version 4 keeps its batches: the half-bad dataset realizes well under its weight (0.32 or so)."""
    got = shares(recipe, 4)
    assert got[1] < 0.45, f"version 4 measured {got[1]:.3f}: its estimate changed (its batches must not)"


def test_the_estimate_weighs_bad_bytes_with_no_tokens(recipe):
    v4 = recipe.replace(data_version=4).prepare().estimates["half_bad"]
    v5 = recipe.replace(data_version=5).prepare().estimates["half_bad"]
    assert v4.sampled == v5.sampled and sum(n for n, _ in v5.bad.values()) > 0
    ratio = v5.tokens_per_byte / v4.tokens_per_byte
    assert 0.4 < ratio < 0.6, ratio  # half of the sampled bytes are bad ones
    nbad = sum(n for n, _ in v5.bad.values())
    assert v5.tokens_per_record == pytest.approx(v4.tokens_per_record * v5.sampled / (v5.sampled + nbad))


def _chat_recipe(root: Path) -> Recipe:
    """The chat demo's recipe at chat 0.5 / web 0.5, every other conversation of "chat" bad (all
    its messages from the user) and skipped."""
    pytest.importorskip("pyarrow")
    path = write_chat_recipe(str(root), weights=(0.5, 0.0, 0.5), seq_len=512, conversations=800)
    for shard in sorted((root / "chat").glob("*.jsonl")):
        lines = shard.read_text().splitlines()
        for i in range(0, len(lines), 2):
            c = json.loads(lines[i])
            lines[i] = json.dumps(c | {"messages": [m | {"role": "user"} for m in c["messages"]]})
        shard.write_text("\n".join(lines) + "\n")
    text = Path(path).read_text().replace('long = "drop"', 'long = "drop"\non_error = "skip"', 1)
    Path(path).write_text(text)
    return Recipe.from_toml(path)


def test_chat_dataset_with_bad_conversations_realizes_its_weight(tmp_path):
    """Version 5 gives about 0.49 (version 4: about 0.33)."""
    r = _chat_recipe(tmp_path)
    got = {}
    for v in (4, 5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BadSamplesWarning)
            with r.replace(data_version=v).global_loader(1, workers=WorkerConfig(0)) as g:
                got[v] = realized_shares([next(g) for _ in range(30)], 3)[0]
    assert abs(got[5] - 0.5) < 0.05 and got[4] < 0.45, got


def test_with_filters_the_estimate_weighs_bad_bytes_too(recipe):
    """The estimate after ``[[filters]]`` (a length rule on the half-bad dataset) counts its bad
    records the same way from version 5."""
    rule = {"name": "long", "kind": "length", "datasets": ["half_bad"], "unit": "chars", "min": 300}
    filtered = Recipe.from_dict(recipe.raw | {"filters": [rule]}, recipe.base_dir)
    got = shares(filtered, 5)
    assert abs(got[1] - 0.5) < 0.05, f"version 5 with a filter: the half-bad dataset realized {got[1]:.3f}"


def test_a_record_over_max_record_bytes_weighs_one_byte_as_planned(tmp_path):
    """A record above ``max_record_bytes`` is planned as 1 byte (it reads back bad, unread): the
    estimate weighs it so, not by its size."""
    docs = [d[:400] for d in generate_documents("web", 60, seed=9)]
    lines = [json.dumps({"text": d}) for d in docs] + [json.dumps({"text": "x" * 5000})] * 20
    os.makedirs(tmp_path / "web")
    (tmp_path / "web" / "a.jsonl").write_text("\n".join(lines) + "\n")
    cfg = {
        "seed": 5,
        "lanes": 2,
        "seq_len": 64,
        "global_batch_size": 2,
        "cache_dir": str(tmp_path / "cache"),
        "tokenizer": {"path": TOKENIZER_DIR},
        "datasets": [{"name": "web", "path": "web/*.jsonl", "on_error": "skip", "max_record_bytes": 2000}],
    }
    r = Recipe.from_dict(cfg, str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSamplesWarning)
        v4 = r.replace(data_version=4).prepare().estimates["web"]
        p = r.replace(data_version=5).prepare()
    v5 = p.estimates["web"]
    sizes = p.indexes[0].record_bytes(0)
    good = int(sizes[sizes <= 2000].sum())
    assert v4.sampled == v5.sampled == 60 and sum(n for n, _ in v5.bad.values()) == 20
    assert v5.tokens_per_byte == pytest.approx(v4.tokens_per_byte * good / (good + 20))
