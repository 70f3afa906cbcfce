"""``[[filters]]``: a recipe's filters and transforms, checked, fingerprinted and prepared (the
entries are read by the recipe schema: :mod:`zephon.recipe.filterspec`).

Each entry is one rule of the recipe's :class:`zephon.nodes.RecordPipeline` (a
:class:`zephon.nodes.stages.RuleStage`, applied in recipe order between the read and the
encoders, to the datasets it names or to all)::

    [[filters]]
    name = "short"             # unique; documents are counted under it (default: kind + number)
    kind = "length"            # length | regex | dedup | field | function | transform | stateful | stage | image_size
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

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon.data.datasets import FIELD_FORMATS, TOKEN_FORMATS, BadRecord
from zephon.data.tokenizer import TextTokenizer
from zephon.engine import IndexPermutation
from zephon.engine.seeding import stable_u64
from zephon.nodes import (
    FilterError,
    FilterRule,
    RecordPipeline,
    StatefulFunction,
    call_bound,
    duplicate_records,
)
from zephon.nodes.stages import Record, RuleStage, UnviewableError, call_rule

from .estimate import TokenEstimate, planned_bytes
from .explain import filters_summary
from .filterspec import FilterSpec, code_fingerprint, parse_filters
from .spec import CHAT_KIND, DatasetSpec, RecipeError, RecipeSpec

__all__ = [
    "DETERMINISM_SAMPLES",
    "FilterSpec",
    "code_fingerprint",
    "filter_rules",
    "filtered_estimate",
    "filters_definition",
    "filters_fingerprint",
    "parse_filters",
    "prepare_filters",
]

#: records per dataset each user function is called on twice before the run
DETERMINISM_SAMPLES = 32
#: characters of a sampled text a filtered estimate tokenizes (longer ones are extrapolated)
ESTIMATE_CHARS = 64 << 10


def filter_rules(filters: Sequence[FilterSpec], spec: RecipeSpec) -> list[RuleStage]:
    """The record pipeline's rules for ``filters`` (dataset names as indices), each checked
    against the kinds of the datasets it applies to: a rule that cannot judge a dataset is
    refused with one line naming why (a text rule on stored token ids, a transform of a
    conversation or an image-text sample; an ``image_size`` rule on a dataset without images is
    refused by the schema, :mod:`zephon.recipe.filterspec`)."""
    index = {d.name: i for i, d in enumerate(spec.datasets)}
    timeout = spec.workers.for_stage("tokenize").timeout_s
    rules = [
        FilterRule(
            f.name,
            f.kind,
            None if f.datasets is None else tuple(index[d] for d in f.datasets),
            dict(f.params),
            f.function,
            timeout=timeout,
            sees=getattr(f, "sees", None) or "rendered",
        )
        for f in filters
    ]
    for rule in rules:
        for d, ds in enumerate(spec.datasets):
            if rule.applies(d):
                _check_applies(rule, ds)
    return rules


def _parquet(ds: DatasetSpec) -> bool:
    """Whether a dataset's files are Parquet (its format, or its paths' suffix)."""
    paths = ds.path if isinstance(ds.path, (list, tuple)) else [ds.path]
    return ds.format == "parquet" or (ds.format == "auto" and all(str(p).endswith(".parquet") for p in paths))


def _check_applies(rule: RuleStage, ds: DatasetSpec) -> None:
    """Refuse (one line, naming why) rule ``rule`` on a dataset it cannot judge."""
    where = f"recipe: [[filters]] {rule.name!r} ({rule.kind}) cannot apply to dataset {ds.name!r}"
    fix = "restrict the filter with datasets = [...]"
    if ds.format in TOKEN_FORMATS and rule.needs_text:
        raise RecipeError(
            f'{where}: it is pretokenized (stored token ids, no text); only length rules in unit = "tokens" and '
            f"dedup apply to it; {fix}"
        )
    if rule.kind == "field" and (
        ds.format in TOKEN_FORMATS
        or (ds.kind not in ("text", CHAT_KIND) and ds.format == "wds")
        or (ds.kind == CHAT_KIND and ds.has_images and not _parquet(ds))
    ):
        raise RecipeError(
            f"{where}: its records ({ds.kind}, format {ds.format!r}) have no metadata fields a rule can read "
            f"(field rules read {', '.join(FIELD_FORMATS)} datasets, and image-text Parquet); {fix}"
        )
    if rule.kind == "transform" and ds.kind != "text":
        raise RecipeError(
            f"{where}: a transform rewrites plain text, and a {ds.kind} record is not plain text (its conversation "
            f'or sample would be lost); {fix} to text datasets, or use kind = "function" to filter it'
        )


def _sample(ix: Any, seed: int, d: int, k: int) -> list[tuple[int, int]]:
    """A seeded sample of ``k`` records of an index: (shard, record), in file order."""
    n = ix.num_records
    picks = np.sort(IndexPermutation(n, stable_u64("filter-estimate", seed, d)).take(np.arange(min(k, n))))
    offsets = ix.shard_offsets()
    shards = np.searchsorted(offsets, picks, side="right") - 1
    return [(int(s), int(p - offsets[s])) for s, p in zip(shards, picks)]


def _decided(pipe: RecordPipeline, d: int, pairs: Sequence[tuple[int, int]], upto: int | None = None) -> list[Any]:
    """The rules' answer for each sampled record (``pairs`` in file order), as the workers give it;
    a rule's error (a user function's, a field's) as a :class:`RecipeError` naming the record."""
    out: list[Any] = []
    try:
        for s in sorted({s for s, _ in pairs}):
            out += pipe.decide_records(d, s, [r for ss, r in pairs if ss == s], upto)
    except FilterError as e:
        raise RecipeError(f"recipe: {e}") from e.__cause__
    return out


def _check_determinism(pipe: RecordPipeline, d: int, pairs: Sequence[tuple[int, int]]) -> None:
    """Call each user rule twice on the first sampled records; refuse a differing answer."""
    head = pairs[:DETERMINISM_SAMPLES]
    for rule in pipe.rules:
        if rule.kind not in ("function", "transform", "stage") or not rule.applies(d):
            continue
        for (s, r), rec in zip(head, _decided(pipe, d, head, upto=0)):
            if not isinstance(rec, Record):
                continue
            rec_name = pipe.record_name(d, s, r)
            try:
                first, again = (
                    _answer(pipe, rule, Record(d, s, r, rec.value, rec.fields, pipe.views[d])) for _ in range(2)
                )
            except FilterError as e:
                raise RecipeError(f"recipe: {str(e).replace('{record}', rec_name)}") from e.__cause__
            if first != again:
                raise RecipeError(
                    f"recipe: filter {rule.name!r} ({rule.kind} {rule.function!r}) is not deterministic: called twice "
                    f"on {rec_name} it answered differently; zephon's batches must be a function of the recipe, so make "
                    "it depend on its text and parameters only (seed any randomness from the text)"
                )


def _answer(pipe: RecordPipeline, rule: RuleStage, rec: Record) -> Any:
    """A rule's answer on ``rec``: its verdict, or the text it leaves (a transform's new text)."""
    try:
        got = call_rule(rule, rec, pipe.count_tokens)
    except UnviewableError:
        return None
    return got if got is not None else rec.text


def _run_stateful(
    pipe: RecordPipeline, rule: RuleStage, d: int, pairs: Sequence[tuple[int, int]], texts: Sequence[str]
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
        rec = pipe.record_name(d, *pairs[pos]) if pairs else "(no record)"
        raise RecipeError(f"recipe: {str(e).replace('{record}', rec)}") from e.__cause__
    for k, (x, y) in enumerate(zip(ref, got)):
        if x != y:
            raise RecipeError(
                f"recipe: {where} is not deterministic or does not restore exactly: run over the sampled records "
                f"of dataset {pipe.datasets[d].name!r} it answered {x} on {pipe.record_name(d, *pairs[k])}, but "
                f"{y} when restored from its state() halfway; make __call__ depend on the text, the params and "
                "what state() holds only, and load(state) restore all of it"
            )
    return ref


def _kept(
    pipe: RecordPipeline, d: int, pairs: Sequence[tuple[int, int]], bad_weigh: bool
) -> tuple[list[Record], int, int, int, int]:
    """The sampled records the rules keep (the stateful ones run over the sample in file order,
    by one instance each, and checked on the way); the bytes of the good records; the good and
    bad records; the bytes of all (with ``bad_weigh``, data version 5: the bad records' planned
    bytes too, which a skip delivers nothing of)."""
    ix = pipe.datasets[d]
    nbytes, good_bytes, kept, good, bad, where = 0, 0, [], 0, 0, []
    for (s, r), rec in zip(pairs, _decided(pipe, d, pairs)):
        if isinstance(rec, BadRecord):
            if bad_weigh:
                bad += 1
                nbytes += planned_bytes(ix, int(ix.record_bytes(s)[r]))
            continue
        good += 1
        good_bytes += int(ix.record_bytes(s)[r])
        if isinstance(rec, Record):
            kept.append(rec)
            where.append((s, r))
    for rule in pipe.rules:
        if rule.on_lane and rule.applies(d):
            keep = _run_stateful(pipe, rule, d, where, [str(k.sees(rule.sees)) for k in kept])
            kept, where = [t for t, k in zip(kept, keep) if k], [w for w, k in zip(where, keep) if k]
    if good and not kept:
        raise RecipeError(
            f"recipe: the [[filters]] drop all {good} records of dataset {ix.name!r} sampled to estimate its tokens: "
            "it could not deliver its share (a lane would read it forever). Loosen the filters for it, restrict "
            "them with datasets = [...], or remove the dataset"
        )
    return kept, good_bytes, good, bad, nbytes + good_bytes


def filtered_estimate(
    pipe: RecordPipeline,
    tok: TextTokenizer,
    d: int,
    pairs: Sequence[tuple[int, int]],
    base: TokenEstimate,
    bad_weigh: bool = False,
) -> TokenEstimate:
    """Tokens per byte of dataset ``d`` after the rules, over the bytes of every good sampled
    record (with ``bad_weigh``, data version 5: and the planned bytes of the bad ones). A text
    dataset's kept (transformed) texts are tokenized: content tokens of the kept texts, BOS/EOS
    scaled by the share kept. Another kind's estimate ``base`` (its tokens as it renders, stores
    or lays them out, over the same bytes) is scaled by the share of the good bytes kept."""
    ix = pipe.datasets[d]
    kept, good_bytes, good, bad, nbytes = _kept(pipe, d, pairs, bad_weigh)
    if pipe.views[d] is not None or any(isinstance(k.value, np.ndarray) for k in kept):
        kept_bytes = sum(int(ix.record_bytes(k.shard)[k.record]) for k in kept)
        scale = kept_bytes / good_bytes if good_bytes else 1.0
        images = getattr(ix, "kind", "text") != "text"  # image-text: its image tokens come from the index
        return TokenEstimate(
            max(base.tokens_per_byte * scale, 1e-9),
            base.tokens_per_record * (len(kept) / good if good else 1.0),
            len(kept),
            kept=max(len(kept) / (good + bad), 1e-9) if images and good else 1.0,
        )
    per_record = int(tok.add_bos) + int(tok.add_eos)
    texts = [str(k.sees()) for k in kept]
    heads = [t[:ESTIMATE_CHARS] for t in texts]
    tokens = sum(len(ids) * len(t) / max(1, len(h)) for ids, t, h in zip(tok.encode_content(heads), texts, heads))
    share = len(kept) / (good + bad) if good else 1.0
    return TokenEstimate(max(tokens, 1.0) / max(nbytes, 1), per_record * share, len(kept))


def _dedup(pipe: RecordPipeline, at: int, d: int) -> frozenset[tuple[int, int]]:
    """The later copies of dataset ``d``'s records (their text, or stored ids, after the rules before ``at``)."""
    ix = pipe.datasets[d]
    sees = pipe.rules[at].sees

    def read_shard(s: int) -> Any:
        n = ix.shards[s].num_records
        for lo in range(0, n, 4096):
            yield from _decided(pipe, d, [(s, r) for r in range(lo, min(n, lo + 4096))], upto=at)

    def text_of(s: int, r: int, rec: Any) -> Any:
        if not isinstance(rec, Record):
            return None
        try:
            return rec.sees(sees)
        except UnviewableError:
            return None

    return duplicate_records(read_shard, len(ix.shards), text_of)


def prepare_filters(
    pipe: RecordPipeline, spec: RecipeSpec, tok: TextTokenizer, estimates: Mapping[str, TokenEstimate]
) -> dict[str, TokenEstimate]:
    """Make ``pipe``'s rules ready before the run and return the token estimates after them:
    the duplicates listed, user functions checked (called twice; stateful ones stopped and
    restored halfway), each filtered dataset's tokens measured after filtering."""
    out = dict(estimates)
    with call_bound(spec.workers.for_stage("tokenize").timeout_s):  # user code runs here, in the main process: bounded
        for d, (ds, ix) in enumerate(zip(spec.datasets, pipe.datasets)):
            if not any(rule.applies(d) for rule in pipe.rules):
                continue
            for at, rule in enumerate(pipe.rules):
                if rule.kind == "dedup" and rule.applies(d):
                    rule.duplicates = {**rule.duplicates, d: _dedup(pipe, at, d)}
            pairs = _sample(ix, spec.seed, d, spec.mixing.estimate_samples)
            _check_determinism(pipe, d, pairs)
            out[ds.name] = filtered_estimate(pipe, tok, d, pairs, estimates[ds.name], spec.data_version >= 5)
    return out


def filters_fingerprint(fingerprint: str, filters: Sequence[FilterSpec]) -> str:
    """The recipe fingerprint extended by the rules' identity (``fingerprint`` itself without rules)."""
    if not filters:
        return fingerprint
    h = hashlib.sha256(fingerprint.encode())
    h.update(json.dumps([x.definition() for x in filters], sort_keys=True).encode())
    return h.hexdigest()[:32]


def filters_definition(filters: Sequence[FilterSpec]) -> dict[str, Any]:
    """What the rules add to a checkpoint's summary of the data definition (empty without rules)."""
    return {"filters": filters_summary([x.definition() for x in filters])} if filters else {}
