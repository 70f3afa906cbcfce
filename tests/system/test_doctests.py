"""The examples in docstrings run (offline, fast: each module's examples take a few seconds), in
every module of the tree."""

import doctest
import importlib

import pytest
from package_tree import modules

OPTIONAL = {
    "zephon.integrations.torchtitan": "torchtitan",
    "zephon.integrations.titan_metrics": "torchtitan",
}  # module -> what it needs
MODULES = [m for m in modules() if m not in OPTIONAL]


def _run(name):
    return doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)


@pytest.mark.parametrize("name", MODULES + sorted(OPTIONAL))
def test_docstring_examples(name):
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    result = _run(name)
    assert result.failed == 0


def test_there_are_examples():
    # a floor on examples, so removing them is noticed, without running them a second time
    finder = doctest.DocTestFinder()
    counts = {name: sum(len(t.examples) for t in finder.find(importlib.import_module(name))) for name in MODULES}
    assert sum(counts.values()) >= 200, counts
    assert sum(1 for c in counts.values() if c) >= 20, counts
