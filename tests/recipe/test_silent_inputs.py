"""Careless and hostile inputs that changed data silently or blamed the wrong thing (round four):
NaN and booleans in field filters, the tokenizer's identity in the data definition, an EOS id that
is a word's, a fork that changes seq_len, and the fork resume from the command line."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from text_fixtures import write_corpus, write_recipe

from zephon import Recipe, StateError, batch_sha256
from zephon.data import BUNDLED_TOKENIZER, TextTokenizer
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.nodes import FieldError, FilterRule, FilterVerdict
from zephon.recipe import RecipeError
from zephon.tools.demo import TOKENIZER_DIR


# -- field filters: NaN is a bad value, a bool is not a number ------------------------------------
def _rule(**params):
    return FilterRule("q", "field", params=params)


def test_a_nan_field_value_is_an_error_never_a_pass():
    for params in ({"field": "score", "min": 0.3}, {"field": "score", "max": 0.3}, {"field": "score", "not_in": [1]}):
        with pytest.raises(FieldError, match=r"filter 'q' \(field 'score'\): the value is NaN .*on \{record\}"):
            _rule(**params).apply(0, 0, 0, "text", len, {"score": math.nan})
    assert _rule(field="score", min=0.3).apply(0, 0, 0, "text", len, {"score": 0.5}) == "text"


def test_a_bool_is_not_a_number_in_a_set():
    assert isinstance(_rule(field="flag", **{"in": [1]}).apply(0, 0, 0, "t", len, {"flag": True}), FilterVerdict)
    assert _rule(field="flag", not_in=[1]).apply(0, 0, 0, "t", len, {"flag": True}) == "t"
    assert _rule(field="flag", **{"in": [True]}).apply(0, 0, 0, "t", len, {"flag": True}) == "t"
    assert _rule(field="n", **{"in": [1]}).apply(0, 0, 0, "t", len, {"n": 1.0}) == "t"


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("nan")
    os.makedirs(root / "web")
    texts = [f"document {i} " + "word " * (5 + i % 7) for i in range(60)]
    scores = [math.nan if i % 5 == 0 else (i % 10) / 10 for i in range(60)]
    pq.write_table(
        pa.table({"text": texts, "score": scores, "flag": [i % 2 == 0 for i in range(60)]}), root / "web" / "0.parquet"
    )
    return root


def _recipe(root, filters, **web):
    return Recipe.from_dict(
        {
            "seed": 1,
            "lanes": 2,
            "seq_len": 32,
            "global_batch_size": 4,
            "cache_dir": str(root / "cache"),
            "tokenizer": {"path": BUNDLED_TOKENIZER},
            "datasets": [{"name": "web", "path": "web/*.parquet", "format": "parquet", "weight": 1.0, **web}],
            "pack": {"flush_every": 8},
            "filters": filters,
        },
        str(root),
    )


def test_nan_in_the_data_names_rule_file_and_record_or_is_a_counted_skip(scored):
    rule = [{"name": "good", "kind": "field", "field": "score", "min": 0.3}]
    with pytest.raises(RecipeError, match=r"filter 'good' \(field 'score'\): the value is NaN.*0\.parquet"):
        _recipe(scored, rule).prepare()
    r = _recipe(scored, rule, on_error="skip", max_skipped_fraction=0.5)
    with r.global_loader(1, prefetch=0) as g:
        for _ in range(6):
            next(g)
        skips = [m for ms in g.routers[0].lane_metrics().values() for m in ms if m["node"] == "SkipCounter"]
    assert sum(m["skipped"]["web"] for m in skips) > 0
    assert {b["reason"] for m in skips for b in m["by_file"]} == {"field 'score' is NaN"}


@pytest.mark.parametrize(
    "entry,message",
    [
        ({"min": math.nan}, "min must be a number, got nan: NaN compares false"),
        ({"max": math.nan}, "max must be a number, got nan"),
        ({"in": [1.0, math.nan]}, "in holds NaN"),
    ],
)
def test_nan_bounds_in_a_recipe_are_refused(scored, entry, message):
    with pytest.raises(RecipeError, match=message):
        _recipe(scored, [{"name": "q", "kind": "field", "field": "score", **entry}])


def test_true_does_not_match_one_in_a_recipe(scored):
    ones = _recipe(scored, [{"name": "q", "kind": "field", "field": "flag", "in": [1]}])
    trues = _recipe(scored, [{"name": "q", "kind": "field", "field": "flag", "in": [True, 1]}])
    assert trues.data_definition()["filters"][0]["params"]["in"] == [1, True]  # a bool never merged with 1
    with pytest.raises(RecipeError, match=r"the \[\[filters\]\] drop all 60 records"):
        ones.prepare()  # no value is the number 1: nothing is kept


# -- the tokenizer's identity ---------------------------------------------------------------------
def _other_tokenizer(folder) -> str:
    """The bundled tokenizer with one more added token: the same ids for plain text, another file."""
    shutil.copytree(TOKENIZER_DIR, folder)
    path = os.path.join(folder, "tokenizer.json")
    d = json.load(open(path))
    top = max(t["id"] for t in d["added_tokens"])
    top = max(top, max(d["model"]["vocab"].values()))
    d["added_tokens"].append(dict(d["added_tokens"][-1], id=top + 1, content="<|other|>"))
    json.dump(d, open(path, "w"))
    return str(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(str(root), scale=0.03)
    write_recipe(str(root), "parent.toml")
    _other_tokenizer(root / "other_tok")
    return root


def _fork(corpus, name, step=2, tokenizer=None, text_edit=None):
    path = write_recipe(str(corpus), name, extra=f'\n[fork]\nparent = "parent.toml"\nstep = {step}\n')
    text = open(path).read().replace("weight = 0.5", "weight = 0.4", 1)
    if tokenizer is not None:
        text = text.replace(TOKENIZER_DIR, tokenizer)
    if text_edit is not None:
        text = text_edit(text)
    open(path, "w").write(text)
    return Recipe.from_toml(path)


def test_tokenizer_identity_is_in_the_data_definition_from_version_4(corpus):
    parent = Recipe.from_toml(corpus / "parent.toml")
    other = parent.replace(tokenizer={"path": str(corpus / "other_tok")})
    assert parent.data_definition()["tokenizer"]["identity"] == parent.tokenizer.identity
    assert parent.tokenizer.identity != other.tokenizer.identity
    old = parent.replace(data_version=3)
    assert "identity" not in old.data_definition()["tokenizer"]


def test_a_fork_under_another_tokenizer_is_refused_naming_it(corpus):
    fork = _fork(corpus, "tokfork.toml", tokenizer=str(corpus / "other_tok"))
    with pytest.raises(RecipeError, match=r"\[fork\]: the tokenizer differs from the parent recipe's .*other_tok"):
        fork.prepare()
    v3 = _fork(
        corpus, "tokfork3.toml", tokenizer=str(corpus / "other_tok"), text_edit=lambda t: "data_version = 3\n" + t
    )
    with pytest.raises(RecipeError, match="the tokenizer differs"):
        v3.parent  # noqa: B018
    assert _fork(corpus, "samefork.toml").parent.fingerprint  # the same tokenizer forks


def test_a_resume_under_another_tokenizer_is_refused_naming_it(corpus):
    parent = Recipe.from_toml(corpus / "parent.toml")
    with parent.global_loader(2, prefetch=0) as g:
        next(g)
        state = decode_state(encode_state(g.state_dict()))
    other = parent.replace(tokenizer={"path": str(corpus / "other_tok")})
    with pytest.raises(StateError, match="tokenizer"), other.global_loader(1, prefetch=0) as g:
        g.load_state_dict(state)


def test_an_eos_id_that_is_a_words_id_is_refused_naming_the_word_and_the_fix(tmp_path):
    folder = tmp_path / "esal"
    shutil.copytree(TOKENIZER_DIR, folder)
    path = folder / "tokenizer.json"
    d = json.load(open(path))
    vocab = d["model"]["vocab"]
    vocab["esal"] = vocab["<|eos|>"]  # the word 'esal' shares the EOS id (a held-out tokenizer's flaw)
    json.dump(d, open(path, "w"))
    with pytest.raises(ValueError, match=r"EOS id 1 \('<\|eos\|>'\) .* ordinary vocabulary word 'esal'.*Fix:"):
        TextTokenizer(str(folder))
    TextTokenizer(str(folder), add_eos=False)  # not used as a boundary: nothing to forge
    with pytest.raises(RecipeError, match=r"\[tokenizer\]: the EOS id 1"):
        Recipe.from_toml(corpus_recipe(tmp_path, str(folder))).prepare()


def corpus_recipe(root, tok):
    write_corpus(str(root), scale=0.01)
    path = write_recipe(str(root))
    text = open(path).read().replace(TOKENIZER_DIR, tok)
    open(path, "w").write(text)
    return path


# -- messages that name the cause ------------------------------------------------------------------
def test_a_fork_that_changes_seq_len_names_seq_len(corpus):
    fork = _fork(corpus, "seqfork.toml", text_edit=lambda t: t.replace("seq_len = 64", "seq_len = 128"))
    with pytest.raises(RecipeError, match=r"\[fork\]: 'seq_len' differs from the parent recipe \(64 -> 128\)"):
        fork.parent  # noqa: B018


def zephon(*args):
    return subprocess.run(
        [sys.executable, "-m", "zephon", *map(str, args)], capture_output=True, text=True, timeout=600
    )


def test_the_parents_checkpoint_resumes_under_the_fork_from_the_command_line(corpus, tmp_path):
    fork = _fork(corpus, "clifork.toml", step=3)
    with fork.global_loader(1, prefetch=0) as g:
        ref = [batch_sha256(next(g)) for _ in range(5)]
    ck = tmp_path / "ck"
    saved = zephon(
        "hashes", corpus / "parent.toml", "--steps", 2, "--save-at", 2, "--checkpoint", ck, "--world-size", 2
    )
    assert saved.returncode == 0, saved.stderr
    out = zephon("hashes", corpus / "clifork.toml", "--steps", 3, "--resume", ck, "--world-size", 4)
    assert out.returncode == 0, out.stderr
    assert "the parent run's checkpoint: continuing it as the fork" in out.stderr
    assert [line.split()[2] for line in out.stdout.splitlines() if line.startswith("step ")] == ref[2:]


def test_hashes_help_names_the_state_file():
    from zephon.tools.cli import STATE_FILE

    out = zephon("hashes", "--help")
    assert STATE_FILE in " ".join(out.stdout.split()) and " state.json" not in out.stdout
