"""[fork] of every kind of recipe: finite ones (every dataset ``policy = "stop"``: the fork ends
where its own data ends), chat, image-text and pretokenized ones. One matrix: for each parent,
the fork's batches before its step are the parent's, and the same on W = 1, 2, 4; a resume
mid-fork on another W continues them; the parent's checkpoint at the step continues under the
fork; the fork's checkpoint is refused by the parent and the parent's by the fork."""

from __future__ import annotations

import glob
import json
import os
import pathlib
import sys
import sysconfig

import numpy as np
import pytest
from text_fixtures import write_corpus, write_recipe
from toml_writer import to_toml
from vl_fixtures import vl_config, write_vl_root

from zephon import Recipe, StateError, WorkerConfig, batch_sha256
from zephon.data import BUNDLED_TOKENIZER, TextTokenizer, write_tokens
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.engine.testing import check_node
from zephon.recipe import RecipeError
from zephon.tools.chat_demo import write_chat_recipe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: steps run of a fork that never ends (a finite one runs to its end)
STEPS = 10
STOP = 'policy = "stop"\n'


def _text(root: str, finite: bool) -> dict:
    write_corpus(root, scale=0.02)
    stop = STOP if finite else ""
    path = write_recipe(root, "base.toml", buffer=4, web_extra=stop, code_extra=stop, books_extra=stop)
    with open(path, "rb") as f:
        return tomllib.load(f)


def _chat(root: str, finite: bool) -> dict:
    path = write_chat_recipe(root, seq_len=256, conversations=160)
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    if finite:
        for d in cfg["datasets"]:
            d["policy"] = "stop"
    return cfg


def _vision(root: str, finite: bool) -> dict:
    write_vl_root(pathlib.Path(root), seed=1, text_scale=0.005, n_wds=24, n_parquet=12, n_interleaved=8)
    cfg = vl_config(root)
    if finite:
        for d in cfg["datasets"]:
            d["policy"] = "stop"
    return cfg


def _pretokenized(root: str, finite: bool) -> dict:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:60]
    texts = [open(f, encoding="utf-8", errors="replace").read()[:3000] for f in files]
    tok = TextTokenizer(BUNDLED_TOKENIZER, True, True)
    os.makedirs(os.path.join(root, "npy"), exist_ok=True)
    write_tokens(os.path.join(root, "npy", "a.npy"), [np.asarray(a) for a in tok.encode_batch(texts[:40])], "uint16")
    with open(os.path.join(root, "web.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[40:])
    stop = {"policy": "stop"} if finite else {}
    return {
        "seed": 7,
        "lanes": 8,
        "seq_len": 64,
        "global_batch_size": 16,
        "cache_dir": "cache",
        "tokenizer": {"path": BUNDLED_TOKENIZER},
        "shuffle": {"buffer": 8},
        "workers": {"count": 0},
        "datasets": [
            {"name": "code", "path": "npy/*.npy", "format": "tokens", "weight": 0.5, **stop},
            {"name": "web", "path": "web.jsonl", "weight": 0.5, **stop},
        ],
    }


MAKE = {"text": _text, "chat": _chat, "vision": _vision, "pretokenized": _pretokenized}
#: (kind, finite): text forks that never end are tests/recipe/test_fork.py's
CASES = [("text", True), ("chat", True), ("chat", False), ("vision", True), ("vision", False)]
CASES += [("pretokenized", True), ("pretokenized", False)]


def run(recipe, world, steps=None, state=None, workers=WorkerConfig(0)):
    """The batches' hashes (``steps`` of them, or to the end) and the state after them."""
    out = []
    with recipe.global_loader(world, workers=workers) as g:
        if state is not None:
            g.load_state_dict(state)
        while steps is None or len(out) < steps:
            try:
                out.append(batch_sha256(next(g)))
            except StopIteration:
                assert steps is None, "the run ended early"
                break
        return out, decode_state(encode_state(g.state_dict()))


class Case:
    """A parent recipe of one kind, a fork of it (the first dataset's weight changed, the last
    dataset removed) at step ``step``, and the fork's batches on W = 1."""

    def __init__(self, root: str, kind: str, finite: bool) -> None:
        cfg = MAKE[kind](root, finite)
        cfg.pop("fork", None)
        with open(os.path.join(root, "parent.toml"), "w", encoding="utf-8") as f:
            f.write(to_toml(cfg))
        self.parent = Recipe.from_toml(os.path.join(root, "parent.toml"))
        head, _ = run(self.parent, 1, None if finite else STEPS)
        self.finite, self.parent_batches = finite, head
        self.step = max(1, len(head) // 3) if finite else 4
        fork = dict(
            cfg, datasets=[dict(d) for d in cfg["datasets"][:-1]], fork={"parent": "parent.toml", "step": self.step}
        )
        fork["datasets"][0]["weight"] = round(fork["datasets"][0]["weight"] * 2, 3)
        self.fork = Recipe.from_dict(fork, root)
        self.batches, _ = run(self.fork, 1, None if finite else STEPS)


@pytest.fixture(scope="module", params=CASES, ids=[f"{k}-{'stop' if f else 'repeat'}" for k, f in CASES])
def case(request, tmp_path_factory):
    kind, finite = request.param
    return Case(str(tmp_path_factory.mktemp(f"fork_{kind}")), kind, finite)


def test_prefix_is_the_parents_and_the_same_on_every_world_size(case):
    s = case.step
    assert case.batches[:s] == case.parent_batches[:s]
    assert case.batches[s:] and case.batches[s] != case.parent_batches[s]
    for world, workers in ((2, WorkerConfig(0)), (4, WorkerConfig(2, "thread"))):
        assert run(case.fork, world, None if case.finite else STEPS, workers=workers)[0] == case.batches
    if case.finite:  # it ends where its own data ends: its own count, not the parent's
        with case.fork.global_loader(1) as g:
            assert g.end.steps == len(case.batches)


def test_resume_mid_fork_on_another_world_size(case):
    at = case.step + 2
    head, state = run(case.fork, 2, at)
    tail, _ = run(case.fork, 4, None if case.finite else STEPS - at, state=state)
    assert head + tail == case.batches


def test_parent_checkpoint_continues_and_each_refuses_the_others(case):
    head, theirs = run(case.parent, 4, case.step)
    tail, _ = run(case.fork, 1, None if case.finite else STEPS - case.step, state=case.fork.continue_state(theirs))
    assert head + tail == case.batches
    with (
        case.fork.global_loader(2) as g,
        pytest.raises(
            StateError, match=r"not a fork's: if it is the parent run's, convert it with recipe.continue_state"
        ),
    ):
        g.load_state_dict(theirs)
    _, mine = run(case.fork, 2, case.step + 1)
    with case.parent.global_loader(2) as g, pytest.raises(StateError):
        g.load_state_dict(mine)


@pytest.fixture(scope="module")
def finite_text(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fork_end"))
    write_corpus(root, scale=0.02)
    parent = write_recipe(root, "parent.toml", buffer=4, web_extra=STOP, code_extra=STOP, books_extra=STOP)
    with open(parent, "rb") as f:
        cfg = tomllib.load(f)
    return root, cfg, Recipe.from_toml(parent)


def test_a_fork_at_the_parents_end_reads_a_dataset_it_adds(finite_text):
    """An SFT-style continuation: the parent ends (its lanes padded to its last step), the fork adds
    a dataset at that step and ends where the added data ends; the same on every W."""
    root, cfg, parent = finite_text
    theirs, _ = run(parent, 1)
    datasets = [*cfg["datasets"], {**cfg["datasets"][0], "name": "web2", "path": "web/*.jsonl"}]
    fork = Recipe.from_dict(dict(cfg, datasets=datasets, fork={"parent": "parent.toml", "step": len(theirs)}), root)
    mine, _ = run(fork, 1)
    assert mine[: len(theirs)] == theirs and len(mine) > len(theirs)
    assert run(fork, 4)[0] == mine
    head, state = run(fork, 2, len(theirs) + 1)
    assert head + run(fork, 4, state=state)[0] == mine
    # each fork lane's checkpoint contract, through the parent's padding and the switch at the step
    ctx = fork.lane_context(1, WorkerConfig(0))
    check_node(lambda: fork.build_lane(ctx), max_steps=len(mine), every=2, compare_steps=3)


def test_a_fork_after_the_parents_end_is_refused(finite_text):
    root, cfg, parent = finite_text
    n = len(run(parent, 1)[0])
    fork = Recipe.from_dict(dict(cfg, fork={"parent": "parent.toml", "step": n + 1}), root)
    with pytest.raises(RecipeError, match=rf"\[fork\] step {n + 1} is after the parent run's last step .* <= {n}"):
        run(fork, 1, 1)
