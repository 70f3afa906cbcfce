"""The recipe reference, written from the schema: every key's section, type, default, bounds,
choices and doc come from its :func:`~zephon.recipe.keys.key` declaration in
:mod:`zephon.recipe.spec`, so the documentation cannot drift from what the parser accepts.

``[[filters]]`` and ``[fork]`` are read by :class:`~zephon.recipe.Recipe` itself
(:data:`~zephon.recipe.recipe.OWN_SECTIONS`); their keys come from the parsers' own tables
(:mod:`zephon.recipe.filters`, :mod:`zephon.recipe.fork`) and their docs from :data:`OWN_DOCS`.

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
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from . import filters as _filters
from . import fork as _fork
from .keys import LIMITS, Key, field_default, keys, meta
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

__all__ = ["OWN_DOCS", "REGENERATE", "SECTIONS", "main", "missing_docs", "reference"]

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

#: docs of the keys of the sections :class:`~zephon.recipe.Recipe` parses itself (no ``key()``
#: schema yet): ``(section, key) -> doc``
OWN_DOCS: Mapping[tuple[str, str], str] = {
    ("[[filters]]", "name"): "unique name; documents are counted under it (default: kind#N)",
    ("[[filters]]", "kind"): "the kind of rule: " + " | ".join(_filters._KIND_KEYS),
    ("[[filters]]", "datasets"): "the datasets the rule applies to (default: every dataset)",
    ("[[filters]]", "unit"): 'length: "chars" or "tokens" (content tokens, no BOS/EOS)',
    ("[[filters]]", "min"): "length, field: the smallest value kept (inclusive)",
    ("[[filters]]", "max"): "length, field: the largest value kept (inclusive; optional)",
    ("[[filters]]", "pattern"): "regex: a Python regular expression, re.search on the text, each match bounded in time",
    ("[[filters]]", "action"): 'regex: "exclude" drops matching texts, "include" keeps only them',
    ("[[filters]]", "field"): "field: the record's metadata field (a JSONL key, a Parquet/Arrow column)",
    ("[[filters]]", "in"): "field: keep only records whose value is one of these",
    ("[[filters]]", "not_in"): "field: drop records whose value is one of these",
    ("[[filters]]", "function"): 'function, transform, stateful: "package.module:name", importable by every worker',
    ("[[filters]]", "params"): "function, transform, stateful: keyword arguments of the call (or of the class)",
    ("[fork]", "parent"): "the recipe the run was started with (relative to this file)",
    ("[fork]", "step"): "the first global batch made under this recipe",
    ("[fork]", "fingerprint"): "optional: the parent's fingerprint; refused if the parent or its data changed",
}


def _own_keys() -> dict[str, list[tuple[str, str]]]:
    """The keys of ``[[filters]]`` (and the kinds that allow each) and ``[fork]``, read from the parsers."""
    kinds: dict[str, list[str]] = {}
    for kind, allowed in _filters._KIND_KEYS.items():
        for k in allowed:
            kinds.setdefault(k, []).append(kind)
    rows = [("name", "every kind"), ("kind", "required"), ("datasets", "every kind")]
    rows += [(k, ", ".join(ks)) for k, ks in kinds.items()]
    return {"[[filters]]": rows, "[fork]": [(k, "") for k in _fork.FORK_KEYS]}


def missing_docs() -> list[str]:
    """Keys without a doc, as ``"section key"``: empty when the reference is complete."""
    out = [f"{title} {name}" for title, cls, _ in SECTIONS for name in keys(cls) if not _doc(cls, name).strip()]
    for title, rows in _own_keys().items():
        out += [f"{title} {k}" for k, _ in rows if not OWN_DOCS.get((title, k), "").strip()]
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
        k, annotation = meta(cls, name), str(fields[name].type)
        if k.read == "table" and cls is RecipeSpec:  # a section of its own, below
            continue
        if k.read in ("globs", "rgb", "table"):
            kind = {"globs": "str \\| list of str", "rgb": "[r, g, b]", "table": "table"}[k.read]
        else:
            kind = _cell(annotation.replace(" | None", ""))
        cells = [f"`{name}`", kind, _cell(_default(cls, name, k)), _bounds(k, annotation), _cell(k.doc)]
        out.append("| " + " | ".join(cells) + " |")
    return [*out, ""]


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
        "One entry per rule, applied in recipe order (read by `zephon.recipe.filters`; see",
        "[Filters and forks](../filters-and-forks.md)). Kinds: "
        + ", ".join(f"`{k}`" for k in _filters._KIND_KEYS)
        + ".",
        "",
        "| key | kinds | what it is for |",
        "|---|---|---|",
    ]
    rows = _own_keys()
    out += [f"| `{k}` | {kinds} | {_cell(OWN_DOCS.get(('[[filters]]', k), ''))} |" for k, kinds in rows["[[filters]]"]]
    out += [
        "",
        "## `[fork]`",
        "",
        "Continue a run under a changed recipe from a declared step (read by `zephon.recipe.fork`; see",
        "[Forks](../filters-and-forks.md#forks-continue-a-run-under-a-changed-recipe)).",
        "",
        "| key | what it is for |",
        "|---|---|",
    ]
    out += [f"| `{k}` | {_cell(OWN_DOCS.get(('[fork]', k), ''))} |" for k, _ in rows["[fork]"]]
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
