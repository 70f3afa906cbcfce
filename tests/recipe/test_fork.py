"""[fork]: a recipe continuing another's run from a declared step; the prefix is the parent's, byte for byte."""

from __future__ import annotations

import os
import sys

import pytest
from text_fixtures import write_corpus, write_recipe

from zephon import Recipe, StateError, WorkerConfig, batch_sha256
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.engine.testing import check_node
from zephon.recipe import RecipeError
from zephon.tools.ledger import RecipeSteps
from zephon.tools.ledger_diff import diff

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STEP = 6
STEPS = 12
FORK = """
[fork]
parent = "parent.toml"
step = {step}

[[filters]]
name = "no-the"
kind = "regex"
pattern = "\\\\bthe\\\\b"
datasets = ["web"]
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(str(root))
    return str(root)


@pytest.fixture(scope="module")
def parent(corpus):
    return Recipe.from_toml(write_recipe(corpus, "parent.toml"))


def fork_recipe(corpus, name="fork.toml", step=STEP, **kw):
    """The parent with web's weight changed, books removed, a filter added, forked at ``step``."""
    kw.setdefault("web_extra", "")
    path = write_recipe(corpus, name, extra=FORK.format(step=step), **kw)
    text = open(path).read().replace("weight = 0.5", "weight = 0.2", 1)
    books = text.index('[[datasets]]\nname = "books"')
    text = text[:books] + text[text.index("[pack]") :]
    open(path, "w").write(text)
    return Recipe.from_toml(path)


@pytest.fixture(scope="module")
def fork(corpus):
    return fork_recipe(corpus)


def run(recipe, world, steps, workers=WorkerConfig(0), state=None):
    with recipe.global_loader(world, workers=workers) as g:
        if state is not None:
            g.load_state_dict(state)
        out = [batch_sha256(next(g)) for _ in range(steps)]
        return out, decode_state(encode_state(g.state_dict()))


@pytest.fixture(scope="module")
def reference(fork):
    return run(fork, 1, STEPS)[0]


def test_prefix_is_the_parents_then_the_fork(parent, reference):
    theirs = run(parent, 2, STEPS)[0]
    assert reference[:STEP] == theirs[:STEP]
    assert all(a != b for a, b in zip(reference[STEP:], theirs[STEP:]))


@pytest.mark.parametrize("world,workers", [(4, WorkerConfig(2, "thread")), (8, WorkerConfig(0))])
def test_continuation_identical_across_world_sizes(fork, reference, world, workers):
    assert run(fork, world, STEPS, workers)[0] == reference


@pytest.mark.parametrize("at,w1,w2", [(3, 2, 4), (STEP, 4, 1), (STEP + 2, 1, 8)])
def test_continuation_identical_after_resumes(fork, reference, at, w1, w2):
    head, state = run(fork, w1, at)
    tail, _ = run(fork, w2, STEPS - at, state=state)
    assert head + tail == reference


def test_fork_lane_check_node(fork):
    ctx = fork.lane_context(2, WorkerConfig(0))
    check_node(lambda: fork.build_lane(ctx), max_steps=STEP + 4, every=2, compare_steps=3)


def test_ledger_diff_shows_the_fork_step(parent, fork):
    d = diff(RecipeSteps(parent), RecipeSteps(fork), steps=STEP + 2)
    assert d.first == STEP
    assert any("recipe difference: fork" in line for line in d.lines)


def test_fork_section_in_fingerprint(parent, fork, corpus):
    assert fork.fingerprint != parent.fingerprint
    assert fork_recipe(corpus, "fork7.toml", step=STEP + 1).fingerprint != fork.fingerprint
    assert fork.data_definition()["fork"] == {"parent": "parent.toml", "step": STEP}


def test_other_differences_refused_naming_them(corpus, parent):
    with pytest.raises(RecipeError, match=r"\[fork\]: 'seed' differs from the parent recipe \(77 -> 5\)"):
        fork_recipe(corpus, "bad.toml").replace(seed=5).parent  # noqa: B018
    r = fork_recipe(corpus, "bad2.toml", web_extra="on_error = 'skip'")
    with pytest.raises(RecipeError, match=r"dataset 'web': 'on_error' differs"):
        r.parent  # noqa: B018


def test_wrong_parent_fingerprint_refused(corpus, parent):
    path = write_recipe(
        corpus, "fp.toml", extra=FORK.format(step=STEP).replace("step =", 'fingerprint = "abc"\nstep =')
    )
    with pytest.raises(RecipeError, match="not the 'abc' the fork names"):
        Recipe.from_toml(path).parent  # noqa: B018


@pytest.mark.parametrize(
    "section,message",
    [
        ({"step": 3}, "needs parent"),
        ({"parent": "p.toml", "step": -1}, "step must be an integer"),
        ({"parent": "p.toml", "step": 1, "at": 2}, "unknown key 'at'"),
    ],
)
def test_bad_fork_sections(parent, section, message):
    with pytest.raises(RecipeError, match=message):
        parent.replace(fork=section)


def test_readme_fork_example_is_a_valid_fork(corpus, parent, reference):
    """The TOML of the docs' fork section, in the fork recipe, makes the same fork."""
    readme = open(
        os.path.join(os.path.dirname(__file__), "..", "..", "docs", "filters-and-forks.md"), encoding="utf-8"
    ).read()
    example = readme.split("## Forks: continue a run", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    r = fork_recipe(corpus, "readme.toml")
    raw = tomllib.loads(example)
    assert raw["fork"] == {"parent": "parent.toml", "step": STEP}
    assert r.replace(fork=raw["fork"]).fingerprint == r.fingerprint


@pytest.mark.parametrize("at,w1,w2", [(2, 2, 4), (STEP, 8, 1)])
def test_parent_checkpoint_continues_under_the_fork(parent, fork, reference, at, w1, w2):
    """A checkpoint of the parent's own run, taken at or before the fork step, resumes under the fork."""
    head, state = run(parent, w1, at)
    assert head == reference[:at]
    tail, _ = run(fork, w2, STEPS - at, state=fork.continue_state(state))
    assert head + tail == reference


def test_parent_checkpoint_after_the_fork_step_or_other_run_refused(parent, fork, corpus):
    _, late = run(parent, 2, STEP + 1)
    with pytest.raises(StateError, match=f"written at step {STEP + 1}, after the fork step {STEP}"):
        fork.continue_state(late)
    _, own = run(fork, 2, 1)
    with pytest.raises(StateError, match="not the fork's parent recipe's"):
        fork.continue_state(own)
