"""The tree shows the architecture: every import of every file points down the layers.

The layers are the sub-packages named in ``zephon.LAYERS`` (``zephon.nodes`` is the ``nodes/``
folder); the modules at the top of ``zephon/`` (the facade) sit above
them all. Every import is checked, wherever it is written: at module level, inside functions and
in docstring examples. Imports across layers use public names only (no ``_private`` module or
name, and names listed in the target's ``__all__``), and there is no import cycle anywhere,
``benchmarks/`` included.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
from package_tree import ROOT, module_files

import zephon

FACADE = len(zephon.LAYERS)  # the rank of zephon/__init__ and zephon/__main__


def layer_of(module: str) -> int:
    """The layer rank of a module of the package (FACADE for the top-level modules)."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in zephon.LAYERS):
        return FACADE
    return zephon.LAYERS.index(parts[1])


def _sources(path: pathlib.Path) -> Iterator[tuple[str, int, str]]:
    """(where, line, code) of the file itself and of each docstring example in it."""
    text = path.read_text()
    yield "code", 0, text
    parser = doctest.DocTestParser()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and ">>>" in doc:
                for ex in parser.get_examples(doc):
                    line = (node.body[0].lineno if node.body else 0) + ex.lineno
                    yield "docstring example", line, ex.source


def imports(module: str, path: pathlib.Path) -> Iterator[tuple[str, int, str, list[str]]]:
    """(where, line, imported module, names) for every import in a file, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for where, base, code in _sources(path):
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue  # a docstring example continued over several examples
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    yield where, base + node.lineno, a.name, []
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    target = ".".join(parts + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                yield where, base + node.lineno, target, [a.name for a in node.names]


FILES = module_files()


def _resolve(target: str, names: list[str], files: dict[str, pathlib.Path] = FILES) -> list[str]:
    """The modules of ``files`` an import statement reaches (``from pkg import submodule`` included)."""
    if target not in files:
        return [target] if target.startswith("zephon") else []
    return [target] + [f"{target}.{n}" for n in names if f"{target}.{n}" in files]


def test_every_subpackage_is_a_layer():
    subpackages = {m.split(".")[1] for m, p in FILES.items() if p.name == "__init__.py" and m.count(".") == 1}
    assert subpackages == set(zephon.LAYERS), (
        f"sub-packages {sorted(subpackages)} vs zephon.LAYERS {zephon.LAYERS}: place a new folder in a layer"
    )


def test_the_check_sees_the_tree():
    assert {
        "zephon.engine.node",
        "zephon.nodes.worksource",
        "zephon.recipe",
        "zephon.tools.cli",
        "zephon.integrations.torchtitan",
    } <= set(FILES)
    found = {(m, t) for m, p in FILES.items() for _, _, t, _ in imports(m, p)}
    assert ("zephon.engine.accumulator", "zephon.engine.node") in found  # a relative import
    assert any(m == "zephon.engine" and t == "zephon.engine.testing" for m, t in found)  # a docstring example


def test_imports_point_down():
    bad = []
    for module, path in FILES.items():
        mine = layer_of(module)
        for where, line, target, names in imports(module, path):
            for t in _resolve(target, names):
                if not t.startswith("zephon"):
                    continue
                theirs = layer_of(t)
                if theirs > mine or (theirs == FACADE and mine != FACADE):
                    bad.append(
                        f"{path.relative_to(ROOT)}:{line} ({where}) imports {t}: "
                        f"layer {_name(mine)} must not import layer {_name(theirs)}"
                    )
    assert not bad, "imports pointing up:\n" + "\n".join(bad)


def _name(rank: int) -> str:
    return zephon.LAYERS[rank] if rank < FACADE else "facade"


def test_imports_across_layers_use_public_names():
    bad = []
    for module, path in FILES.items():
        mine = layer_of(module)
        for where, line, target, names in imports(module, path):
            if not target.startswith("zephon") or layer_of(target) == mine:
                continue
            if any(p.startswith("_") for p in target.split(".")):
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports the private module {target}")
                continue
            public = getattr(importlib.import_module(target), "__all__", None)
            for n in names:
                if n.startswith("_") or (public is not None and n not in public and f"{target}.{n}" not in FILES):
                    bad.append(
                        f"{path.relative_to(ROOT)}:{line} ({where}): {target}.{n} is not public (not in its __all__)"
                    )
    assert not bad, "imports of non-public names across layers:\n" + "\n".join(bad)


def _graph(files: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules its code imports (docstring examples run later, not at import)."""
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for where, _, target, names in imports(module, path):
            if where != "code":
                continue
            for t in _resolve(target, names, files):
                if t in files and t != module:
                    graph[module].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _benchmark_files() -> dict[str, pathlib.Path]:
    return {
        f"benchmarks.{p.stem}" if p.stem != "__init__" else "benchmarks": p
        for p in sorted((ROOT / "benchmarks").glob("*.py"))
    }


@pytest.mark.parametrize("tree", ["package", "benchmarks"])
def test_no_import_cycles(tree):
    files = (
        {m: p for m, p in FILES.items() if not m.endswith("__init__") and p.name != "__init__.py"}
        if tree == "package"
        else {m: p for m, p in _benchmark_files().items() if m != "benchmarks"}
    )
    cycles = _cycles(_graph(files))
    assert not cycles, f"import cycles: {cycles}"


def test_nodes_is_only_zephon_nodes():
    code = "import importlib.util, zephon.nodes; print(importlib.util.find_spec('nodes'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "None"


def test_engine_alone_imports_no_operator_data_or_tool_module():
    # the engine's own modules import nothing above them even at run time (the facade does)
    code = (
        "import importlib.util, sys, types; spec = importlib.util.find_spec('zephon'); "
        "stub = types.ModuleType('zephon'); stub.__path__ = list(spec.submodule_search_locations); "
        "stub.__spec__ = spec; sys.modules['zephon'] = stub; import zephon.engine, zephon.engine.testing; "
        "print(sorted(m for m in sys.modules if m.startswith('zephon.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    loaded = eval(out.stdout)
    assert loaded and all(m.startswith("zephon.engine") for m in loaded), loaded


def test_regular_wheel_ships_nodes_only_as_zephon_nodes(tmp_path):
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (whl,) = tmp_path.glob("zephon_loader-*.whl")  # the distribution zephon-loader
    names = zipfile.ZipFile(whl).namelist()
    assert not [n for n in names if n.startswith("nodes/")]
    for needed in (
        "zephon/nodes/pack.py",
        "zephon/nodes/__init__.py",
        "zephon/nodes/worksource.py",
        "zephon/data/assets/tokenizer/tokenizer.json",
        "zephon/data/datasets/index.py",
        "zephon/engine/node.py",
        "zephon/recipe/__init__.py",
        "zephon/tools/cli.py",
        "zephon/integrations/torchtitan.py",
        "zephon/py.typed",
    ):
        assert needed in names, needed
