"""One room, one idea: the tools stay small enough to read in one sitting.

Each module of ``zephon/tools`` (and the ledger's file format, ``zephon/recipe/ledger.py``) is
under 500 lines, and no function is longer than 80; data (the synthetic word list) lives in data
files, not in code.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "zephon"
FILES = sorted((ROOT / "tools").rglob("*.py")) + [ROOT / "recipe" / "ledger.py"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_function_sizes(path):
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 500, f"{path} has {len(text.splitlines())} lines: split it by idea"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert n <= 80, f"{path}:{node.lineno}: {node.name} is {n} lines: split it into steps"
