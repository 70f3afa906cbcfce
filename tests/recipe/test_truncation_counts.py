"""Samples a packer truncates are counted and reported like skips (issue 31): an image-text sample
longer than a row keeps its images and loses the end of its text; MMPack counts those samples per
dataset and the tokens cut, the loader metrics and ``zephon hashes`` say them."""

from __future__ import annotations

import io

import numpy as np
import pytest
from vl_fixtures import vl_config, write_vl_root

from zephon import Recipe, WorkerConfig
from zephon.engine.testing import ListSource
from zephon.nodes import MMDoc, MMPack
from zephon.nodes.worksource import WorkItem
from zephon.recipe.loader_metrics import LoaderMetrics, skips_line, summary_of
from zephon.tools.cli import run_hashes


def test_mmpack_counts_the_samples_the_mapper_cut():
    docs = [
        MMDoc(np.arange(1, 6, dtype=np.int32), 0, WorkItem(0, 0, 1, 0, 0)),
        MMDoc(np.arange(1, 9, dtype=np.int32), 1, WorkItem(1, 0, 2, 0, 0), truncated=7),
        MMDoc(np.arange(1, 9, dtype=np.int32), 1, WorkItem(1, 0, 3, 0, 0), truncated=2),
    ]
    node = MMPack(ListSource(docs), seq_len=7, rows=1, patch_dim=12, max_images_per_batch=2, mrope=False)
    list(node)
    m = node.extra_metrics()
    assert m["truncated"] == {1: 2} and m["truncated_tokens"] == 9


@pytest.fixture(scope="module")
def short_rows(tmp_path_factory) -> Recipe:
    """The VL test corpus with rows of 24 tokens: an image fits, most captions do not."""
    root = tmp_path_factory.mktemp("cut")
    write_vl_root(root, seed=11)
    cfg = vl_config(str(root), seq_len=24)
    cfg["datasets"] = [d for d in cfg["datasets"] if d["name"] in ("wds", "web")]
    return Recipe.from_dict(cfg, str(root))


def test_cut_samples_are_in_the_loader_metrics_and_the_hashes_summary(short_rows):
    names = [d.name for d in short_rows.datasets]
    with short_rows.global_loader(2, workers=WorkerConfig(0)) as g:
        m = LoaderMetrics(short_rows)
        for _ in range(4):
            m.record(next(g))
        summary = summary_of(g)
        got = m.collect(summary)
    assert got["zephon/truncated/wds"] > 0 and got["zephon/truncated/web"] == 0, got
    assert got["zephon/truncated_tokens"] >= got["zephon/truncated/wds"]
    line = skips_line(summary, names)
    assert line is not None and "samples cut to fit a row: wds " in line and "tokens cut" in line
    err = io.StringIO()
    run_hashes(short_rows, world_size=2, steps=4, workers=WorkerConfig(0), out=io.StringIO(), err=err)
    assert "zephon hashes: samples cut to fit a row: wds " in err.getvalue(), err.getvalue()


def test_nothing_cut_says_nothing(short_rows):
    recipe = short_rows.replace(seq_len=512)
    err = io.StringIO()
    run_hashes(recipe, world_size=1, steps=2, workers=WorkerConfig(0), out=io.StringIO(), err=err)
    assert "cut" not in err.getvalue() and "skipped" not in err.getvalue()
