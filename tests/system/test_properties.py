"""Property-based: random recipes, world-size/worker chains and checkpoint steps give the
uninterrupted run's bytes, and every document is delivered exactly once per epoch.

CI runs a bounded number of examples; `HYPOTHESIS_PROFILE=nightly` runs many more.
"""

from __future__ import annotations

import collections
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reliability import make_data

from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.engine import LaneContext
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.tools.demo import TOKENIZER_DIR
from zephon.tools.synth import generate_documents, write_text_lines

settings.register_profile("ci", max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("nightly", max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ROOT = None


def corpus() -> str:
    global ROOT
    if ROOT is None:
        import tempfile

        ROOT = tempfile.mkdtemp(prefix="zephon-prop-")
        make_data(ROOT, n_good=60)  # web: JSONL with 12 bad lines; code: Parquet
        os.makedirs(f"{ROOT}/books")
        write_text_lines(f"{ROOT}/books/b.txt", generate_documents("books", 12, seed=3))
    return ROOT


@st.composite
def recipes(draw):
    lanes = draw(st.sampled_from([1, 2, 4, 6, 8]))
    weights = [draw(st.integers(1, 10)) for _ in range(3)]
    return {
        "seed": draw(st.integers(0, 2**31)),
        "lanes": lanes,
        "seq_len": draw(st.sampled_from([16, 32, 96])),
        "global_batch_size": lanes * draw(st.sampled_from([1, 2])),
        "cache_dir": "cache",
        "tokenizer": {"path": TOKENIZER_DIR, "add_bos": draw(st.booleans())},
        "datasets": [
            {"name": "web", "path": "web/*.jsonl", "weight": weights[0], "on_error": "skip"},
            {"name": "code", "path": "code/*.parquet", "weight": weights[1]},
            {"name": "books", "path": "books/*.txt", "format": "text", "weight": weights[2]},
        ],
        "pack": {
            "algorithm": draw(st.sampled_from(["greedy", "first_fit", "best_fit"])),
            "flush_every": draw(st.sampled_from([2, 8, 64])),
            "max_open": draw(st.sampled_from([1, 4])),
            "labels": draw(st.sampled_from(["row", "document"])),
        },
        "shuffle": {"buffer": draw(st.sampled_from([1, 3, 8]))},
        "mixing": {
            "by": draw(st.sampled_from(["tokens", "samples"])),
            "split_tokens": draw(st.sampled_from([0, 40, 200])),
        },
    }


@st.composite
def chains(draw, lanes):
    divisors = [w for w in range(1, lanes + 1) if lanes % w == 0]
    hops = draw(
        st.lists(
            st.tuples(st.sampled_from(divisors), st.integers(1, 7), st.sampled_from([0, 1, 2])), min_size=2, max_size=4
        )
    )
    return hops


@given(data=st.data())
def test_chained_runs_equal_the_reference(data):
    cfg = data.draw(recipes())
    recipe = Recipe.from_dict(cfg, corpus())
    hops = data.draw(chains(cfg["lanes"]))
    total = sum(steps for _, steps, _ in hops)
    with recipe.global_loader(1, workers=WorkerConfig(0)) as g:
        ref = [batch_sha256(next(g)) for _ in range(total)]
    got, state = [], None
    for world, steps, workers in hops:
        with recipe.global_loader(world, workers=WorkerConfig(workers, "thread")) as g:
            if state is not None:
                g.load_state_dict(state)
            got += [batch_sha256(next(g)) for _ in range(steps)]
            state = decode_state(encode_state(g.state_dict()))
    assert got == ref


_EXPECTED = {}


def expected_tokens(recipe: Recipe) -> collections.Counter:
    key = recipe.spec.tokenizer.add_bos
    if key not in _EXPECTED:
        p = recipe.prepare()
        c = collections.Counter()
        for ix in p.indexes:
            for s in range(len(ix.shards)):
                texts = [t for t in ix.read(s, list(range(ix.shards[s].num_records))) if isinstance(t, str)]
                for toks in p.tokenizer.encode_batch(texts):
                    c.update(toks.tolist())
        _EXPECTED[key] = c
    return _EXPECTED[key]


@settings(max_examples=int(os.environ.get("ZEPHON_ONCE_EXAMPLES", "5")))
@given(cfg=recipes())
def test_every_document_exactly_once_per_epoch(cfg):
    cfg = dict(cfg, global_batch_size=cfg["lanes"])  # one row per lane per step: nothing dropped at the end
    # a row's last token is counted from its last label: with labels = "document" that label is
    # -100 where a document starts on the row's last token
    cfg["pack"] = dict(cfg["pack"], labels="row")
    # the expected tokens are whole documents tokenized at once, which is what token-range parts
    # deliver; parts cut from the text (split_mode = "text") are tokenized on their own, and their
    # tiling is proven in tests/recipe/test_tokenize_work.py
    cfg["mixing"] = dict(cfg["mixing"], split_mode="tokens")
    for d in cfg["datasets"]:
        d["policy"] = "stop"
    recipe = Recipe.from_dict(cfg, corpus())
    got = collections.Counter()
    for lane in range(recipe.lanes):
        node = recipe.build_lane(LaneContext(seed=recipe.seed, lane=lane, lanes=recipe.lanes))
        for b in node:
            m = b["document_ids"] >= 0
            got.update(b["input"][m].tolist())
            for i in range(len(b["input"])):
                if m[i, -1] and b["labels"][i, -1] != -100:
                    got[int(b["labels"][i, -1])] += 1
        node.close()
    exp = expected_tokens(recipe)
    assert got == exp, f"{sum((exp - got).values())} tokens lost, {sum((got - exp).values())} duplicated"
