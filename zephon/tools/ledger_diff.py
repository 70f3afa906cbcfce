"""How two runs compare: :func:`diff` of two ledgers, a ledger and a recipe, or two recipes.

It finds the first differing global batch and its differing lanes, the datasets whose tokens
differ there and, through the recipes' provenance, the documents that are in one side's lane
micro-batch and not the other's (``zephon ledger diff A B``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, TextIO

from zephon.recipe import Recipe

from .ledger import Ledger, RecipeSteps, Source, _lanes, _span, lane_documents, open_source

__all__ = ["LedgerDiff", "diff", "recipe_differences", "run_ledger_diff"]


def _recipe_of(src: Source, override: str | None) -> Recipe | None:
    if override:
        return Recipe.from_toml(override)
    if isinstance(src, RecipeSteps):
        return src.recipe
    return src.recipe()


@dataclass
class LedgerDiff:
    """What :func:`diff` found."""

    compared: int = 0
    differing: int = 0
    first: int | None = None
    lanes: list[int] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    only_in: str | None = None  # "a" / "b": batches one side has and the other does not

    @property
    def same(self) -> bool:
        """Whether every compared global batch is identical."""
        return self.differing == 0 and self.only_in is None


def _batches(src: Source, steps: int | None) -> list[int] | None:
    if isinstance(src, Ledger):
        got = src.batches()
        return got if steps is None else [b for b in got if b < steps]
    return None


def diff(
    a: Source,
    b: Source,
    *,
    steps: int | None = None,
    recipe_a: str | None = None,
    recipe_b: str | None = None,
    max_lanes: int = 4,
    max_documents: int = 5,
) -> LedgerDiff:
    """Compare two sources (ledgers or recipes) global batch by global batch.

    Reports the first differing batch, its differing lanes, the datasets whose tokens differ in
    them and, where a recipe is available for a side (a recipe source, ``recipe_a`` /
    ``recipe_b``, or the recipe a ledger's run names, if unchanged), the documents that are in
    one side's lane micro-batch and not the other's. Two recipes are compared over ``steps``
    batches (default 100, or to the end of a finite one)."""
    if a.lanes != b.lanes:
        raise ValueError(f"the two sides have different lane counts ({a.lanes} vs {b.lanes}): nothing lines up")
    out = LedgerDiff()
    _scan(a, b, _common_batches(a, b, steps, out), out)
    if out.first is not None:
        _explain(a, b, out.first, out, _recipe_of(a, recipe_a), _recipe_of(b, recipe_b), max_lanes, max_documents)
    return out


def _common_batches(a: Source, b: Source, steps: int | None, out: LedgerDiff) -> list[int]:
    """The global batches to compare: those both ledgers hold (noting which side has more), or
    the recorded ones of the one ledger, or ``steps`` (default 100) for two recipes."""
    ba, bb = _batches(a, steps), _batches(b, steps)
    if ba is None or bb is None:
        return ba if ba is not None else bb if bb is not None else list(range(100 if steps is None else steps))
    common = sorted(set(ba) & set(bb))
    if set(ba) != set(bb):
        out.only_in = "a" if set(ba) - set(bb) else "b"
        out.lines.append(f"batches recorded: A {_span(ba)}, B {_span(bb)}; comparing the {len(common)} both hold")
    return common


def _scan(a: Source, b: Source, batches: Sequence[int], out: LedgerDiff) -> None:
    """Compare lane digests batch by batch: counts, and the first differing batch and its lanes."""
    for t in batches:
        da, db = a.lane_digests(t), b.lane_digests(t)
        if da is None or db is None:
            side = "A" if da is None else "B"
            out.lines.append(f"{side} ends before global batch {t} (its data ended after {t} batches)")
            out.only_in = "b" if da is None else "a"
            break
        out.compared += 1
        if da == db:
            continue
        out.differing += 1
        if out.first is None:
            out.first = t
            out.lanes = [l for l in range(a.lanes) if da[l] != db[l]]


def _explain(
    a: Source,
    b: Source,
    t: int,
    out: LedgerDiff,
    ra: Recipe | None,
    rb: Recipe | None,
    max_lanes: int,
    max_documents: int,
) -> None:
    """The report on the first differing batch: per differing lane, tokens per dataset and the
    documents only one side has; the datasets that differ."""
    names = a.datasets if a.datasets == b.datasets else [f"{x}|{y}" for x, y in zip(a.datasets, b.datasets)]
    changed: set[str] = set()
    lines = [
        f"first differing global batch: {t} (trainer step {t + 1})",
        f"lanes that differ there: {_lanes(out.lanes)} ({len(out.lanes)} of {a.lanes})",
    ]
    if ra is not None and rb is not None:
        lines.extend(f"recipe difference: {d}" for d in recipe_differences(ra, rb))
    for lane in out.lanes[:max_lanes]:
        lines.append(_lane_tokens(a.tokens(t, lane), b.tokens(t, lane), lane, names, changed))
        filtered = _lane_filtered(a.filtered(t, lane), b.filtered(t, lane))
        if filtered:
            lines.append(filtered)
        if ra is None or rb is None:
            missing = "A" if ra is None else "B"
            lines.append(
                f"    documents: no recipe for {missing} (pass --recipe-{missing.lower()} RECIPE to name the documents)"
            )
            continue
        lines.extend(_lane_documents(ra, rb, t, lane, changed, max_documents))
    out.datasets = sorted(changed)
    lines.append(f"datasets that differ: {', '.join(out.datasets) or '(none by tokens: same mix, other documents)'}")
    out.lines = lines + out.lines


def _lane_tokens(
    ta: Sequence[int] | None, tb: Sequence[int] | None, lane: int, names: Sequence[str], changed: set[str]
) -> str:
    """One lane's tokens per dataset on both sides (``A/B (+delta)``); adds the differing datasets to ``changed``."""
    parts = []
    for d, name in enumerate(names):
        x = ta[d] if ta is not None and d < len(ta) else None
        y = tb[d] if tb is not None and d < len(tb) else None
        if x != y:
            changed.add(name)
        delta = f" ({y - x:+d})" if isinstance(x, int) and isinstance(y, int) and x != y else ""
        parts.append(f"{name} {x}/{y}{delta}")
    return f"  lane {lane}: tokens per dataset (A/B): " + ", ".join(parts)


def _lane_filtered(fa: dict[str, int] | None, fb: dict[str, int] | None) -> str:
    """Documents the lane's filters had dropped by then, per filter and dataset (``A/B (+delta)``);
    "" when neither side filtered any."""
    fa, fb = fa or {}, fb or {}
    parts = []
    for k in sorted(set(fa) | set(fb)):
        x, y = fa.get(k, 0), fb.get(k, 0)
        parts.append(f"{k} {x}/{y}" + (f" ({y - x:+d})" if x != y else ""))
    return "    documents filtered so far (A/B): " + ", ".join(parts) if parts else ""


def _lane_documents(ra: Recipe, rb: Recipe, t: int, lane: int, changed: set[str], max_documents: int) -> list[str]:
    """The documents in one side's micro-batch of ``lane`` at ``t`` and not the other's (regenerated
    from each recipe's provenance); adds their datasets to ``changed``."""
    lines = []
    docs_a, docs_b = lane_documents(ra, t, lane), lane_documents(rb, t, lane)
    for side, mine, theirs, recipe in (("A", docs_a, docs_b, ra), ("B", docs_b, docs_a, rb)):
        only = _by_document(mine - theirs)
        for doc in only:
            changed.add(recipe.datasets[doc[0]].name)
        if only:
            shown = ", ".join(_document(recipe, doc, spans) for doc, spans in list(only.items())[:max_documents])
            more = f" and {len(only) - max_documents} more" if len(only) > max_documents else ""
            lines.append(f"    only in {side}: {shown}{more}")
    return lines


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def recipe_differences(a: Recipe, b: Recipe) -> list[str]:
    """What differs between two recipes' data definitions (``key: A -> B``, datasets by name),
    and which datasets' files or which tokenizer differ (from their fingerprints).

    >>> from zephon.tools.demo import demo_recipe
    >>> import tempfile
    >>> r = demo_recipe(tempfile.mkdtemp(), scale=0.01)
    >>> recipe_differences(r, r.replace(seed=5))
    ['seed: 1234 -> 5']
    """

    def flat(r: Recipe) -> dict[str, Any]:
        d = dict(r.data_definition())
        d["datasets"] = {s.pop("name"): s for s in (dict(x) for x in d["datasets"])}
        names = [s.name for s in r.datasets]  # schedule phases by dataset name (phase 0 = the weights above)
        d["schedule"] = {str(step): dict(zip(names, w)) for step, w in d["schedule"] if step > 0}
        return _flatten(d)

    fa, fb = flat(a), flat(b)
    absent = object()

    def show(v: Any) -> str:
        return "(absent)" if v is absent else repr(v) if isinstance(v, str) else str(v)

    keys = sorted(k for k in set(fa) | set(fb) if fa.get(k, absent) != fb.get(k, absent))
    out = [f"{k}: {show(fa.get(k, absent))} -> {show(fb.get(k, absent))}" for k in keys]
    sa, sb = a.prepare().shared_state(), b.prepare().shared_state()
    for name in sorted(set(sa["data"]) & set(sb["data"])):
        if sa["data"][name] != sb["data"][name]:
            out.append(
                f"the files of dataset {name!r} differ (index fingerprints {sa['data'][name]} vs {sb['data'][name]})"
            )
    if sa["tokenizer"] != sb["tokenizer"]:
        out.append("the tokenizers differ")
    return out


def _by_document(segments: AbstractSet[tuple[int, ...]]) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """Segments grouped by document ``(dataset, shard, record, epoch)``, their token ranges merged
    where they touch (a document packed across two rows of a micro-batch is one entry)."""
    out: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for seg in sorted(segments):
        spans = out.setdefault(tuple(seg[:4]), [])
        if spans and spans[-1][1] == seg[4]:
            spans[-1] = (spans[-1][0], seg[5])
        else:
            spans.append((seg[4], seg[5]))
    return out


def _document(recipe: Recipe, doc: tuple[int, ...], spans: Sequence[tuple[int, int]]) -> str:
    d, shard, record, epoch = doc
    name = recipe.datasets[d].name
    tokens = ", ".join(f"{a}:{b}" for a, b in spans)
    if shard < 0:
        return f"{name} (tokens {tokens})"
    loc = recipe.indexes[d].locate(shard, record)
    return f"{name} {os.path.basename(loc['file'])} {loc['locator']} (epoch {epoch}, tokens {tokens})"


def _describe(path: str, src: Source) -> str:
    if isinstance(src, Ledger):
        runs = len(src.runs)
        return (
            f"{path}: ledger, global batches {_span(src.batches())}, {runs} run(s), recipe {src.runs[-1].get('recipe')}"
        )
    return f"{path}: recipe, computed here on {src.world_size} rank(s)"


def run_ledger_diff(
    a: str,
    b: str,
    *,
    steps: int | None = None,
    world_size: int = 1,
    recipe_a: str | None = None,
    recipe_b: str | None = None,
    out: TextIO | None = None,
) -> int:
    """``zephon ledger diff A B``: exit status 0 when every compared batch is identical, 1 when
    they differ."""
    out = sys.stdout if out is None else out
    sa, sb = open_source(a, world_size), open_source(b, world_size)
    try:
        print("A = " + _describe(a, sa), file=out)
        print("B = " + _describe(b, sb), file=out)
        d = diff(sa, sb, steps=steps, recipe_a=recipe_a, recipe_b=recipe_b)
    finally:
        for s in (sa, sb):
            if isinstance(s, RecipeSteps):
                s.close()
    for line in d.lines:
        print(line, file=out)
    verdict = "identical" if d.differing == 0 else f"{d.differing} differ"
    print(f"global batches compared: {d.compared}, {verdict}", file=out)
    return 0 if d.same else 1
