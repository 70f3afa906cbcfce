"""The house keeps its shape: rooms small enough to read in one sitting, one public path per
module, a slim sorted public surface per layer.

A library file over :data:`MAX_FILE_LINES` lines or a function over :data:`MAX_FUNCTION_LINES`
fails here unless :data:`ALLOWED` lists it with the reason it is still one idea. The numbers
follow torchdata.nodes (one concept a file; its largest, ``map.py``, is 590 lines).
"""

from __future__ import annotations

import ast
import importlib

import pytest
from package_tree import ROOT, module_files

import zephon

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

#: "path" or "path:function" -> why it may be larger (one idea that does not split well)
ALLOWED: dict[str, str] = {
    "zephon/integrations/torchtitan.py": "TorchTitan's BaseDataLoader contract: the Config with one docstring per "
    "field (a third of the file), the loader and its state protocol; the demo configs are apart",
}


def _library_files() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in module_files().values()}


def _oversized() -> dict[str, int]:
    out = {}
    for path, text in _library_files().items():
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            out[path] = lines
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out[f"{path}:{node.name}"] = n
    return out


def test_no_room_grows_past_its_size_unless_listed_with_a_reason():
    big = _oversized()
    unlisted = {k: v for k, v in big.items() if k not in ALLOWED}
    assert not unlisted, (
        f"files over {MAX_FILE_LINES} lines or functions over {MAX_FUNCTION_LINES} lines: {unlisted}. "
        "Split them (one idea a module, the way torchdata.nodes keeps one concept a file), or list them in "
        "ALLOWED with the reason they are still one idea."
    )


def test_the_allow_list_has_no_stale_entries():
    big = _oversized()
    stale = sorted(k for k in ALLOWED if k not in big)
    assert not stale, f"ALLOWED lists rooms that are small now; remove them: {stale}"


def test_every_module_has_one_public_path():
    """No module installs itself under a second name (``sys.modules[__name__] = ...`` aliases)."""
    aliased = [p for p, text in _library_files().items() if "sys.modules[__name__]" in text]
    assert not aliased, f"alias modules give a module two public paths: {aliased}"


LAYER_PACKAGES = ["zephon", *(f"zephon.{layer}" for layer in zephon.LAYERS)]


def _isort_key(name: str) -> tuple[int, str]:
    """ruff's (isort's) order for ``__all__``: CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


@pytest.mark.parametrize("package", LAYER_PACKAGES)
def test_each_layer_has_a_sorted_public_surface(package):
    mod = importlib.import_module(package)
    names = list(getattr(mod, "__all__", []))
    assert names == sorted(names, key=_isort_key), f"{package}.__all__ is not sorted"
    assert len(set(names)) == len(names), f"{package}.__all__ lists a name twice"
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{package}.__all__ names what it does not have: {missing}"


def test_the_data_layer_lists_its_packages_names():
    """The layer's face re-exports what a user composes with from its modules (constants and
    helpers stay public in :mod:`zephon.data.datasets`, ``.chat`` and ``.tokenizer``)."""
    import zephon.data
    import zephon.data.chat
    import zephon.data.datasets
    import zephon.data.tokenizer

    own = set(zephon.data.datasets.__all__) | set(zephon.data.chat.__all__) | set(zephon.data.tokenizer.__all__)
    assert set(zephon.data.__all__) <= own
