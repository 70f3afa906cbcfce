"""The examples in docstrings run."""

import doctest
import importlib

import pytest

MODULES = ["zephon.permute", "zephon.lanes", "zephon.checkpoint", "zephon.seeding", "zephon.testing",
           "zephon.worksource", "zephon.display"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_there_are_examples():
    total = sum(doctest.testmod(importlib.import_module(n)).attempted for n in MODULES)
    assert total >= 10
