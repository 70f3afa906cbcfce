"""The base install imports no optional extra: a guard over the import graph of every module.

A base install (``pip install .``, no extras) has torch, torchdata, numpy, tokenizers, pyarrow,
fsspec, zstandard, regex, tqdm and pillow, nothing else. A module of the base that imports an extra's
package at import time (``import transformers`` at the top of a file, not inside the function that
needs it) breaks ``import zephon`` for every user without that extra (issue #34: the base install
died on ``import PIL`` when pillow was an extra). The scripts/base_check.sh step of the test command
checks a real base install; this test names the offending file and line, statically, in a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: top-level packages that only an extra (or the dev tools) installs: never imported at import
#: time by a base module
EXTRA_PACKAGES = {
    "transformers": "hf",
    "accelerate": "hf",
    "datasets": "hf",
    "torchtitan": "titan",
    "tyro": "titan",
    "triton": "titan",
    "pytorch_lightning": "lightning",
    "lightning": "lightning",
    "matplotlib": "notebook",
    "ipykernel": "notebook",
    "ipywidgets": "notebook",
    "IPython": "notebook",
    "jupytext": "notebook",
    "nbclient": "notebook",
    "nbformat": "notebook",
    "nbconvert": "notebook",
    "ray": "(none: installed by hand)",
    "s3fs": "dev",
    "boto3": "dev",
    "moto": "dev",
    "hypothesis": "dev",
    "pytest": "dev",
}

#: modules that exist to adapt an extra and import it at the top; the base never imports them
EXTRA_MODULES = {
    "zephon.integrations.hf": "hf",
    "zephon.integrations.lightning": "lightning",
    "zephon.integrations.titan_metrics": "titan",
    "zephon.integrations.titan_schedule": "titan",
    "zephon.integrations.torchtitan": "titan",
    "zephon.integrations.torchtitan_demo": "titan",
}


def _modules() -> dict[str, Path]:
    """Every module of the distribution by import name (``nodes/`` ships as ``zephon.nodes``)."""
    found: dict[str, Path] = {}
    for folder, prefix in ((ROOT / "zephon", "zephon"), (ROOT / "nodes", "zephon.nodes")):
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_nodes(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported: not inside a function, not
    under ``if TYPE_CHECKING:`` (class bodies, ``try`` and other ``if`` blocks do run)."""
    out: list[ast.Import | ast.ImportFrom] = []
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            out.append(stmt)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                out += _import_time_nodes(stmt.body)
            out += _import_time_nodes(stmt.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list):
                    stmts = [s for s in inner if isinstance(s, ast.stmt)]
                    stmts += [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body]
                    out += _import_time_nodes(stmts)
    return out


def _imported_names(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute module names an import statement may load (``from a import b``: a and a.b)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if node.level:
        base_parts = package.split(".")
        base_parts = base_parts[: len(base_parts) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _import_time_imports(module: str, path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        (node.lineno, name) for node in _import_time_nodes(tree.body) for name in _imported_names(module, path, node)
    ]


def test_no_base_module_imports_an_extra_at_import_time():
    modules = _modules()
    bad = []
    for module, path in modules.items():
        if module in EXTRA_MODULES:
            continue
        for line, name in _import_time_imports(module, path):
            top = name.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{line}"
            if top in EXTRA_PACKAGES:
                bad.append(f"{where} imports {name} (extra [{EXTRA_PACKAGES[top]}]) at import time")
            elif name in EXTRA_MODULES:
                bad.append(f"{where} imports {name}, which needs the [{EXTRA_MODULES[name]}] extra, at import time")
    assert not bad, (
        "base modules import optional extras when imported; a base install (`pip install .`) would fail. "
        "Import the extra inside the function that needs it, with a message naming the extra:\n" + "\n".join(bad)
    )


@pytest.mark.parametrize("module", sorted(EXTRA_MODULES))
def test_each_extra_module_is_one(module):
    """The exemption list stays honest: a module listed as needing an extra does import it."""
    path = _modules()[module]
    tops = {name.split(".")[0] for _, name in _import_time_imports(module, path)}
    via = {name for _, name in _import_time_imports(module, path) if name in EXTRA_MODULES}
    assert tops & set(EXTRA_PACKAGES) or via, (
        f"{module} is listed in EXTRA_MODULES but imports no extra at import time: remove it from the list"
    )


def test_the_guard_sees_a_top_level_import(tmp_path):
    """The walker finds imports in class bodies, try blocks and plain ifs; not in functions or
    under TYPE_CHECKING."""
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "import matplotlib\n"
        "if TYPE_CHECKING:\n    import torchtitan\n"
        "def f():\n    import transformers\n"
        "try:\n    import ray\nexcept ImportError:\n    import s3fs\n"
        "class C:\n    from . import sibling\n",
        encoding="utf-8",
    )
    names = {name for _, name in _import_time_imports("zephon.pkg.m", path)}
    assert {"matplotlib", "ray", "s3fs", "zephon.pkg", "zephon.pkg.sibling"} <= names
    assert not names & {"torchtitan", "transformers"}
