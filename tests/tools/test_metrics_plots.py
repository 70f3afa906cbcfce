"""Pipeline metrics, explain() and plots."""

from __future__ import annotations

import os

import pytest

from zephon import Recipe, WorkerConfig


@pytest.fixture(scope="module")
def recipe(text_corpus):
    return Recipe.from_toml(os.path.join(text_corpus, "recipe.toml"))  # the run's shared corpus


def test_metrics_per_node(recipe):
    rt = recipe.router(2, 1, workers=WorkerConfig(2, "thread"), prefetch=0)  # counts = what was delivered
    for _ in range(10):
        next(rt)
    m = rt.summary_metrics()
    rt.close()
    assert m["Batch"]["items"] == 10 * 4  # 4 lanes on this rank
    assert m["WindowShuffle"]["items"] == 10 * 4 * 2 <= m["Pack"]["items"]  # the shuffle reads whole windows ahead
    assert m["LaneWorkSource"]["items"] >= m["OrderedMapper"]["items"] >= m["SkipCounter"]["items"]
    assert 0.99 <= m["Pack"]["efficiency"] <= 1.0
    assert set(m["SkipCounter"]["skipped"]) == {"web", "code", "books"}
    assert m["OrderedMapper"]["wait_workers_s"] >= 0 and m["OrderedMapper"]["max_in_flight"] >= 1
    for v in m.values():
        assert v["self_s"] <= v["busy_s"] + 1e-9


def test_explain_shows_plan_graph_and_ranks(recipe):
    from zephon.tools.display import explain

    text = repr(explain(recipe, 4))
    for needle in ("target", "expected", "rank 3/4: lanes 6..7", "flush every 32", "└─ Pack", "LaneWorkSource"):
        assert needle in text
    assert "<pre" in explain(recipe)._repr_html_()


def test_plots(recipe):
    from zephon.tools import plots

    shares = plots.token_shares(recipe, 30)
    assert shares.shape == (30, 3) and abs(shares[-1].sum() - 1) < 1e-9
    fig = plots.plot_token_shares(recipe, shares=shares)
    assert len(fig.axes[0].lines) == 6
    assert plots.plot_packing_efficiency(recipe, 3).axes[0].get_xlabel() == "row packing efficiency"
    assert len(plots.plot_document_lengths(recipe, 50).axes[0].patches) > 0
    rt = recipe.router()
    next(rt)
    assert len(plots.plot_node_throughput(rt.summary_metrics()).axes) == 2
    rt.close()
