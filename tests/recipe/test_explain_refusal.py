"""A refused resume names the filter or fork that differs from the checkpoint's recipe."""

from __future__ import annotations

import pytest
from text_fixtures import write_corpus, write_recipe

from zephon import Recipe, StateError
from zephon.engine.checkpoint import decode_state, encode_state

REGEX = """
[[filters]]
name = "no-the"
kind = "regex"
pattern = "\\\\bthe\\\\b"
datasets = ["web"]
"""
LENGTH = """
[[filters]]
name = "long"
kind = "length"
unit = "tokens"
max = {max}
datasets = ["web", "code"]
"""
FORK = """
[fork]
parent = "base.toml"
step = {step}
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("explain")
    write_corpus(str(root))
    return str(root)


def recipe(root, name, extra=""):
    return Recipe.from_toml(write_recipe(root, name, extra=extra))


def state_of(r, steps=2):
    with r.global_loader(1, prefetch=0) as g:
        for _ in range(steps):
            next(g)
        return decode_state(encode_state(g.state_dict()))


def refusal(r, state):
    with r.global_loader(2, prefetch=0) as g, pytest.raises(StateError, match="the recipe changed") as e:
        g.load_state_dict(state)
    return str(e.value)


def test_refusal_names_a_filter_added_removed_or_changed(root):
    base = recipe(root, "base.toml")
    one = recipe(root, "one.toml", REGEX + LENGTH.format(max=300))
    msg = refusal(one, state_of(base))
    assert "The [[filters]] differ from the checkpoint's: added 'no-the' (regex); added 'long' (length)" in msg
    assert "declare it a fork: [fork] parent = " in msg
    assert "removed 'no-the' (regex); removed 'long' (length)" in refusal(base, state_of(one))
    other = recipe(root, "other.toml", REGEX + LENGTH.format(max=301))
    msg = refusal(other, state_of(one))
    assert "changed 'long' (its settings, or its function's code)" in msg and "no-the" not in msg


def test_refusal_names_the_fork(root):
    base = recipe(root, "base.toml")
    fork6 = recipe(root, "fork6.toml", FORK.format(step=6) + REGEX)
    fork4 = recipe(root, "fork4.toml", FORK.format(step=4) + REGEX)
    written = state_of(fork6)
    assert "written by a fork at step 6; this recipe's [fork] step is 4: set step = 6" in refusal(fork4, written)
    msg = refusal(base, written)
    assert "The checkpoint was written by a fork (of the run with fingerprint " in msg and "at step 6" in msg
    assert "It is the parent run's checkpoint: convert it with recipe.continue_state(state)" in refusal(
        fork6, state_of(base)
    )
    # the conversion resumes it
    converted = fork6.continue_state(state_of(base))
    with fork6.global_loader(2, prefetch=0) as g:
        g.load_state_dict(converted)
        next(g)
