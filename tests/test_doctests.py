"""The examples in docstrings run (offline, fast: each module's examples take a few seconds)."""

import doctest
import importlib

import pytest

MODULES = [
    # the core
    "zephon", "zephon.accumulator", "zephon.checkpoint", "zephon.permute", "zephon.seeding", "zephon.workers",
    "zephon.testing", "zephon.lanes", "zephon.worksource",
    # recipes, tools, display
    "zephon.recipe", "zephon.demo", "zephon.synth", "zephon.cli", "zephon.plots", "zephon.display",
    "zephon.datasets.multimodal", "zephon.datasets.errors",
    # operators
    "zephon.nodes", "zephon.nodes.batch", "zephon.nodes.shuffle", "zephon.nodes.skips", "zephon.nodes.vision",
    "zephon.nodes.mmpack",
]
OPTIONAL = {"zephon.titan": "torchtitan"}  # module -> the package it needs


def _run(name):
    return doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)


@pytest.mark.parametrize("name", MODULES + sorted(OPTIONAL))
def test_docstring_examples(name):
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    result = _run(name)
    assert result.failed == 0


def test_there_are_examples():
    # every module listed has examples (a module whose examples were all removed is noticed),
    # without running them a second time
    finder = doctest.DocTestFinder()
    counts = {name: sum(len(t.examples) for t in finder.find(importlib.import_module(name))) for name in MODULES}
    assert all(counts.values()), [n for n, c in counts.items() if not c]
    assert sum(counts.values()) >= 100
