"""Impossible recipe values are refused before anything is allocated, naming the key and the bound;
token estimation costs a bounded amount per sampled record; an oversized record is a bad record
the plan does not split into thousands of parts."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from zephon import Recipe, RecipeError
from zephon.data import TextTokenizer, index_dataset
from zephon.recipe.estimate import ESTIMATE_BYTES, estimate_tokens
from zephon.recipe.keys import LIMITS, max_workers
from zephon.tools.demo import TOKENIZER_DIR
from zephon.tools.synth import generate_documents


def cfg(**over):
    base = {
        "seed": 1,
        "lanes": 4,
        "seq_len": 64,
        "global_batch_size": 8,
        "tokenizer": {"path": TOKENIZER_DIR},
        "datasets": [{"name": "web", "path": "web/*.jsonl"}],
    }
    base.update(over)
    return base


ABSURD = {
    "lanes": (dict(lanes=10**9, global_batch_size=10**9), r"lanes = 1000000000 is above its limit of 65536"),
    "seq_len": (dict(seq_len=10**9), r"seq_len = 1000000000 is above its limit of 1048576"),
    "global_batch_size": (dict(global_batch_size=400_000_000), "global_batch_size = 400000000 is above its limit"),
    "lane_tokens": (dict(lanes=1, global_batch_size=65536, seq_len=4096), "tokens in one lane's micro-batch"),
    "shuffle": (dict(shuffle={"buffer": 10**9}), r"\[shuffle\].buffer = 1000000000 is above its limit"),
    "shuffle_tokens": (dict(shuffle={"buffer": 1 << 20}, seq_len=4096), "held by each lane's shuffle window"),
    "workers": (dict(workers={"count": 100_000}), rf"\[workers\].count = 100000 is above its limit of {max_workers()}"),
    "tokenize_workers": (dict(tokenize={"workers": 100_000}), r"\[tokenize\].workers = 100000 is above its limit"),
    "chunk_size": (dict(workers={"chunk_size": 10**9}), r"\[workers\].chunk_size = 1000000000 is above its limit"),
    "flush_every": (dict(pack={"flush_every": 10**12}), r"\[pack\].flush_every = 1000000000000 is above its limit"),
    "max_open": (dict(pack={"max_open": 10**6}), r"\[pack\].max_open = 1000000 is above its limit"),
    "estimate_samples": (dict(mixing={"estimate_samples": 10**9}), "estimate_samples = 1000000000 is above"),
    "timeout": (dict(workers={"timeout_s": 1e12}), r"\[workers\].timeout_s = 1000000000000.0 is above its limit"),
    "prefetch": (dict(workers={"prefetch": 10**9}), r"\[workers\].prefetch = 1000000000 is above its limit"),
    "seed": (dict(seed=2**70), "seed = .* is above its limit"),
    "record_bytes": (
        dict(datasets=[{"name": "web", "path": "web/*.jsonl", "max_record_bytes": 1 << 40}]),
        "max_record_bytes = 1099511627776 is above its limit",
    ),
    "epochs": (
        dict(datasets=[{"name": "web", "path": "w", "policy": "stop", "epochs": 10**12}]),
        "epochs = 1000000000000 is above its limit",
    ),
    "vision_pixels": (dict(vision={"max_pixels": 10**12}), r"\[vision\].max_pixels = 1000000000000 is above"),
}


@pytest.mark.parametrize("case", list(ABSURD))
def test_absurd_values_are_refused_naming_key_and_bound(case):
    over, match = ABSURD[case]
    with pytest.raises(RecipeError, match=match):
        Recipe.from_dict(cfg(**over))


def test_the_limits_leave_room_for_real_runs():
    """Large but real settings pass: 4096 lanes, 128k-token rows, 1024 rows per step, a 4096-row
    shuffle window of 8k rows, 64 workers."""
    Recipe.from_dict(cfg(lanes=4096, global_batch_size=4096 * 4, seq_len=8192, shuffle={"buffer": 4096}))
    Recipe.from_dict(cfg(lanes=8, global_batch_size=8, seq_len=131072, shuffle={"buffer": 512}))
    Recipe.from_dict(cfg(workers={"count": 64, "chunk_size": 4096}))
    assert LIMITS["lanes"] >= 65536 and LIMITS["seq_len"] >= 1 << 20


def test_estimation_tokenizes_a_bounded_prefix_of_long_records(tmp_path):
    class Recording(TextTokenizer):
        seen: list = []

        def encode_content(self, texts):
            Recording.seen.extend(len(t.encode("utf-8")) for t in texts)
            return super().encode_content(texts)

    long_doc = " ".join(generate_documents("web", 400, seed=2))  # ~ hundreds of KB, one record
    short = generate_documents("web", 30, seed=3)
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(json.dumps({"text": d}) for d in [long_doc, *short]) + "\n")
    ix = index_dataset("web", str(p), cache_dir=str(tmp_path / "c"))
    tok = Recording(TOKENIZER_DIR)
    est = estimate_tokens(ix, tok, seed=1, samples=64, ds_number=0)
    assert max(Recording.seen) <= ESTIMATE_BYTES and len(long_doc) > 4 * ESTIMATE_BYTES
    full = sum(len(x) for x in TextTokenizer(TOKENIZER_DIR).encode_content([long_doc, *short]))
    exact = full / sum(int(n) for n in ix.record_bytes(0))
    assert abs(est.tokens_per_byte - exact) / exact < 0.02  # the prefix extrapolates well


def test_a_gzip_bomb_dataset_fails_fast_naming_the_limit(tmp_path):
    os.makedirs(tmp_path / "web")
    with gzip.GzipFile(tmp_path / "web" / "b.jsonl.gz", "wb", mtime=0) as g:
        g.write(b'{"text": "' + b"a" * (48 << 20) + b'"}\n')
    r = Recipe.from_dict(
        cfg(
            datasets=[{"name": "web", "path": "web/*.jsonl.gz", "max_record_bytes": 1 << 20}],
            cache_dir=str(tmp_path / "cache"),
        ),
        str(tmp_path),
    )
    with pytest.raises(RecipeError, match="dataset 'web'.*more than max_record_bytes = 1048576 .*size limit"):
        r.prepare()


def test_an_oversized_record_is_planned_as_one_part(tmp_path):
    os.makedirs(tmp_path / "web")
    docs = generate_documents("web", 20, seed=5)
    docs[3] = "z" * 200_000
    (tmp_path / "web" / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    r = Recipe.from_dict(
        cfg(
            datasets=[{"name": "web", "path": "web/*.jsonl", "max_record_bytes": 100_000}],
            cache_dir=str(tmp_path / "cache"),
        ),
        str(tmp_path),
    )
    ds = r.prepare().plan.datasets[0]
    assert ds.parts(int(ds.record_weight(0)[3])) == 1
    assert (
        r.prepare().fingerprint
        != Recipe.from_dict(
            cfg(datasets=[{"name": "web", "path": "web/*.jsonl"}], cache_dir=str(tmp_path / "cache")), str(tmp_path)
        )
        .prepare()
        .fingerprint
    )  # a changed limit is a changed data definition
