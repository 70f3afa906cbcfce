"""Sphinx configuration of zephon's documentation: MyST Markdown pages and autodoc, built offline.

Build: ``.venv/bin/python -m sphinx -W --keep-going -n -b html docs docs/_build/html`` (the
"docs" part of ``bash scripts/test.sh``). Nothing is fetched at build time (no intersphinx).
"""

import importlib
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "zephon"
author = "the zephon authors"
copyright = "the zephon authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# MyST: heading anchors ("page.md#a-heading") are checked by the build like any link
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

# autodoc: each layer's face, in source order; type hints stay in the signatures
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_typehints = "signature"
# -n checks cross-references: one to a page, a heading or a documented object must resolve; one
# to a zephon object outside the documented faces must name an object that exists (it renders
# as code, see _existing_zephon_object); those to other projects' objects (torch, numpy, the
# standard library) cannot resolve offline and are not checked
nitpick_ignore_regex = [(r"py:.*", r"(?!zephon\b).*")]
# a short name two documented classes share (``Config``) is resolved to the first, not warned about
suppress_warnings = ["ref.python"]


def _importable(path: str) -> bool:
    """Whether ``path`` (``zephon.a.b.C.meth``) names an object: a module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def _existing_zephon_object(app, env, node, contnode):
    """A reference to a zephon object that exists but is not in a documented face: code text,
    no warning. A reference to one that does not exist (a typo, a removed name) still warns."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "").lstrip("~.")
    module, klass = node.get("py:module") or "", node.get("py:class") or ""
    for candidate in (target, f"{module}.{klass}.{target}", f"{module}.{target}"):
        if candidate.startswith("zephon") and _importable(candidate):
            return contnode
    return None


def setup(app):
    app.connect("missing-reference", _existing_zephon_object)


html_theme = "alabaster"
html_title = "zephon"
html_static_path: list[str] = []
html_theme_options = {"description": "Elastically deterministic data loading for PyTorch", "fixed_sidebar": True}
