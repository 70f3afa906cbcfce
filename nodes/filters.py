"""Filters and transforms of documents: decided by the workers, counted by the lane.

A recipe's ``[[filters]]`` become one :class:`FilterChain` of :class:`FilterRule` s, applied in
order to each record's text after it is read and before it is tokenized: a ``transform`` returns
a new text (the one later rules, the tokenizer and the packer see), any other rule keeps or drops
the document. :class:`FilteredTokenize` is :class:`~zephon.nodes.FetchTokenize` with the chain in
front (it runs on the ordered-parallel workers, so a filter is as parallel as tokenization); a
dropped document travels on as a :class:`FilteredDoc` (no tokens) and :class:`FilterCounter`,
right after the mapper, counts it per (filter, dataset) in the lane's state and drops it.

Why this is elastic and resumable without new machinery: every decision is a function of the
record (its text, its dataset, its (shard, record) id) and of the recipe alone, never of what a
lane saw before. Exact duplicates (``kind = "dedup"``) are decided that way too: before the run,
one pass over the dataset (:func:`duplicate_records`) keeps the first record of each text in
file order (shards in index order, records in file order) and lists the later copies; a worker
drops a record iff it is on that list. No lane keeps a set of hashes, so nothing depends on which
lane read what first, on the world size, or on where a run resumed.

The parts of a long document (``[mixing] split_tokens``) are decided on the whole record's
text, so they are kept or dropped together; the counter counts a dropped record once.

    >>> chain = FilterChain([FilterRule("short", "length", params={"unit": "chars", "min": 5})])
    >>> chain.decide(0, 0, 0, "hello world"), chain.decide(0, 0, 1, "hi")
    ('hello world', FilterVerdict(rule='short'))
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import regex
from torchdata.nodes import BaseNode

from zephon.data.datasets import BadRecord, read_fields
from zephon.engine import StateError, ZNode
from zephon.engine.node import UPSTREAM, check_state_keys, state_ints, state_node

from .tokenize import FetchTokenize, TokDoc
from .userfn import FilterError, StatefulFunction, call_user, resolve_function
from .worksource import WorkItem

__all__ = [
    "FILTER_KINDS",
    "FilterChain",
    "FilterCounter",
    "FilterError",
    "FilterRule",
    "FilterVerdict",
    "FilteredDoc",
    "FilteredTokenize",
    "duplicate_records",
    "resolve_function",
]

#: the kinds of a ``[[filters]]`` entry: built-in rules, and user functions (``function``: keep
#: or drop; ``transform``: a new text)
FILTER_KINDS = ("length", "regex", "dedup", "field", "function", "transform", "stateful")


class FieldError(FilterError):
    """A ``field`` rule met a record without the field, or with a value of the wrong type: an
    error naming the record, or a counted skip under the dataset's ``on_error = "skip"``
    (``reason``: the skip's reason, short and stable)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Carried(NamedTuple):
    """A kept document with its (final) text, for the stateful rules of its dataset: made by the
    workers for a record's first part, unwrapped by :class:`FilterCounter` on the lane."""

    doc: TokDoc
    text: str


_NUMBER = (int, float, np.integer, np.floating)


def field_in(value: Any, values: Sequence[Any]) -> bool:
    """Whether a field's ``value`` is one of ``values`` comparing like with like: a bool matches
    only a bool (``True == 1`` in Python, so ``true`` would match ``in = [1]``), a number a number.

    >>> field_in(True, [1]), field_in(1.0, [1]), field_in(True, [True])
    (False, True, True)
    """
    kind = bool if isinstance(value, bool) else str if isinstance(value, str) else float
    return any(
        (bool if isinstance(x, bool) else str if isinstance(x, str) else float) is kind and x == value for x in values
    )


class FilterVerdict(NamedTuple):
    """A record dropped by rule ``rule`` (its name)."""

    rule: str


class FilteredDoc(TokDoc):
    """A document a filter dropped: no tokens, ``skipped`` holds the rule's name.
    :class:`FilterCounter` counts and drops it (it never reaches a packer)."""


@dataclass
class FilterRule:
    """One rule: ``name`` (unique, counted under it), ``kind`` (:data:`FILTER_KINDS`), the
    datasets it applies to (indices; None: all) and its parameters:

    * ``length``: ``unit`` ("chars" or "tokens", content tokens without BOS/EOS), ``min``, ``max``;
    * ``regex``: ``pattern`` (``re.search`` syntax, matched by the ``regex`` engine with a time
      bound: ``timeout`` seconds per text, so a catastrophically backtracking pattern stops the
      run naming the record instead of hanging it), ``action`` ("include": keep only matching
      texts, "exclude": drop them);
    * ``dedup``: exact duplicates within the dataset (``duplicates``: per dataset, the set of
      global record numbers that are later copies, from :func:`duplicate_records`);
    * ``field``: ``field`` (a metadata field of the record) and ``min`` / ``max`` (numbers) or
      ``in`` / ``not_in`` (lists of values); a missing field or a value of the wrong type raises
      :class:`FieldError`;
    * ``stateful``: ``function`` ("package.module:Class", see :mod:`zephon.nodes.userfn`), run
      by :class:`FilterCounter` on the lane, never by :meth:`FilterChain.decide`;
    * ``function`` / ``transform``: ``function`` ("package.module:function") called as
      ``fn(text, **params)``; it must return a bool (keep) / a str (the new text).
    """

    name: str
    kind: str
    datasets: tuple[int, ...] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    function: str | None = None
    duplicates: Mapping[int, frozenset[tuple[int, int]]] = field(default_factory=dict)
    timeout: float | None = None

    def applies(self, dataset: int) -> bool:
        """Whether the rule applies to dataset ``dataset`` (an index of the recipe's datasets)."""
        return self.datasets is None or dataset in self.datasets

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def _fn(self) -> Callable[..., Any]:
        fn = self.__dict__.get("_resolved")
        if fn is None:
            if self.kind in ("function", "transform"):
                fn = resolve_function(str(self.function))
            elif self.kind == "regex":
                fn = regex.compile(self.params["pattern"]).search
            else:
                fn = len
            self.__dict__["_resolved"] = fn
        return fn

    def apply(
        self,
        shard: int,
        record: int,
        dataset: int,
        text: str,
        count_tokens: Callable[[str], int],
        fields: Mapping[str, Any] | None = None,
    ) -> Any:
        """The text (maybe transformed) if the record is kept, else a :class:`FilterVerdict`."""
        p, k = self.params, self.kind
        if k == "field":
            return text if self._field_keeps(fields or {}) else FilterVerdict(self.name)
        if k == "length":
            n = count_tokens(text) if p.get("unit", "chars") == "tokens" else len(text)
            lo, hi = p.get("min", 0), p.get("max")
            return text if lo <= n and (hi is None or n <= hi) else FilterVerdict(self.name)
        if k == "regex":
            try:
                hit = self._fn()(text, timeout=self.timeout) is not None
            except TimeoutError:
                raise FilterError(
                    f"filter {self.name!r} (regex {p['pattern']!r}) did not finish matching within {self.timeout:g} s "
                    "on {record}: the pattern backtracks catastrophically on this text (nested repetition such as "
                    "(a+)+); rewrite it without nested or overlapping repetition, or raise [workers] timeout_s"
                ) from None
            return text if hit == (p.get("action", "exclude") == "include") else FilterVerdict(self.name)
        if k == "dedup":
            return FilterVerdict(self.name) if (shard, record) in self.duplicates.get(dataset, ()) else text
        return self._call_user(text, shard, record)

    def _field_keeps(self, fields: Mapping[str, Any]) -> bool:
        p = self.params
        name = p["field"]
        where = f"filter {self.name!r} (field {name!r})"
        fix = 'fix the data, restrict the filter with datasets = [...], or set on_error = "skip" for the dataset'
        if fields.get(name) is None:
            what = (
                "is null" if name in fields else f"is missing (fields read: {', '.join(map(repr, fields)) or 'none'})"
            )
            raise FieldError(f"{where}: the field {what} on {{record}}; {fix}", f"field {name!r} {what.split(' (')[0]}")
        v = fields[name]
        if isinstance(v, (float, np.floating)) and v != v:
            raise FieldError(
                f"{where}: the value is NaN (not a number to compare), on {{record}}; {fix}", f"field {name!r} is NaN"
            )
        if "in" in p or "not_in" in p:
            if not isinstance(v, (str, bool, *_NUMBER)):
                what = f"is a {type(v).__name__}, not a string or number"
                raise FieldError(f"{where}: the value {what}, on {{record}}; {fix}", f"field {name!r} {what}")
            return field_in(v, p["in"]) if "in" in p else not field_in(v, p["not_in"])
        if isinstance(v, bool) or not isinstance(v, _NUMBER):
            what = f"is a {type(v).__name__}, not a number"
            raise FieldError(f"{where}: the value {v!r} {what}, on {{record}}; {fix}", f"field {name!r} {what}")
        return not (("min" in p and v < p["min"]) or ("max" in p and v > p["max"]))

    def _call_user(self, text: str, shard: int, record: int) -> Any:
        where = f"filter {self.name!r} ({self.kind} {self.function!r})"
        try:
            got = call_user(where, self._fn(), text, **dict(self.params))
        except FilterError:
            raise
        except Exception as e:
            raise FilterError(
                f"{where} raised {type(e).__name__}: {e} on {{record}}; fix the function (or drop the rule)"
            ) from e
        if self.kind == "transform":
            if not isinstance(got, str):
                raise FilterError(
                    f"{where} returned a {type(got).__name__}, not a str, on {{record}}: a transform "
                    "returns the new text"
                )
            return got
        if not isinstance(got, (bool, np.bool_)):
            raise FilterError(
                f"{where} returned a {type(got).__name__}, not a bool, on {{record}}: a filter "
                "function returns True to keep the document, False to drop it"
            )
        return text if got else FilterVerdict(self.name)


class FilterChain:
    """The rules of a recipe, in order (a transform's text is what later rules see). Picklable:
    user functions travel by name and are imported once per worker process."""

    def __init__(self, rules: Sequence[FilterRule]) -> None:
        self.rules = list(rules)

    @property
    def names(self) -> list[str]:
        """The rules' names, in order: what :class:`FilterCounter` counts under."""
        return [r.name for r in self.rules]

    def fields(self, dataset: int) -> tuple[str, ...]:
        """The metadata fields the ``field`` rules applying to ``dataset`` compare (read only then)."""
        return tuple(dict.fromkeys(r.params["field"] for r in self.rules if r.kind == "field" and r.applies(dataset)))

    def stateful(self, dataset: int) -> bool:
        """Whether a ``stateful`` rule applies to ``dataset`` (its kept texts travel to the lane)."""
        return any(r.kind == "stateful" and r.applies(dataset) for r in self.rules)

    def decide(
        self,
        dataset: int,
        shard: int,
        record: int,
        text: str,
        upto: int | None = None,
        count_tokens: Callable[[str], int] = len,
        fields: Mapping[str, Any] | None = None,
    ) -> Any:
        """The record's final text, or the :class:`FilterVerdict` of the first rule that drops
        it (rules ``[0, upto)`` only, when given; ``stateful`` ones are the lane's);
        ``count_tokens`` measures ``unit = "tokens"``, ``fields`` holds the record's metadata."""
        for rule in self.rules[:upto]:
            if rule.applies(dataset) and rule.kind != "stateful":
                text = rule.apply(shard, record, dataset, text, count_tokens, fields)
                if isinstance(text, FilterVerdict):
                    return text
        return text

    def __repr__(self) -> str:
        return f"FilterChain({', '.join(f'{r.name}:{r.kind}' for r in self.rules)})"


def duplicate_records(
    read_shard: Callable[[int], Iterable[Any]], shards: int, text_of: Callable[[int, int, str], Any]
) -> frozenset[tuple[int, int]]:
    """``(shard, record)`` of every record whose text (``text_of(shard, record, raw)``: the
    text after the rules before the dedup rule; a :class:`FilterVerdict` or bad record is not a
    text) equals an earlier record's, in file order. Memory: a 16-byte digest per distinct text."""
    seen: set[bytes] = set()
    dups: set[tuple[int, int]] = set()
    for s in range(shards):
        for r, raw in enumerate(read_shard(s)):
            if isinstance(raw, BadRecord):
                continue
            text = text_of(s, r, raw)
            if not isinstance(text, str):
                continue
            h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            if h in seen:
                dups.add((s, r))
            else:
                seen.add(h)
    return frozenset(dups)


class FilteredTokenize(FetchTokenize):
    """:class:`FetchTokenize` with a :class:`FilterChain` between the read and the tokenizer:
    kept records are tokenized as their (transformed) text, dropped ones come back as
    :class:`FilteredDoc`. An error of a rule names the record (file and line/row)."""

    _transient = (*FetchTokenize._transient, "_tls")

    def __init__(self, *args: Any, chain: FilterChain, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.chain = chain

    def _count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode_content([text])[0])

    def _local(self) -> threading.local:
        tls = self.__dict__.get("_tls")
        if tls is None:
            tls = self.__dict__.setdefault("_tls", threading.local())
        return tls

    def fetch(self, items: Sequence[WorkItem]) -> list[Any]:
        decided = getattr(self._local(), "texts", None)
        if decided is not None:
            return [decided[(it.dataset, it.shard, it.record)] for it in items]
        return super().fetch(items)

    def record_name(self, d: int, s: int, r: int) -> str:
        """A record in words, for messages: dataset, file and line/row."""
        where = self.datasets[d].locate(s, r)
        return f"dataset {self.datasets[d].name!r}, file {where['file']!r}, {where['locator']}"

    def counter(self, source: BaseNode, dataset_names: Sequence[str]) -> FilterCounter:
        """The lane's :class:`FilterCounter` for this chain (its stateful rules included)."""
        stateful = [r for r in self.chain.rules if r.kind == "stateful"]
        return FilterCounter(
            source, rules=self.chain.names, dataset_names=dataset_names, stateful=stateful, locate=self.record_name
        )

    def decide_records(self, d: int, s: int, records: Sequence[int], upto: int | None = None) -> list[Any]:
        """Records ``records`` of shard ``s`` of dataset ``d`` after the chain (rules ``[0,
        upto)``): each one's text, :class:`FilterVerdict` or :class:`BadRecord` (read as bad, or
        a ``field`` rule's missing or mistyped field under ``on_error = "skip"``)."""
        ix = self.datasets[d]
        texts = ix.read(s, list(records))
        names = self.chain.fields(d)
        fields = read_fields(ix, s, list(records), names) if names else [None] * len(texts)
        out: list[Any] = []
        for r, text, f in zip(records, texts, fields):
            if isinstance(text, BadRecord):
                out.append(text)
                continue
            try:
                out.append(self.chain.decide(d, s, r, text, upto=upto, count_tokens=self._count_tokens, fields=f))
            except FilterError as e:
                where = ix.locate(s, r)
                if isinstance(e, FieldError) and self.on_error[d] == "skip":
                    out.append(BadRecord(ix.name, where["file"], where["locator"], f"{e.reason} (filter rule)"))
                    continue
                raise FilterError(str(e).replace("{record}", self.record_name(d, s, r))) from e.__cause__
        return out

    def decide(self, items: Sequence[WorkItem]) -> dict[tuple[int, int, int], Any]:
        """Each distinct record's text after the chain (or its verdict, or its BadRecord)."""
        keys = sorted(dict.fromkeys((it.dataset, it.shard, it.record) for it in items))
        out: dict[tuple[int, int, int], Any] = {}
        for (d, s), group in itertools.groupby(keys, key=lambda k: k[:2]):
            records = [r for _, _, r in group]
            for r, got in zip(records, self.decide_records(d, s, records)):
                out[(d, s, r)] = got
        return out

    def __call__(self, items: list[WorkItem]) -> list[Any]:
        decided = self.decide(items)
        keep = [
            i for i, it in enumerate(items) if not isinstance(decided[(it.dataset, it.shard, it.record)], FilterVerdict)
        ]
        tls = self._local()
        tls.texts = decided
        try:
            docs = super().__call__([items[i] for i in keep]) if keep else []
        finally:
            tls.texts = None
        out: list[Any] = []
        got = iter(docs)
        kept = set(keep)
        empty = np.zeros(0, dtype=np.int32)
        for i, it in enumerate(items):
            text = decided[(it.dataset, it.shard, it.record)]
            if i not in kept:
                out.append(FilteredDoc(empty, it.dataset, it, text.rule))
                continue
            doc = next(got)
            carry = isinstance(text, str) and doc.skipped is None and it.part == 0 and self.chain.stateful(it.dataset)
            out.append(Carried(doc, text) if carry else doc)
        return out

    def __repr__(self) -> str:
        return f"FilteredTokenize({self.chain!r}, {super().__repr__()})"


class FilterCounter(ZNode[Any]):
    """Drop :class:`FilteredDoc` s, counting them per (rule, dataset) once per record (at its
    first part), and run the ``stateful`` rules on the lane's kept documents, in lane order
    (their instances' states travel in this node's state; a multi-part record's verdict, made
    at its first part, holds for its other parts). State: the counts, the stateful rules' states
    and verdicts in progress, and the upstream's state at the same point (no replay)."""

    node_type = "filter_counter"

    def __init__(
        self,
        source: BaseNode,
        *,
        rules: Sequence[str],
        dataset_names: Sequence[str],
        stateful: Sequence[FilterRule] = (),
        locate: Callable[[int, int, int], str] | None = None,
    ) -> None:
        super().__init__()
        self.source, self.rules, self.names = source, list(rules), list(dataset_names)
        self.stateful, self.locate = list(stateful), locate
        self.dropped = [[0] * len(self.names) for _ in self.rules]
        self.users = [StatefulFunction(r.name, str(r.function), r.params) for r in self.stateful]
        self.held = [[-1, -1, -1] for _ in self.names]  # per dataset: shard, record, dropping rule (-1 keeps)

    def _repr_args(self):
        yield f"rules={self.rules}"
        yield f"dropped={sum(map(sum, self.dropped))}"

    def _keys(self) -> tuple[str, ...]:
        return (UPSTREAM, "dropped", "users", "held") if self.stateful else (UPSTREAM, "dropped")

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.dropped = [[0] * len(self.names) for _ in self.rules]
        self.users = [StatefulFunction(r.name, str(r.function), r.params) for r in self.stateful]
        self.held = [[-1, -1, -1] for _ in self.names]
        if initial_state is None:
            self.source.reset(None)
            return
        check_state_keys(self, initial_state, self._keys())
        rows = initial_state["dropped"]
        if not isinstance(rows, list) or len(rows) != len(self.rules):
            raise StateError(f"{self!r}: state field 'dropped' must hold one row per filter ({len(self.rules)})")
        dropped = [state_ints(self, "dropped", row, len(self.names)) for row in rows]
        if self.stateful:
            users, held = initial_state["users"], initial_state["held"]
            if (
                not isinstance(users, list)
                or len(users) != len(self.users)
                or not all(isinstance(u, dict) for u in users)
            ):
                raise StateError(f"{self!r}: state field 'users' must hold one dict per stateful filter")
            if not isinstance(held, list) or len(held) != len(self.names):
                raise StateError(f"{self!r}: state field 'held' must hold one entry per dataset")
            self.held = [[int(x) for x in state_ints(self, "held", h, 3, lo=-1)] for h in held]
            for u, st in zip(self.users, users):
                u.load(st)
        self.source.reset(state_node(self, UPSTREAM, initial_state[UPSTREAM]))
        self.dropped = dropped

    def get_state(self) -> dict[str, Any]:
        st: dict[str, Any] = {UPSTREAM: self.source.state_dict(), "dropped": [list(r) for r in self.dropped]}
        if self.stateful:
            st.update(users=[u.state() for u in self.users], held=[list(h) for h in self.held])
        return self._tagged(st)

    def _judge(self, doc: TokDoc, text: str) -> int:
        """The index (in :attr:`rules`) of the stateful rule that drops ``doc``, or -1."""
        it = doc.item
        for rule, user in zip(self.stateful, self.users):
            if not rule.applies(doc.dataset):
                continue
            try:
                keep = user(text)
            except FilterError as e:
                rec = self.locate(it.dataset, it.shard, it.record) if self.locate else it.provenance
                raise FilterError(str(e).replace("{record}", rec)) from e.__cause__
            if not keep:
                return self.rules.index(rule.name)
        return -1

    def next(self) -> Any:
        while True:
            doc = next(self.source)
            if isinstance(doc, FilteredDoc):
                if getattr(doc.item, "part", 0) == 0:
                    self.dropped[self.rules.index(str(doc.skipped))][doc.dataset] += 1
                continue
            if isinstance(doc, Carried):
                doc, text = doc
                it = doc.item
                verdict = self._judge(doc, text)
                if it.parts > 1:
                    self.held[it.dataset] = [it.shard, it.record, verdict]
                if verdict < 0:
                    return doc
                self.dropped[verdict][doc.dataset] += 1
                continue
            if self.stateful and isinstance(doc, TokDoc) and self._later_part_dropped(doc.item):
                continue
            return doc

    def _later_part_dropped(self, it: WorkItem) -> bool:
        """Whether ``it``, a later part of a record a stateful rule judged, goes with its first part."""
        h = self.held[it.dataset]
        if it.part == 0 or h[0] != it.shard or h[1] != it.record:
            return False
        if it.part == it.parts - 1:
            self.held[it.dataset] = [-1, -1, -1]
        return h[2] >= 0

    def counts(self) -> dict[str, dict[str, int]]:
        """Documents dropped, by filter and dataset."""
        return {r: dict(zip(self.names, row)) for r, row in zip(self.rules, self.dropped)}

    def ledger_counts(self) -> dict[str, int]:
        """The documents dropped so far, ``{"rule/dataset": n}`` (non-zero ones): what the batch
        ledger records per lane and step (:func:`zephon.engine.router.lane_counts`)."""
        return {f"{r}/{d}": n for r, row in zip(self.rules, self.dropped) for d, n in zip(self.names, row) if n}

    def extra_metrics(self) -> dict[str, Any]:
        """Documents dropped as ``{"rule/dataset": n}`` (flat, so a rank's summary sums them over lanes)."""
        return {"filtered": {f"{r}/{d}": n for r, row in self.counts().items() for d, n in row.items()}}
