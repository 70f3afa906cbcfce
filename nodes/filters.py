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
import importlib
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from torchdata.nodes import BaseNode

from zephon.data.datasets import BadRecord
from zephon.engine import UPSTREAM, StateError, ZNode, check_state_keys, state_ints, state_node

from .tokenize import FetchTokenize, TokDoc
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
FILTER_KINDS = ("length", "regex", "dedup", "function", "transform")


class FilterError(ValueError):
    """A filter or transform failed on a record, or returned what it must not; the message names
    the rule, its function and the record."""

    user_error = True


class FilterVerdict(NamedTuple):
    """A record dropped by rule ``rule`` (its name)."""

    rule: str


class FilteredDoc(TokDoc):
    """A document a filter dropped: no tokens, ``skipped`` holds the rule's name.
    :class:`FilterCounter` counts and drops it (it never reaches a packer)."""


def resolve_function(path: str) -> Callable[..., Any]:
    """The callable named ``"package.module:function"`` (``function`` may be dotted:
    ``module:Class.method``); a clear error when it cannot be imported.

    >>> resolve_function("os.path:join")("a", "b")
    'a/b'
    """
    if not isinstance(path, str) or path.count(":") != 1:
        raise FilterError(f"a user function is named 'package.module:function', got {path!r}")
    mod, name = path.split(":")
    try:
        obj: Any = importlib.import_module(mod)
    except Exception as e:  # an import that fails for any reason is the user's to fix
        raise FilterError(
            f"cannot import module {mod!r} of the user function {path!r}: {type(e).__name__}: {e}. "
            "Install it or put its folder on PYTHONPATH"
        ) from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise FilterError(f"module {mod!r} has no {name!r} (the user function {path!r}); check the name")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FilterError(f"the user function {path!r} is a {type(obj).__name__}, not a function")
    return obj


@dataclass
class FilterRule:
    """One rule: ``name`` (unique, counted under it), ``kind`` (:data:`FILTER_KINDS`), the
    datasets it applies to (indices; None: all) and its parameters:

    * ``length``: ``unit`` ("chars" or "tokens", content tokens without BOS/EOS), ``min``, ``max``;
    * ``regex``: ``pattern`` (``re.search``), ``action`` ("include": keep only matching texts,
      "exclude": drop them);
    * ``dedup``: exact duplicates within the dataset (``duplicates``: per dataset, the set of
      global record numbers that are later copies, from :func:`duplicate_records`);
    * ``function`` / ``transform``: ``function`` ("package.module:function") called as
      ``fn(text, **params)``; it must return a bool (keep) / a str (the new text).
    """

    name: str
    kind: str
    datasets: tuple[int, ...] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    function: str | None = None
    duplicates: Mapping[int, frozenset[tuple[int, int]]] = field(default_factory=dict)

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
                fn = re.compile(self.params["pattern"]).search
            else:
                fn = len
            self.__dict__["_resolved"] = fn
        return fn

    def apply(self, shard: int, record: int, dataset: int, text: str, count_tokens: Callable[[str], int]) -> Any:
        """The text (maybe transformed) if the record is kept, else a :class:`FilterVerdict`."""
        p, k = self.params, self.kind
        if k == "length":
            n = count_tokens(text) if p.get("unit", "chars") == "tokens" else len(text)
            lo, hi = p.get("min", 0), p.get("max")
            return text if lo <= n and (hi is None or n <= hi) else FilterVerdict(self.name)
        if k == "regex":
            hit = self._fn()(text) is not None
            return text if hit == (p.get("action", "exclude") == "include") else FilterVerdict(self.name)
        if k == "dedup":
            return FilterVerdict(self.name) if (shard, record) in self.duplicates.get(dataset, ()) else text
        return self._call_user(text, shard, record)

    def _call_user(self, text: str, shard: int, record: int) -> Any:
        where = f"filter {self.name!r} ({self.kind} {self.function!r})"
        try:
            got = self._fn()(text, **dict(self.params))
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

    def decide(
        self,
        dataset: int,
        shard: int,
        record: int,
        text: str,
        upto: int | None = None,
        count_tokens: Callable[[str], int] = len,
    ) -> Any:
        """The record's final text, or the :class:`FilterVerdict` of the first rule that drops
        it (rules ``[0, upto)`` only, when given); ``count_tokens`` measures ``unit = "tokens"``."""
        for rule in self.rules[:upto]:
            if rule.applies(dataset):
                text = rule.apply(shard, record, dataset, text, count_tokens)
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

    def decide(self, items: Sequence[WorkItem]) -> dict[tuple[int, int, int], Any]:
        """Each distinct record's text after the chain (or its verdict, or its BadRecord)."""
        keys = list(dict.fromkeys((it.dataset, it.shard, it.record) for it in items))
        texts = super().fetch([WorkItem(d, s, r, 0, 0) for d, s, r in keys])
        out: dict[tuple[int, int, int], Any] = {}
        for (d, s, r), text in zip(keys, texts):
            if isinstance(text, BadRecord):
                out[(d, s, r)] = text
                continue
            try:
                out[(d, s, r)] = self.chain.decide(d, s, r, text, count_tokens=self._count_tokens)
            except FilterError as e:
                where = self.datasets[d].locate(s, r)
                rec = f"dataset {self.datasets[d].name!r}, file {where['file']!r}, {where['locator']}"
                raise FilterError(str(e).replace("{record}", rec)) from e.__cause__
        return out

    def __call__(self, items: list[WorkItem]) -> list[TokDoc]:
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
        out: list[TokDoc] = []
        got = iter(docs)
        kept = set(keep)
        empty = np.zeros(0, dtype=np.int32)
        for i, it in enumerate(items):
            if i in kept:
                out.append(next(got))
            else:
                out.append(FilteredDoc(empty, it.dataset, it, decided[(it.dataset, it.shard, it.record)].rule))
        return out

    def __repr__(self) -> str:
        return f"FilteredTokenize({self.chain!r}, {super().__repr__()})"


class FilterCounter(ZNode[Any]):
    """Drop :class:`FilteredDoc` s, counting them per (rule, dataset) once per record (at its
    first part). State: the counts and the upstream's state at the same point (no replay)."""

    node_type = "filter_counter"

    def __init__(self, source: BaseNode, *, rules: Sequence[str], dataset_names: Sequence[str]) -> None:
        super().__init__()
        self.source, self.rules, self.names = source, list(rules), list(dataset_names)
        self.dropped = [[0] * len(self.names) for _ in self.rules]

    def _repr_args(self):
        yield f"rules={self.rules}"
        yield f"dropped={sum(map(sum, self.dropped))}"

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.dropped = [[0] * len(self.names) for _ in self.rules]
        if initial_state is None:
            self.source.reset(None)
            return
        check_state_keys(self, initial_state, (UPSTREAM, "dropped"))
        rows = initial_state["dropped"]
        if not isinstance(rows, list) or len(rows) != len(self.rules):
            raise StateError(f"{self!r}: state field 'dropped' must hold one row per filter ({len(self.rules)})")
        dropped = [state_ints(self, "dropped", row, len(self.names)) for row in rows]
        self.source.reset(state_node(self, UPSTREAM, initial_state[UPSTREAM]))
        self.dropped = dropped

    def get_state(self) -> dict[str, Any]:
        return self._tagged({UPSTREAM: self.source.state_dict(), "dropped": [list(r) for r in self.dropped]})

    def next(self) -> Any:
        while True:
            doc = next(self.source)
            if not isinstance(doc, FilteredDoc):
                return doc
            if getattr(doc.item, "part", 0) == 0:
                self.dropped[self.rules.index(str(doc.skipped))][doc.dataset] += 1

    def counts(self) -> dict[str, dict[str, int]]:
        """Documents dropped, by filter and dataset."""
        return {r: dict(zip(self.names, row)) for r, row in zip(self.rules, self.dropped)}

    def extra_metrics(self) -> dict[str, Any]:
        """Documents dropped as ``{"rule/dataset": n}`` (flat, so a rank's summary sums them over lanes)."""
        return {"filtered": {f"{r}/{d}": n for r, row in self.counts().items() for d, n in row.items()}}
