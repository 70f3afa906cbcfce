"""``[[filters]]`` and ``[fork]`` as the recipe schema reads them: one dataclass per filter kind
and :class:`ForkSpec`, whose :func:`~zephon.recipe.keys.key` fields the generic section reader
(:func:`zephon.recipe.parse.read_table`) checks like every other section (unknown keys with a
did-you-mean, required keys, types and choices) and the recipe reference documents.

What one key cannot check alone (a regular expression that compiles, ``max`` >= ``min``, a user
function that imports, the datasets a rule names) is each kind's rule below. The result is a
:class:`FilterSpec` per entry (what the data definition holds: :meth:`FilterSpec.definition`) and
a :class:`ForkSpec`; :mod:`zephon.recipe.filters` prepares the filters, :mod:`zephon.recipe.fork`
runs the fork.

    >>> from zephon.recipe import parse_recipe
    >>> from zephon.data import BUNDLED_TOKENIZER
    >>> spec = parse_recipe({"seed": 1, "lanes": 4, "seq_len": 64, "global_batch_size": 8,
    ...                      "tokenizer": {"path": BUNDLED_TOKENIZER},
    ...                      "datasets": [{"name": "web", "path": "web/*.jsonl"}],
    ...                      "filters": [{"kind": "length", "min": 20}], "fork": {"parent": "a.toml", "step": 5}})
    >>> spec.filters[0].definition(), spec.fork.step
    ({'name': 'length#1', 'kind': 'length', 'params': {'unit': 'chars', 'min': 20}}, 5)
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import regex

from zephon.nodes import FILTER_KINDS, FilterError, StatefulFunction, call_bound, resolve_function
from zephon.nodes.stages import user_stage

from .keys import key, meta
from .spec import FilterSpec, ForkSpec, RecipeError, RecipeSpec

__all__ = [
    "FILTER_TABLES",
    "SEES",
    "TEXT_KINDS",
    "FilterSpec",
    "ForkSpec",
    "code_fingerprint",
    "parse_filters",
    "parse_fork",
    "with_sections",
]

#: what a text rule sees of a chat dataset's record: the conversation as its template renders it
#: (the default), or the record's JSON
SEES = ("rendered", "raw")
#: the kinds that judge a record's text (and so may say what they see of a conversation)
TEXT_KINDS = ("length", "regex", "dedup", "function", "transform", "stateful")
#: every kind a ``[[filters]]`` entry may have
KINDS = FILTER_KINDS

ReadTable = Callable[..., dict[str, Any]]


# -- the schema: one dataclass per kind --------------------------------------------------------
# read="rule": the kind's own rule below checks the value (its messages predate the schema)
@dataclass(frozen=True, kw_only=True)
class RuleTable:
    """The keys of every ``[[filters]]`` entry."""

    name: str | None = key(None, read="rule", doc="unique name; documents are counted under it (default: kind#N)")
    kind: str = key(choices=KINDS, read="rule", example='"length"', doc="the kind of rule")
    datasets: tuple[str, ...] | None = key(
        None, read="rule", doc="the datasets the rule applies to, by name (default: every dataset)"
    )


@dataclass(frozen=True, kw_only=True)
class TextRuleTable(RuleTable):
    """The keys of a rule that judges a record's text."""

    sees: str = key(
        "rendered",
        choices=SEES,
        new=True,
        doc='chat datasets: the conversation as its template renders it, or "raw": the record\'s JSON',
    )


@dataclass(frozen=True, kw_only=True)
class LengthFilter(TextRuleTable):
    """``kind = "length"``: keep texts whose length is within bounds."""

    unit: str = key("chars", choices=("chars", "tokens"), read="rule", doc="tokens: content tokens, no BOS/EOS")
    min: int = key(0, read="rule", doc="the shortest text kept (inclusive; an integer >= 0)")
    max: int | None = key(None, read="rule", doc="the longest text kept (inclusive)")


@dataclass(frozen=True, kw_only=True)
class RegexFilter(TextRuleTable):
    """``kind = "regex"``: drop (or keep only) texts a regular expression matches."""

    pattern: str = key(
        read="rule",
        example='"a regular expression"',
        doc="a Python regular expression, re.search on the text, each match bounded in time",
    )
    action: str = key(
        "exclude",
        choices=("exclude", "include"),
        read="rule",
        doc='"exclude" drops matching texts, "include" keeps only them',
    )


@dataclass(frozen=True, kw_only=True)
class DedupFilter(TextRuleTable):
    """``kind = "dedup"``: exact duplicates within a dataset; the first in file order stays."""


@dataclass(frozen=True, kw_only=True)
class FieldFilter(RuleTable):
    """``kind = "field"``: a metadata field of the record against bounds or a set of values."""

    field: str = key(
        read="rule",
        example='"the name of a metadata field" (a JSONL key, a Parquet/Arrow column)',
        doc="the record's metadata field (a JSONL key, a Parquet/Arrow column)",
    )
    min: float | None = key(None, read="rule", doc="the smallest value kept (a number, inclusive)")
    max: float | None = key(None, read="rule", doc="the largest value kept (a number, inclusive)")
    in_: tuple[Any, ...] | None = key(None, read="rule", toml="in", doc="keep only records whose value is one of these")
    not_in: tuple[Any, ...] | None = key(None, read="rule", doc="drop records whose value is one of these")


@dataclass(frozen=True, kw_only=True)
class FunctionFilter(TextRuleTable):
    """``kind = "function"``, ``"transform"`` (returns the new text), ``"stateful"`` (a class) or
    ``"stage"`` (a :class:`zephon.nodes.stages.RuleStage` subclass: a rule of the user's own)."""

    function: str = key(
        read="rule",
        example='"package.module:function"',
        doc='"package.module:name", importable by every worker',
    )
    params: Mapping[str, Any] = key(
        factory=dict, read="rule", doc="keyword arguments of the call (or of the class); plain TOML values"
    )


@dataclass(frozen=True, kw_only=True)
class ImageSizeFilter(RuleTable):
    """``kind = "image_size"``: keep image-text samples whose decoded images' sides are within bounds."""

    min_side: int | None = key(None, lo=1, hi="image_side", doc="the shortest image side kept, in pixels")
    max_side: int | None = key(None, lo=1, hi="image_side", doc="the longest image side kept, in pixels")


#: kind -> the dataclass of its keys
FILTER_TABLES: Mapping[str, type] = {
    "length": LengthFilter,
    "regex": RegexFilter,
    "dedup": DedupFilter,
    "field": FieldFilter,
    "function": FunctionFilter,
    "transform": FunctionFilter,
    "stateful": FunctionFilter,
    "stage": FunctionFilter,
    "image_size": ImageSizeFilter,
}


def code_fingerprint(path: str) -> str:
    """SHA-256 (16 hex digits) of the source file of the module that defines user function
    ``path``, and the version of its distribution: editing or upgrading the code changes it."""
    fn = resolve_function(path)
    mod = sys.modules.get(getattr(fn, "__module__", "") or "") or sys.modules[path.split(":")[0]]
    h = hashlib.sha256()
    try:
        with open(inspect.getsourcefile(mod) or "", "rb") as f:
            h.update(f.read())
    except (OSError, TypeError):
        h.update(repr(fn).encode())
    top = mod.__name__.split(".")[0]
    for dist in importlib.metadata.packages_distributions().get(top, []):
        h.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
    return h.hexdigest()[:16]


# -- each kind's rule --------------------------------------------------------------------------
def _err(where: str, msg: str) -> RecipeError:
    return RecipeError(f"recipe: {where}: {msg}")


def _int_key(where: str, entry: Mapping[str, Any], k: str) -> int | None:
    v = entry.get(k)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _err(where, f"{k} must be an integer >= 0, got {v!r}")
    return v


def _length(where: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    unit = entry.get("unit", "chars")
    if unit not in ("chars", "tokens"):
        raise _err(where, f'unit must be "chars" or "tokens", got {unit!r}')
    lo, hi = _int_key(where, entry, "min") or 0, _int_key(where, entry, "max")
    if hi is not None and hi < lo:
        raise _err(where, f"max = {hi} is below min = {lo}: every document would be dropped")
    return {"params": {"unit": unit, "min": lo, **({"max": hi} if hi is not None else {})}}


def _regex(where: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    pattern, action = entry.get("pattern"), entry.get("action", "exclude")
    if not isinstance(pattern, str) or not pattern:
        raise _err(where, 'needs pattern = "a regular expression"')
    try:
        re.compile(pattern)
    except re.error as e:
        raise _err(where, f"pattern {pattern!r} is not a regular expression: {e}") from None
    try:  # the engine that matches it (a time bound per match): it must read the pattern as re does
        regex.compile(pattern)
    except regex.error as e:
        raise _err(
            where,
            f"pattern {pattern!r} is read by Python's re but not by the regex engine zephon matches with "
            f"(it bounds each match in time): {e}; rewrite the pattern",
        ) from None
    if action not in ("include", "exclude"):
        raise _err(where, f'action must be "include" or "exclude", got {action!r}')
    return {"params": {"pattern": pattern, "action": action}}


def _function(where: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    kind, path, params = entry["kind"], entry.get("function"), entry.get("params", {})
    if not isinstance(path, str):
        raise _err(where, 'needs function = "package.module:function"')
    if not isinstance(params, dict):
        raise _err(where, f"params must be a table, got {params!r}")
    try:
        json.dumps(params, sort_keys=True)
        if kind == "stateful":
            StatefulFunction(entry.get("name", kind), path, params)  # the protocol and params, checked now
        elif kind == "stage":
            user_stage(path)  # a RuleStage subclass, checked now
        return {"params": dict(params), "function": path, "code": code_fingerprint(path)}
    except FilterError as e:
        raise _err(where, str(e)) from None
    except (TypeError, ValueError) as e:
        raise _err(where, f"params must be plain TOML values: {e}") from None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _distinct(values: list[Any]) -> list[Any]:
    """The distinct values of an ``in`` list, a bool never merged with a number (``true == 1``)."""
    seen: dict[tuple[str, Any], Any] = {}
    for x in values:
        seen.setdefault((type(x).__name__ if isinstance(x, (str, bool)) else "number", x), x)
    return list(seen.values())


def _field(where: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """A ``field`` rule's settings: the field, and a threshold (min/max) or a set (in/not_in)."""
    name = entry.get("field")
    if not isinstance(name, str) or not name:
        raise _err(where, 'needs field = "the name of a metadata field" (a JSONL key, a Parquet/Arrow column)')
    given = [k for k in ("min", "max", "in", "not_in") if k in entry]
    if not given or (set(given) & {"in", "not_in"} and len(given) > 1):
        raise _err(where, f"needs min and/or max (numbers), or one of in / not_in (a list of values); got {given}")
    out: dict[str, Any] = {"field": name}
    for k in given:
        v = entry[k]
        if k in ("min", "max") and (not _number(v) or v != v):
            raise _err(
                where,
                f"{k} must be a number, got {v!r}" + (": NaN compares false with everything" if _number(v) else ""),
            )
        if k in ("in", "not_in"):
            if not isinstance(v, list) or not v or not all(isinstance(x, (str, bool)) or _number(x) for x in v):
                raise _err(where, f"{k} must be a non-empty list of strings, numbers or booleans, got {v!r}")
            if any(x != x for x in v):
                raise _err(where, f"{k} holds NaN, which equals no value (a NaN field is an error, or a counted skip)")
            v = sorted(_distinct(v), key=repr)
        out[k] = v
    if "min" in out and "max" in out and out["max"] < out["min"]:
        raise _err(where, f"max = {out['max']} is below min = {out['min']}: every document would be dropped")
    return {"params": out}


def _image_size(where: str, given: Mapping[str, Any], spec: RecipeSpec, datasets: list[str]) -> dict[str, Any]:
    """An ``image_size`` rule's bounds (read and checked by the schema), and the datasets it judges."""
    lo, hi = given.get("min_side"), given.get("max_side")
    if lo is None and hi is None:
        raise _err(where, "needs min_side and/or max_side (pixels)")
    if lo is not None and hi is not None and hi < lo:
        raise _err(where, f"max_side = {hi} is below min_side = {lo}: every sample would be dropped")
    text = [s.name for s in spec.datasets if s.name in datasets and not s.has_images]
    if text:
        raise _err(
            where,
            f"kind = 'image_size' judges decoded images, and dataset {text[0]!r} has no images; name the datasets "
            "with images with datasets = [...]",
        )
    return {"params": {k: v for k, v in (("min_side", lo), ("max_side", hi)) if v is not None}}


_RULES: Mapping[str, Callable[[str, Mapping[str, Any]], dict[str, Any]]] = {
    "length": _length,
    "regex": _regex,
    "dedup": lambda where, entry: {},
    "field": _field,
    "function": _function,
    "transform": _function,
    "stateful": _function,
    "stage": _function,
}


# -- the sections ------------------------------------------------------------------------------
def _datasets(where: str, ds: Any, names: list[str]) -> tuple[str, ...] | None:
    if ds is None:
        return None
    if not isinstance(ds, list) or not ds or not all(isinstance(d, str) for d in ds):
        raise _err(where, f"datasets must be a list of dataset names, got {ds!r}")
    missing = [d for d in ds if d not in names]
    if missing:
        raise _err(where, f"datasets names {missing[0]!r}, not a dataset of the recipe ({', '.join(names)})")
    return tuple(ds)


def _entry(i: int, entry: Any, spec: RecipeSpec, taken: list[str], read_table: ReadTable) -> FilterSpec:
    """Entry ``i`` (0-based) of ``[[filters]]``: its kind's keys read by the schema, then its rule."""
    where = f"[[filters]] #{i + 1}"
    kind = entry.get("kind")
    if kind not in KINDS:
        raise _err(where, f"kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    cls = FILTER_TABLES[kind]
    needs = f"recipe: {where}: needs {{}} = {{}}".format
    given = read_table(
        cls, entry, f"{where} (kind = {kind!r})", section=f"{where} ", missing=lambda k: needs(k, meta(cls, k).example)
    )
    name = entry.get("name", f"{kind}#{i + 1}")
    if not isinstance(name, str) or not name or name in taken:
        raise _err(where, f"name must be a unique non-empty string, got {name!r}")
    names = [d.name for d in spec.datasets]
    ds = _datasets(where, entry.get("datasets"), names)
    if kind == "image_size":
        return FilterSpec(name, kind, ds, **_image_size(where, given, spec, list(ds or names)))
    sees = given.get("sees", "rendered")
    with call_bound(spec.workers.for_stage("tokenize").timeout_s):  # a stateful class is built here
        rule = _RULES[kind](where, entry)
    return FilterSpec(name, kind, ds, **rule, sees=None if sees == "rendered" else sees)


def parse_filters(raw: Any, spec: RecipeSpec, read_table: ReadTable) -> tuple[FilterSpec, ...]:
    """The ``[[filters]]`` entries of a recipe, checked against its datasets (``read_table``:
    :func:`zephon.recipe.parse.read_table`, passed in: the parser calls this module)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(e, dict) for e in raw):
        raise RecipeError('recipe: [[filters]] must be an array of tables, each with kind = "..."')
    out: list[FilterSpec] = []
    for i, entry in enumerate(raw):
        out.append(_entry(i, entry, spec, [f.name for f in out], read_table))
    return tuple(out)


_FORK_MISSING = {
    "parent": 'recipe: [fork] needs parent = "the recipe the run was started with"',
    "step": "recipe: [fork] step must be an integer >= 0 (the first batch of the fork), got None",
}


def parse_fork(raw: Any, base_dir: str, read_table: ReadTable) -> ForkSpec | None:
    """The ``[fork]`` section, checked (the parent is read later, by :class:`~zephon.recipe.Recipe`)."""
    if raw is None:
        return None
    hint = ' with parent = "recipe.toml" and step = N'
    given = read_table(ForkSpec, raw, "[fork]", section="[fork] ", hint=hint, missing=_FORK_MISSING.__getitem__)
    parent, step = given["parent"], given["step"]
    if not isinstance(parent, str) or not parent:
        raise RecipeError(_FORK_MISSING["parent"])
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise RecipeError(f"recipe: [fork] step must be an integer >= 0 (the first batch of the fork), got {step!r}")
    path = parent if os.path.isabs(parent) else os.path.join(base_dir, parent)
    return ForkSpec(path, step, given.get("fingerprint"))


def with_sections(spec: RecipeSpec, raw: Mapping[str, Any], base_dir: str, read_table: ReadTable) -> RecipeSpec:
    """``spec`` with the recipe's ``[[filters]]`` and ``[fork]`` read (the last step of parsing)."""
    filters = parse_filters(raw.get("filters"), spec, read_table)
    fork = parse_fork(raw.get("fork"), base_dir, read_table)
    return spec if not filters and fork is None else dataclasses.replace(spec, filters=filters, fork=fork)
