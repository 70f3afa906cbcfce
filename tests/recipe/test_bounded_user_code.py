"""User code run before the run (pre-run checks, token estimation) is bounded in time: a slow
function or a catastrophically backtracking regular expression is refused within about
``[workers] timeout_s``, naming the rule and the record, instead of hanging the main process."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import regex

from zephon import Recipe, WorkerConfig
from zephon.data import BUNDLED_TOKENIZER
from zephon.engine import WorkerError
from zephon.nodes import FilterError, FilterRule
from zephon.recipe import RecipeError


def _raw(tmp_path, filters, timeout_s=1.0, texts=None):
    os.makedirs(tmp_path / "d", exist_ok=True)
    texts = texts or [f"record {i} has some words e" for i in range(40)]
    with open(tmp_path / "d" / "0.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return {
        "seed": 3,
        "lanes": 2,
        "seq_len": 16,
        "global_batch_size": 2,
        "cache_dir": str(tmp_path / "cache"),
        "tokenizer": {"path": BUNDLED_TOKENIZER},
        "datasets": [{"name": "d", "path": "d/*.jsonl", "policy": "stop"}],
        "shuffle": {"buffer": 1},
        "workers": {"timeout_s": timeout_s},
        "filters": filters,
    }


@pytest.mark.parametrize(
    "kind,function",
    [
        ("function", "slow_user_code:sleepy"),
        ("transform", "slow_user_code:sleepy_transform"),
        ("stateful", "slow_user_code:SleepyStateful"),
    ],
)
def test_a_slow_user_function_is_refused_within_the_bound(tmp_path, kind, function):
    raw = _raw(tmp_path, [{"name": "slow", "kind": kind, "function": function}])
    t0 = time.monotonic()
    with pytest.raises(
        RecipeError, match=r"'slow' .*did not return within 1 s on dataset 'd', file '.*0\.jsonl', line"
    ):
        Recipe.from_dict(raw, str(tmp_path)).prepare()
    assert time.monotonic() - t0 < 20  # the function sleeps 30 s per call: refused at the bound, not after it


def test_a_fast_user_function_is_not_affected(tmp_path):
    raw = _raw(
        tmp_path, [{"name": "ok", "kind": "function", "function": "slow_user_code:sleepy", "params": {"word": "zz"}}]
    )
    r = Recipe.from_dict(raw, str(tmp_path))
    with r.global_loader(1, workers=WorkerConfig(0), prefetch=0) as g:
        assert len(list(g)) > 0


def test_a_user_function_that_hangs_during_an_inline_run_is_reported_within_timeout_s(tmp_path):
    """``[workers] count = 0``: the mapper asks for each chunk in the lane's own thread, and a
    user function that never returns there is reported within ``timeout_s`` naming the record
    and the line it is stuck at, as thread and process workers do (before: no error, the run
    waited for the call; here it returns after 6 s and the run went on as if nothing happened)."""
    import slow_user_code

    raw = _raw(tmp_path, [{"name": "hang", "kind": "function", "function": "slow_user_code:hangs_when_set"}])
    r = Recipe.from_dict(raw, str(tmp_path))
    r.prepare()  # the pre-run checks pass: the function hangs only from here on
    slow_user_code.HANG.set()
    try:
        with (
            pytest.raises(WorkerError) as got,
            r.global_loader(1, workers=WorkerConfig(0, timeout_s=1), prefetch=0) as g,
        ):
            next(g)
    finally:
        slow_user_code.HANG.clear()
    msg = str(got.value)
    assert "no result within 1 s from zephon.nodes.stages.pipeline.RecordPipeline on " in msg, msg
    assert "dataset #0, shard #0, record " in msg, msg  # the record(s)
    assert "slow_user_code.py" in msg and " in hangs_when_set" in msg, msg  # the function, by where it is stuck


def test_catastrophic_backtracking_does_not_hang_estimation(tmp_path):
    """``(a+)+$`` on a's and '!' hangs Python's re (exponential); the regex engine answers at once,
    and a pattern it too backtracks on is stopped at the bound, naming the rule and the record."""
    texts = ["a" * 30 + "!"] + [f"record {i} e" for i in range(30)]  # re: about 2**30 steps
    raw = _raw(tmp_path, [{"name": "nested", "kind": "regex", "pattern": "(a+)+$"}], texts=texts)
    t0 = time.monotonic()
    Recipe.from_dict(raw, str(tmp_path)).prepare()
    assert time.monotonic() - t0 < 30
    texts[0] = "a" * 60 + "!"  # the regex engine too backtracks on (a|aa)+$: about 1.6**60 steps
    raw = _raw(tmp_path, [{"name": "alt", "kind": "regex", "pattern": "(a|aa)+$"}], texts=texts)
    t0 = time.monotonic()
    with pytest.raises(
        RecipeError,
        match=r"filter 'alt' \(regex '\(a\|aa\)\+\$'\) did not finish matching within 1 s "
        r"on dataset 'd', file '.*0\.jsonl', line 1: .*rewrite it",
    ):
        Recipe.from_dict(raw, str(tmp_path)).prepare()
    assert time.monotonic() - t0 < 30


def test_a_regex_timeout_in_a_worker_names_the_record():
    rule = FilterRule("alt", "regex", params={"pattern": "(a|aa)+$", "action": "exclude"}, timeout=0.2)
    with pytest.raises(FilterError, match="did not finish matching within 0.2 s on {record}"):
        rule.apply(0, 0, 0, "a" * 60 + "!")


PATTERNS = [r"\bthe\b", r"(?i)lorem ipsum", r"^\s*$", r"\d{3,}", r"[A-Z][a-z]+ [A-Z]", r"(?m)^#+ ", r"e$", r"(\w)\1"]


def test_the_regex_engine_matches_as_re_does():
    from zephon.tools.synth import generate_documents

    texts = [str(d) for style in ("web", "code", "books") for d in generate_documents(style, 60, seed=1)]
    texts += ["the", "There", "lorem IPSUM", "   ", "", "1234", "Hello World", "# t", "aa", "é e", "naïve the\n"]
    for p in PATTERNS:
        a, b = re.compile(p), regex.compile(p)
        assert [bool(a.search(t)) for t in texts] == [bool(b.search(t, timeout=5)) for t in texts], p


def test_a_stateful_class_slow_to_build_is_refused_when_the_recipe_is_read(tmp_path):
    raw = _raw(tmp_path, [{"name": "slow", "kind": "stateful", "function": "slow_user_code:SlowToBuild"}])
    t0 = time.monotonic()
    with pytest.raises(
        RecipeError, match=r"'slow' .*did not return within 1 s when built as slow_user_code:SlowToBuild"
    ):
        Recipe.from_dict(raw, str(tmp_path))
    assert time.monotonic() - t0 < 20
