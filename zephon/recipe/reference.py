"""The recipe reference, written from the schema: every key's section, type, default, bounds,
choices and doc come from its :func:`~zephon.recipe.keys.key` declaration in
:mod:`zephon.recipe.spec`, so the documentation cannot drift from what the parser accepts.

``[[filters]]`` (one dataclass per kind) and ``[fork]`` are declared the same way, in
:mod:`zephon.recipe.filterspec`; the filters' table says which kinds allow each key.

The docs page is this module's output (``python -m zephon.recipe.reference --write
docs/reference/recipe.md``); a test fails when a key has no doc or the page is stale.

    >>> page = reference()
    >>> "| `flush_every` |" in page and "| `bos_token` |" in page
    True
    >>> missing_docs()
    []
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
from collections.abc import Sequence
from typing import Any

from .filterspec import FILTER_TABLES, KINDS, ForkSpec, RuleTable
from .keys import LIMITS, Key, field_default, keys, meta, spelled
from .phases import BatchPhaseTable
from .spec import (
    VERSIONED,
    DatasetSpec,
    MixingSpec,
    PackSpec,
    PhaseTable,
    RecipeSpec,
    ShuffleSpec,
    TokenizerSpec,
    TokenizeTable,
    VisionTable,
    WorkersTable,
)

__all__ = ["REGENERATE", "SECTIONS", "main", "missing_docs", "reference"]

#: the one command that rewrites the committed page (named in the stale-page test's failure)
REGENERATE = ".venv/bin/python -m zephon.recipe.reference --write docs/reference/recipe.md"

#: (TOML section, the dataclass whose fields are its keys, what the section is), in page order
SECTIONS: Sequence[tuple[str, type, str]] = (
    ("Top level", RecipeSpec, "the keys at the top of the file, before any table"),
    ("[tokenizer]", TokenizerSpec, "where the tokenizer is, and the BOS/EOS policy"),
    ("[[datasets]]", DatasetSpec, "one entry per dataset"),
    ("[pack]", PackSpec, "how documents become rows"),
    ("[shuffle]", ShuffleSpec, "each lane's shuffle window and the block order"),
    ("[mixing]", MixingSpec, "how datasets are mixed, and how long documents are planned"),
    ("[[schedule]]", PhaseTable, "an optional curriculum: weights from a given step on"),
    ("[[batch_schedule]]", BatchPhaseTable, "optional: another global batch or seq_len from a given step on"),
    ("[workers]", WorkersTable, "parallelism only: never changes a byte of the data"),
    ("[tokenize]", TokenizeTable, "the tokenize stage's own workers"),
    ("[vision]", VisionTable, "image-text recipes: image preprocessing, budgets and placeholder tokens"),
)

#: the sections read after the others (their rules need the rest of the recipe), after the table
FORK = ("[fork]", ForkSpec, "continue a run under a changed recipe from a declared step")


def _filter_keys() -> list[tuple[str, type, dataclasses.Field, list[str]]]:
    """The ``[[filters]]`` keys: (key, the class declaring it, its field, the kinds allowing it),
    in the order the kinds' classes list them; a key two kinds declare apart is two rows."""
    rows: dict[tuple[str, type], tuple[dataclasses.Field, list[str]]] = {}
    for kind, cls in FILTER_TABLES.items():
        for f in dataclasses.fields(cls):
            owner = next(c for c in reversed(cls.__mro__) if f.name in inspect.get_annotations(c))
            rows.setdefault((spelled(f), owner), (f, []))[1].append(kind)
    return [(k, owner, f, kinds) for (k, owner), (f, kinds) in rows.items()]


def missing_docs() -> list[str]:
    """Keys without a doc, as ``"section key"``: empty when the reference is complete."""
    out = [
        f"{title} {name}" for title, cls, _ in (*SECTIONS, FORK) for name in keys(cls) if not _doc(cls, name).strip()
    ]
    out += [f"[[filters]] {k}" for k, owner, f, _ in _filter_keys() if not meta(owner, f.name).doc.strip()]
    return out


def _doc(cls: type, name: str) -> str:
    f = {f.name: f for f in dataclasses.fields(cls)}.get(name)
    return meta(cls, name).doc if f is not None else f"the [{name}] table"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


def _default(cls: type, name: str, k: Key) -> str:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return k.derived if k.derived else "required"
    value = field_default(cls, name)
    if k.derived:  # the field's value only stands for "not given": the rule's result is the default
        out = k.derived if value in (None, 0) else f"{_value(value)}; {k.derived}"
    else:
        out = "not set" if value is None else _value(value)
    for first, value in sorted(VERSIONED.get((cls.__name__, name), {}).items()):
        out += f"; data version {first}+: {_value(value)}"
    return out


def _bounds(k: Key, annotation: str) -> str:
    if k.choices:
        return " \\| ".join(_value(c) for c in k.choices)
    parts = ['or "auto"'] if k.auto else []
    if k.lo and "int" in annotation:
        parts.append(f">= {k.lo}")
    if k.positive:
        parts.append("> 0")
    if isinstance(k.hi, str):
        parts.append(f"<= {LIMITS[k.hi]:,}")
    elif k.hi is not None:  # a bound of the machine (max_workers) or of this version (data_version)
        name = getattr(k.hi, "__name__", "")
        parts.append(f"<= {name}()" if name and name != "<lambda>" else f"<= {k.hi():,}")
    return ", ".join(parts)


def _section(title: str, cls: type, what: str) -> list[str]:
    heading = f"`{title}`" if title.startswith("[") else title
    out = [f"## {heading}", "", f"{what[0].upper()}{what[1:]} (`{cls.__module__}.{cls.__name__}`).", ""]
    out += ["| key | type | default | allowed | what it is for |", "|---|---|---|---|---|"]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in keys(cls):
        if name not in fields:  # a table that fills this field (`also`), documented in its own section
            continue
        if meta(cls, name).read == "table" and cls is RecipeSpec:  # a section of its own, below
            continue
        out.append("| " + " | ".join(_cells(cls, fields[name])) + " |")
    return [*out, ""]


def _type(k: Key, annotation: str) -> str:
    if k.read in ("globs", "rgb", "table"):
        return {"globs": "str \\| list of str", "rgb": "[r, g, b]", "table": "table"}[k.read]
    shown = (
        annotation.replace(" | None", "").replace("tuple[str, ...]", "list of str").replace("tuple[Any, ...]", "list")
    )
    return _cell(shown.replace("Mapping[str, Any]", "table").replace("Mapping[str, str]", "table of str"))


def _cells(cls: type, f: dataclasses.Field) -> list[str]:
    """A key's row: key, type, default, allowed values, doc."""
    k, annotation = meta(cls, f.name), str(f.type)
    return [
        f"`{spelled(f)}`",
        _type(k, annotation),
        _cell(_default(cls, f.name, k)),
        _bounds(k, annotation),
        _cell(k.doc),
    ]


def reference() -> str:
    """The recipe reference page (MyST Markdown): one table per section, one row per key."""
    out = [
        "# Recipe reference",
        "",
        f"<!-- generated by `python -m zephon.recipe.reference`: do not edit; regenerate with {REGENERATE} -->",
        "",
        "Every key a recipe accepts, generated from the schema the parser reads",
        "(`zephon.recipe.spec`). An unknown key is refused naming it; a value outside its bounds is",
        "refused naming the key and the bound. A default that depends on the data version says from",
        "which version on it holds (see [data versions](../guarantees.md#data-versions)). How to",
        "write a recipe, with an annotated example: [Recipes](../recipes.md).",
        "",
    ]
    for title, cls, what in SECTIONS:
        out += _section(title, cls, what)
    out += [
        "## `[[filters]]`",
        "",
        "One entry per rule, applied in recipe order (`zephon.recipe.filterspec`, one class per kind; see",
        "[Filters and forks](../filters-and-forks.md)). Kinds: " + ", ".join(f"`{k}`" for k in KINDS) + ".",
        "",
        "| key | kinds | type | default | allowed | what it is for |",
        "|---|---|---|---|---|---|",
    ]
    for _, owner, f, kinds in _filter_keys():
        cells = _cells(owner, f)
        out.append(
            "| " + " | ".join([cells[0], "every kind" if owner is RuleTable else ", ".join(kinds), *cells[1:]]) + " |"
        )
    title, cls, what = FORK
    out += ["", *_section(title, cls, what)[:-1]]
    out += ["", "See [Forks](../filters-and-forks.md#forks-continue-a-run-under-a-changed-recipe)."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the reference, or ``--write PATH`` it; exits 1 when a key has no doc."""
    ap = argparse.ArgumentParser(prog="python -m zephon.recipe.reference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", metavar="PATH", help="write the page to PATH instead of printing it")
    args = ap.parse_args(argv)
    missing = missing_docs()
    if missing:
        print(f"keys without a doc: {', '.join(missing)}", file=sys.stderr)
        return 1
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(reference())
    else:
        sys.stdout.write(reference())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
