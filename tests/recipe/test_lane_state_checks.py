"""A recipe's lanes check every value of a restored state, even one whose digests were recomputed
(a deliberate forgery passes the digests; impossible values are still refused, naming the lane and
the field), and an old-format checkpoint goes through the same checks after migration."""

from __future__ import annotations

import pytest
from state_edits import node_of, resealed
from text_fixtures import write_corpus, write_recipe

from zephon import Recipe, StateError, WorkerConfig, batch_sha256


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("restore")
    write_corpus(str(root))
    return Recipe.from_toml(write_recipe(str(root), web_extra='on_error = "skip"'))


def run(recipe, steps, state=None):
    with recipe.global_loader(2, workers=WorkerConfig(0)) as g:
        if state is not None:
            g.load_state_dict(state)
        return [batch_sha256(next(g)) for _ in range(steps)], g.state_dict()


@pytest.fixture(scope="module")
def saved(recipe):
    ref, _ = run(recipe, 9)
    _, state = run(recipe, 6)
    return ref, state


def lane(edit, node_type, lane_id=5):
    return lambda raw: edit(node_of(raw[f"lane_{lane_id:05d}"], node_type))


def shared(edit):
    return lambda raw: edit(raw["shared"])


CASES = {
    "ws_count_bool": (
        lane(lambda n: n["count"].__setitem__(1, True), "work_source"),
        r"'count\[1\]' must be an integer",
    ),
    "ws_count_huge": (lane(lambda n: n["count"].__setitem__(0, 10**30), "work_source"), r"'count\[0\]' must be"),
    "ws_draws_negative": (lane(lambda n: n.update(draws=-5), "work_source"), "'draws' must be an integer"),
    "ws_count_wrong_length": (lane(lambda n: n["count"].append(0), "work_source"), "'count' must list 3 integers"),
    "ws_phase": (lane(lambda n: n.update(phase=3), "work_source"), r"'phase' must be an integer in \[0, 0\]"),
    "ws_phase_count": (
        lane(lambda n: n["phase_count"].__setitem__(0, n["count"][0] + 1), "work_source"),
        "exceeds 'count'",
    ),
    "ws_part": (lane(lambda n: n["part"].__setitem__(0, 10**6), "work_source"), "'part' of dataset 'web'"),
    "ws_unknown_key": (lane(lambda n: n.update(extra=1), "work_source"), "unknown entry 'extra'"),
    "skip_detail_int": (lane(lambda n: n.update(detail=5), "skip_counter"), "'detail' must list at most"),
    "skip_detail_row": (lane(lambda n: n.update(detail=[["a", "b"]]), "skip_counter"), r"'detail\[0\]' must be"),
    "skip_detail_sum": (
        lane(lambda n: n.update(detail=[[0, 0, "invalid JSON", 3]]), "skip_counter"),
        "counts 3 skips of dataset 'web' but 'skipped' says",
    ),
    "skip_more_than_seen": (
        lane(lambda n: n.update(skipped=[n["seen"][0] + 1, 0, 0]), "skip_counter"),
        "streak <= skipped <= seen",
    ),
    "skip_no_streak": (lane(lambda n: n.pop("streak"), "skip_counter"), "no 'streak' entry"),
    "shuffle_window_list": (lane(lambda n: n["extra"].update(window=[1]), "shuffle"), "'extra.window' must be"),
    "shuffle_since_huge": (
        lane(lambda n: n.update(since=10**12), "shuffle"),
        r"'since' must be an integer in \[0, 7\]",
    ),
    "shuffle_anchor_null": (lane(lambda n: n.update(anchor=None), "shuffle"), "'anchor' must be the upstream"),
    "batch_since": (lane(lambda n: n.update(since=1), "batch"), r"'since' must be an integer in \[0, 0\]"),
    "pack_since_huge": (lane(lambda n: n.update(since=10**12), "pack"), "'since' must be an integer in"),
    "mapper_since_huge": (lane(lambda n: n.update(since=10**12), "ordered_map"), "'since' must be an integer in"),
    "estimate_not_a_list": (
        shared(lambda s: s["token_estimates"].update(web=5)),
        "token estimate of dataset 'web' must be",
    ),
    "estimate_string": (
        shared(lambda s: s["token_estimates"].update(web=["abc", 2.0, 120])),
        "token estimate of dataset 'web' must be",
    ),
    "estimate_zero": (
        shared(lambda s: s["token_estimates"].update(web=[0.0, 2.0, 120])),
        "token estimate of dataset 'web' must be",
    ),
    "shared_unknown": (shared(lambda s: s.update(junk="x")), "'shared' has an unknown entry 'junk'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_impossible_values_are_refused_even_with_valid_digests(recipe, saved, case):
    edit, match = CASES[case]
    _, state = saved
    with pytest.raises(StateError, match=match):
        run(recipe, 1, resealed(state, edit))


def test_a_consistent_resealed_state_is_accepted(recipe, saved):
    """The limit of the checks, stated honestly: a forgery that recomputes the digests and keeps
    every value possible is a valid state (the README says so)."""
    ref, state = saved
    assert run(recipe, 3, resealed(state, lambda raw: None))[0] == ref[6:]
