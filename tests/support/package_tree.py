"""The package's modules, read from the tree itself (``zephon/`` and ``nodes/`` as ``zephon.nodes``),
so that tests over "every module" never depend on a hand-written list."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: source folder -> the package it is installed as (pyproject's package-dir)
SOURCES = {"zephon": ROOT / "zephon", "zephon.nodes": ROOT / "nodes"}


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every ``.py`` file of the package (``__main__`` excluded)."""
    out: dict[str, pathlib.Path] = {}
    for pkg, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if parts and parts[-1] == "__main__":
                continue
            if pkg == "zephon" and parts and parts[0] == "nodes":
                continue
            out[".".join([pkg, *parts])] = path
    return out


def modules() -> list[str]:
    """Every module name of the package, sorted."""
    return sorted(module_files())
