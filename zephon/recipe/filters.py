"""``[[filters]]``: a recipe's filters and transforms, checked, fingerprinted and prepared.

Each entry is one rule of :class:`zephon.nodes.FilterChain` (applied in recipe order, to the
datasets it names or to all)::

    [[filters]]
    name = "short"             # unique; documents are counted under it (default: kind + number)
    kind = "length"            # length | regex | dedup | function | transform
    datasets = ["web"]         # default: every dataset
    unit = "chars"             # length: "chars" or "tokens" (content tokens, no BOS/EOS)
    min = 200                  # length: bounds, inclusive (max optional)

    [[filters]]
    kind = "regex"
    pattern = "lorem ipsum"    # re.search on the text
    action = "exclude"         # "exclude" drops matching texts, "include" keeps only them

    [[filters]]
    kind = "dedup"             # exact duplicates within a dataset: the first in file order stays

    [[filters]]
    kind = "function"          # or "transform" (returns the new text)
    function = "my_pkg.quality:keep"   # called as keep(text, **params) -> bool
    params = { threshold = 0.5 }

A rule's identity enters the recipe's fingerprint: its settings and, for a user function, its
import path, parameters and a fingerprint of its code (the SHA-256 of the module's source file
and the version of the distribution that ships it), so editing the function is a new data
definition and a checkpoint written before is refused. Before the run, each user function is
called twice on a sample of each dataset's records: a function that raises, returns the wrong
type or answers differently the second time is refused, naming the function and the record.
Token estimates of a filtered dataset are measured after filtering (kept tokens per byte of all
sampled records), so its planned share accounts for what the rules drop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.data import TextTokenizer
from zephon.data.datasets import BadRecord
from zephon.engine import IndexPermutation, stable_u64
from zephon.nodes import (
    FILTER_KINDS,
    FilterChain,
    FilteredTokenize,
    FilterError,
    FilterRule,
    FilterVerdict,
    duplicate_records,
    resolve_function,
)

from .prepare import Prepared, TokenEstimate, work_plan
from .spec import RecipeError, RecipeSpec

__all__ = [
    "DETERMINISM_SAMPLES",
    "FilterSpec",
    "code_fingerprint",
    "filtered_estimate",
    "parse_filters",
    "with_filters",
]

#: records per dataset each user function is called on twice before the run
DETERMINISM_SAMPLES = 32
#: characters of a sampled text a filtered estimate tokenizes (longer ones are extrapolated)
ESTIMATE_CHARS = 64 << 10
#: the keys each kind allows besides name, kind and datasets
_KIND_KEYS: Mapping[str, tuple[str, ...]] = {
    "length": ("unit", "min", "max"),
    "regex": ("pattern", "action"),
    "dedup": (),
    "function": ("function", "params"),
    "transform": ("function", "params"),
}


@dataclass(frozen=True)
class FilterSpec:
    """One ``[[filters]]`` entry, validated; ``code`` fingerprints a user function's code."""

    name: str
    kind: str
    datasets: tuple[str, ...] | None = None
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    function: str | None = None
    code: str | None = None

    def definition(self) -> dict[str, Any]:
        """What enters the data definition (and the fingerprint)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


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


def _err(where: str, msg: str) -> RecipeError:
    return RecipeError(f"recipe: {where}: {msg}")


def _int_key(where: str, entry: Mapping[str, Any], k: str) -> int | None:
    v = entry.get(k)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _err(where, f"{k} must be an integer >= 0, got {v!r}")
    return v


def _params(where: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """A kind's settings, checked (the user function imported, its code fingerprinted)."""
    kind = entry["kind"]
    if kind == "length":
        unit = entry.get("unit", "chars")
        if unit not in ("chars", "tokens"):
            raise _err(where, f'unit must be "chars" or "tokens", got {unit!r}')
        lo, hi = _int_key(where, entry, "min") or 0, _int_key(where, entry, "max")
        if hi is not None and hi < lo:
            raise _err(where, f"max = {hi} is below min = {lo}: every document would be dropped")
        return {"params": {"unit": unit, "min": lo, **({"max": hi} if hi is not None else {})}}
    if kind == "regex":
        pattern, action = entry.get("pattern"), entry.get("action", "exclude")
        if not isinstance(pattern, str) or not pattern:
            raise _err(where, 'needs pattern = "a regular expression"')
        try:
            re.compile(pattern)
        except re.error as e:
            raise _err(where, f"pattern {pattern!r} is not a regular expression: {e}") from None
        if action not in ("include", "exclude"):
            raise _err(where, f'action must be "include" or "exclude", got {action!r}')
        return {"params": {"pattern": pattern, "action": action}}
    if kind in ("function", "transform"):
        path, params = entry.get("function"), entry.get("params", {})
        if not isinstance(path, str):
            raise _err(where, 'needs function = "package.module:function"')
        if not isinstance(params, dict):
            raise _err(where, f"params must be a table, got {params!r}")
        try:
            json.dumps(params, sort_keys=True)
            return {"params": dict(params), "function": path, "code": code_fingerprint(path)}
        except FilterError as e:
            raise _err(where, str(e)) from None
        except (TypeError, ValueError) as e:
            raise _err(where, f"params must be plain TOML values: {e}") from None
    return {}


def parse_filters(raw: Any, spec: RecipeSpec) -> tuple[FilterSpec, ...]:
    """The ``[[filters]]`` entries of a recipe, checked against its datasets."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(e, dict) for e in raw):
        raise RecipeError('recipe: [[filters]] must be an array of tables, each with kind = "..."')
    names = [d.name for d in spec.datasets]
    out: list[FilterSpec] = []
    for i, entry in enumerate(raw):
        where = f"[[filters]] #{i + 1}"
        kind = entry.get("kind")
        if kind not in FILTER_KINDS:
            raise _err(where, f"kind must be one of {', '.join(map(repr, FILTER_KINDS))}, got {kind!r}")
        allowed = ("name", "kind", "datasets", *_KIND_KEYS[kind])
        unknown = [k for k in entry if k not in allowed]
        if unknown:
            raise _err(where, f"unknown key {unknown[0]!r} for kind = {kind!r}; allowed: {', '.join(allowed)}")
        name = entry.get("name", f"{kind}#{i + 1}")
        if not isinstance(name, str) or not name or name in [f.name for f in out]:
            raise _err(where, f"name must be a unique non-empty string, got {name!r}")
        ds = entry.get("datasets")
        if ds is not None:
            if not isinstance(ds, list) or not ds or not all(isinstance(d, str) for d in ds):
                raise _err(where, f"datasets must be a list of dataset names, got {ds!r}")
            missing = [d for d in ds if d not in names]
            if missing:
                raise _err(where, f"datasets names {missing[0]!r}, not a dataset of the recipe ({', '.join(names)})")
        if spec.multimodal:
            raise _err(where, "filters apply to text recipes; this recipe has image-text datasets")
        out.append(FilterSpec(name, kind, None if ds is None else tuple(ds), **_params(where, entry)))
    return tuple(out)


def _rules(filters: Sequence[FilterSpec], spec: RecipeSpec) -> list[FilterRule]:
    index = {d.name: i for i, d in enumerate(spec.datasets)}
    return [
        FilterRule(
            f.name,
            f.kind,
            None if f.datasets is None else tuple(index[d] for d in f.datasets),
            dict(f.params),
            f.function,
        )
        for f in filters
    ]


def _sample(ix: Any, seed: int, d: int, k: int) -> list[tuple[int, int]]:
    """A seeded sample of ``k`` records of an index: (shard, record), in file order."""
    n = ix.num_records
    picks = np.sort(IndexPermutation(n, stable_u64("filter-estimate", seed, d)).take(np.arange(min(k, n))))
    offsets = ix.shard_offsets()
    shards = np.searchsorted(offsets, picks, side="right") - 1
    return [(int(s), int(p - offsets[s])) for s, p in zip(shards, picks)]


def _read(ix: Any, pairs: Sequence[tuple[int, int]]) -> list[Any]:
    out: list[Any] = []
    for s in sorted({s for s, _ in pairs}):
        out += ix.read(s, [r for ss, r in pairs if ss == s])
    return out


def _check_determinism(chain: FilterChain, d: int, ix: Any, pairs: Sequence[tuple[int, int]]) -> None:
    """Call each user rule twice on the first sampled records; refuse a differing answer."""
    count = len  # user rules never count tokens
    for rule in chain.rules:
        if rule.kind not in ("function", "transform") or not rule.applies(d):
            continue
        for (s, r), text in zip(pairs[:DETERMINISM_SAMPLES], _read(ix, pairs[:DETERMINISM_SAMPLES])):
            if isinstance(text, BadRecord):
                continue
            where = ix.locate(s, r)
            rec = f"dataset {ix.name!r}, file {where['file']!r}, {where['locator']}"
            try:
                first, again = (rule.apply(s, r, d, text, count) for _ in range(2))
            except FilterError as e:
                raise RecipeError(f"recipe: {str(e).replace('{record}', rec)}") from e.__cause__
            if first != again:
                raise RecipeError(
                    f"recipe: filter {rule.name!r} ({rule.kind} {rule.function!r}) is not deterministic: called twice "
                    f"on {rec} it answered differently; zephon's batches must be a function of the recipe, so make "
                    "it depend on its text and parameters only (seed any randomness from the text)"
                )


def filtered_estimate(
    chain: FilterChain, d: int, ix: Any, tok: TextTokenizer, pairs: Sequence[tuple[int, int]]
) -> TokenEstimate:
    """Tokens per byte of dataset ``d`` after the chain: content tokens of the kept (transformed)
    texts over the bytes of every good sampled record, BOS/EOS scaled by the share kept."""
    nbytes, kept, good = 0, [], 0
    for (s, r), text in zip(pairs, _read(ix, pairs)):
        if isinstance(text, BadRecord):
            continue
        good += 1
        nbytes += int(ix.record_bytes(s)[r])
        out = chain.decide(d, s, r, text, count_tokens=lambda t: len(tok.encode_content([t])[0]))
        if not isinstance(out, FilterVerdict):
            kept.append(out)
    if good and not kept:
        raise RecipeError(
            f"recipe: the [[filters]] drop all {good} records of dataset {ix.name!r} sampled to estimate its tokens: "
            "it could not deliver its share (a lane would read it forever). Loosen the filters for it, restrict "
            "them with datasets = [...], or remove the dataset"
        )
    per_record = int(tok.add_bos) + int(tok.add_eos)
    heads = [t[:ESTIMATE_CHARS] for t in kept]
    tokens = sum(len(ids) * len(t) / max(1, len(h)) for ids, t, h in zip(tok.encode_content(heads), kept, heads))
    share = len(kept) / good if good else 1.0
    return TokenEstimate(max(tokens, 1.0) / max(nbytes, 1), per_record * share, len(kept))


def _dedup(chain: FilterChain, at: int, d: int, ix: Any, tok: TextTokenizer) -> frozenset[tuple[int, int]]:
    """The later copies of dataset ``d``'s texts (after the rules before ``at``)."""

    def count(text: str) -> int:
        return len(tok.encode_content([text])[0])

    def read_shard(s: int) -> Any:
        n = ix.shards[s].num_records
        for lo in range(0, n, 4096):
            yield from ix.read(s, list(range(lo, min(n, lo + 4096))))

    return duplicate_records(
        read_shard, len(ix.shards), lambda s, r, t: chain.decide(d, s, r, t, upto=at, count_tokens=count)
    )


def with_filters(p: Prepared, filters: Sequence[FilterSpec]) -> Prepared:
    """``p`` with the recipe's filters: the workers' fetch runs the chain, the duplicates are
    listed, user functions checked, token estimates measured after filtering, the plan re-made
    and the fingerprint extended by the rules' identity. ``p`` itself when there are none."""
    if not filters:
        return p
    spec = p.spec
    chain = FilterChain(_rules(filters, spec))
    estimates = dict(p.estimates)
    for d, (ds, ix) in enumerate(zip(spec.datasets, p.indexes)):
        if not any(rule.applies(d) for rule in chain.rules):
            continue
        for at, rule in enumerate(chain.rules):
            if rule.kind == "dedup" and rule.applies(d):
                rule.duplicates = {**rule.duplicates, d: _dedup(chain, at, d, ix, p.tokenizer)}
        pairs = _sample(ix, spec.seed, d, spec.mixing.estimate_samples)
        _check_determinism(chain, d, ix, pairs)
        estimates[ds.name] = filtered_estimate(chain, d, ix, p.tokenizer, pairs)
    f = p.fetch
    fetch = FilteredTokenize(f.datasets, f.tokenizer, f.on_error, align=f.align, split=f.split, chain=chain)
    h = hashlib.sha256(p.fingerprint.encode())
    h.update(json.dumps([x.definition() for x in filters], sort_keys=True).encode())
    return dataclasses.replace(
        p, estimates=estimates, plan=work_plan(spec, p.indexes, estimates), fetch=fetch, fingerprint=h.hexdigest()[:32]
    )
