"""``[[filters]]``: a recipe's filters and transforms, checked, fingerprinted and prepared (the
entries are read by the recipe schema: :mod:`zephon.recipe.filterspec`).

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
    pattern = "lorem ipsum"    # re.search syntax; matched by the regex engine, each match bounded in time
    action = "exclude"         # "exclude" drops matching texts, "include" keeps only them

    [[filters]]
    kind = "dedup"             # exact duplicates within a dataset: the first in file order stays

    [[filters]]
    kind = "field"             # a metadata field of the record (a JSONL key, a Parquet/Arrow column)
    field = "score"            # against min / max (numbers, inclusive) ...
    min = 0.5
    # in = ["en", "de"]        # ... or a set: in = [...] keeps only those values, not_in = [...] drops them

    [[filters]]
    kind = "stateful"          # a class keeping state across its lane's documents (zephon.nodes.userfn)
    function = "my_pkg.dedup:NearDuplicates"   # NearDuplicates(**params)(text) -> bool; state(); load(state)
    params = { bits = 64 }

    [[filters]]
    kind = "function"          # or "transform" (returns the new text)
    function = "my_pkg.quality:keep"   # called as keep(text, **params) -> bool
    params = { threshold = 0.5 }

A rule's identity enters the recipe's fingerprint: its settings and, for a user function, its
import path, parameters and a fingerprint of its code (the SHA-256 of the module's source file
and the version of the distribution that ships it), so editing the function is a new data
definition and a checkpoint written before is refused. Before the run, each user function is
called twice on a sample of each dataset's records: a function that raises, returns the wrong
type, answers differently the second time or takes longer than ``[workers] timeout_s`` for one
call (every call of user code in the main process is bounded so) is refused, naming the function
and the record. A
stateful one is run over the sample by one instance, and again by an instance stopped halfway,
its state passed through JSON into a fresh instance that finishes: any difference is refused.
A ``field`` rule reads the named fields only for the datasets it applies to; a record without
the field, or with a value of the wrong type, stops the run naming it (or, under the dataset's
``on_error = "skip"``, is a counted skip).
Token estimates of a filtered dataset are measured after filtering (kept tokens per byte of all
sampled records), so its planned share accounts for what the rules drop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon.data.datasets import BadRecord
from zephon.engine import IndexPermutation
from zephon.engine.seeding import stable_u64
from zephon.nodes import (
    FilterChain,
    FilteredTokenize,
    FilterError,
    FilterRule,
    FilterVerdict,
    StatefulFunction,
    call_bound,
    duplicate_records,
)

from .explain import filters_summary
from .filterspec import FilterSpec, code_fingerprint, parse_filters
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


def _rules(filters: Sequence[FilterSpec], spec: RecipeSpec) -> list[FilterRule]:
    index = {d.name: i for i, d in enumerate(spec.datasets)}
    return [
        FilterRule(
            f.name,
            f.kind,
            None if f.datasets is None else tuple(index[d] for d in f.datasets),
            dict(f.params),
            f.function,
            timeout=spec.workers.for_stage("tokenize").timeout_s,
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


def _decided(fetch: FilteredTokenize, d: int, pairs: Sequence[tuple[int, int]], upto: int | None = None) -> list[Any]:
    """The chain's answer for each sampled record (``pairs`` in file order), as the workers give it;
    a rule's error (a user function's, a field's) as a :class:`RecipeError` naming the record."""
    out: list[Any] = []
    try:
        for s in sorted({s for s, _ in pairs}):
            out += fetch.decide_records(d, s, [r for ss, r in pairs if ss == s], upto)
    except FilterError as e:
        raise RecipeError(f"recipe: {e}") from e.__cause__
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


def _run_stateful(
    fetch: FilteredTokenize, rule: FilterRule, d: int, pairs: Sequence[tuple[int, int]], texts: Sequence[str]
) -> list[bool]:
    """A stateful rule's answers over ``texts`` (the kept sampled records, in order) by one
    instance, checked against an instance stopped halfway whose state, through JSON, a fresh
    instance continues: a stateful filter must be deterministic and restore exactly."""
    where = f"stateful filter {rule.name!r} ({rule.function!r})"
    pos, half = 0, len(texts) // 2
    ref: list[bool] = []
    got: list[bool] = []
    try:
        one = StatefulFunction(rule.name, str(rule.function), rule.params)
        for pos in range(len(texts)):
            ref.append(one(texts[pos]))
        a = StatefulFunction(rule.name, str(rule.function), rule.params)
        for pos in range(half):
            got.append(a(texts[pos]))
        b = StatefulFunction(rule.name, str(rule.function), rule.params)
        b.load(a.state())
        for pos in range(half, len(texts)):
            got.append(b(texts[pos]))
    except FilterError as e:
        rec = fetch.record_name(d, *pairs[pos]) if pairs else "(no record)"
        raise RecipeError(f"recipe: {str(e).replace('{record}', rec)}") from e.__cause__
    for k, (x, y) in enumerate(zip(ref, got)):
        if x != y:
            raise RecipeError(
                f"recipe: {where} is not deterministic or does not restore exactly: run over the sampled records "
                f"of dataset {fetch.datasets[d].name!r} it answered {x} on {fetch.record_name(d, *pairs[k])}, but "
                f"{y} when restored from its state() halfway; make __call__ depend on the text, the params and "
                "what state() holds only, and load(state) restore all of it"
            )
    return ref


def filtered_estimate(fetch: FilteredTokenize, d: int, pairs: Sequence[tuple[int, int]]) -> TokenEstimate:
    """Tokens per byte of dataset ``d`` after the chain (its stateful rules run over the sample
    in file order, by one instance each): content tokens of the kept (transformed) texts over the
    bytes of every good sampled record, BOS/EOS scaled by the share kept. Checks each stateful
    rule (:func:`_run_stateful`) on the way."""
    ix, tok = fetch.datasets[d], fetch.tokenizer
    nbytes, kept, good, where = 0, [], 0, []
    for (s, r), text in zip(pairs, _decided(fetch, d, pairs)):
        if isinstance(text, BadRecord):
            continue
        good += 1
        nbytes += int(ix.record_bytes(s)[r])
        if not isinstance(text, FilterVerdict):
            kept.append(text)
            where.append((s, r))
    for rule in fetch.chain.rules:
        if rule.kind == "stateful" and rule.applies(d):
            keep = _run_stateful(fetch, rule, d, where, kept)
            kept, where = [t for t, k in zip(kept, keep) if k], [w for w, k in zip(where, keep) if k]
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


def _dedup(fetch: FilteredTokenize, at: int, d: int) -> frozenset[tuple[int, int]]:
    """The later copies of dataset ``d``'s texts (after the rules before ``at``)."""
    ix = fetch.datasets[d]

    def read_shard(s: int) -> Any:
        n = ix.shards[s].num_records
        for lo in range(0, n, 4096):
            yield from _decided(fetch, d, [(s, r) for r in range(lo, min(n, lo + 4096))], upto=at)

    return duplicate_records(read_shard, len(ix.shards), lambda s, r, t: t)


def with_filters(p: Prepared, filters: Sequence[FilterSpec]) -> Prepared:
    """``p`` with the recipe's filters: the workers' fetch runs the chain, the duplicates are
    listed, user functions checked, token estimates measured after filtering, the plan re-made
    and the fingerprint extended by the rules' identity. ``p`` itself when there are none."""
    if not filters:
        return p
    spec = p.spec
    chain = FilterChain(_rules(filters, spec))
    f = p.fetch
    fetch = FilteredTokenize(f.datasets, f.tokenizer, f.on_error, align=f.align, split=f.split, chain=chain)
    estimates = dict(p.estimates)
    with call_bound(spec.workers.for_stage("tokenize").timeout_s):  # user code runs here, in the main process: bounded
        for d, (ds, ix) in enumerate(zip(spec.datasets, p.indexes)):
            if not any(rule.applies(d) for rule in chain.rules):
                continue
            for at, rule in enumerate(chain.rules):
                if rule.kind == "dedup" and rule.applies(d):
                    rule.duplicates = {**rule.duplicates, d: _dedup(fetch, at, d)}
            pairs = _sample(ix, spec.seed, d, spec.mixing.estimate_samples)
            _check_determinism(chain, d, ix, pairs)
            estimates[ds.name] = filtered_estimate(fetch, d, pairs)
    h = hashlib.sha256(p.fingerprint.encode())
    h.update(json.dumps([x.definition() for x in filters], sort_keys=True).encode())
    return dataclasses.replace(
        p,
        estimates=estimates,
        plan=work_plan(spec, p.indexes, estimates),
        fetch=fetch,
        fingerprint=h.hexdigest()[:32],
        definition={**p.definition, "filters": filters_summary([x.definition() for x in filters])},
    )
