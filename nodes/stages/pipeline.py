"""The record pipeline: the one composition point of per-record work.

A recipe's per-record work is one list, built once (:func:`zephon.recipe.prepare`)::

    read -> rules (the [[filters]] that apply to the record's dataset, in recipe order) -> encode

:class:`RecordPipeline` is the batch function of the lane's
:class:`~zephon.engine.OrderedMapper`: for a chunk of work items it reads each record that a
rule applies to once (grouped per shard, with its metadata fields when a ``field`` rule needs
them), runs the rules (:mod:`zephon.nodes.stages.rule`: keep, drop, or a transform's new text),
and hands every kept item to its dataset's encoder together with what was read, so nothing is
read twice. The encoders are the kinds' own: :class:`~zephon.nodes.FetchTokenize` (text and
pretokenized datasets), :class:`~zephon.nodes.FetchChat` (conversations: rendered and masked),
:class:`~zephon.nodes.FetchVision` (image-text samples). A dropped record keeps its slot as a
:class:`FilteredDoc`, counted and removed by the lane's :class:`~zephon.nodes.FilterCounter`;
a record kept for a ``stateful`` rule travels as :class:`Carried` with the text that rule sees.

Why one list: each feature is one stage or one encoder, so features compose by construction
(a rule on a chat dataset sees the rendered conversation; a rule on an image-text dataset its
caption) instead of one worker function wrapping another. A user's own rule is a
:class:`RuleStage` subclass registered with :func:`~zephon.nodes.stages.rule_class`, or a
``function`` / ``transform`` / ``stateful`` entry naming an import path in the recipe.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from zephon.data.chatbounds import ChatTimeoutError
from zephon.data.datasets import BadRecord, read_fields
from zephon.engine import ProcessLocal

from ..tokenize import TokDoc
from ..userfn import FilterError, call_user
from ..worksource import WorkItem
from .field import FieldError
from .rule import FilterVerdict, Record, RuleStage

__all__ = ["Carried", "FilteredDoc", "RecordPipeline", "UnviewableError", "call_rule"]

Key = tuple[int, int, int]  # (dataset, shard, record)


class FilteredDoc(TokDoc):
    """A document a filter dropped: no tokens, ``skipped`` holds the rule's name.
    :class:`~zephon.nodes.FilterCounter` counts and drops it (it never reaches a packer)."""


class Carried(NamedTuple):
    """A kept document with the text its dataset's ``stateful`` rules see: made by the workers
    for a record's first part, unwrapped by :class:`~zephon.nodes.FilterCounter` on the lane."""

    doc: Any
    text: str


class UnviewableError(Exception):
    """A record that cannot be seen as a text (a conversation that does not parse or render):
    the rules leave it to its encoder, which reports it under the dataset's ``on_error``."""


def call_rule(rule: RuleStage, rec: Record, count_tokens: Callable[[str], int] = len) -> FilterVerdict | None:
    """``rule(rec, count_tokens)``; a user's stage (``kind = "stage"``) is called as user code is
    (bounded in time where a bound applies), its exceptions and answers checked, errors naming it
    and (through ``{record}``) the record."""
    if rule.kind != "stage":
        return rule(rec, count_tokens)
    where = f"stage {rule.name!r} ({rule.function!r})"
    try:
        got = call_user(where, rule, rec, count_tokens)
    except (FilterError, UnviewableError):
        raise
    except Exception as e:
        raise FilterError(f"{where} raised {type(e).__name__}: {e} on {{record}}; fix the stage (or drop it)") from e
    if got is not None and not isinstance(got, FilterVerdict):
        raise FilterError(
            f"{where} returned a {type(got).__name__} on {{record}}: a stage returns None to keep the record or "
            "FilterVerdict(name) to drop it"
        )
    return got


def _key(it: WorkItem) -> Key:
    return (it.dataset, it.shard, it.record)


class RecordPipeline(ProcessLocal):
    """``items -> docs``: ``rules`` (in recipe order) between the read and the encoders.

    ``encoders[d]``: the encoder of dataset ``d``, called as ``encoder(items, given)`` where
    ``given`` maps ``(dataset, shard, record)`` to what was already read (a record's text, a
    transform's new text, a conversation's JSON, a sample, or a :class:`BadRecord`); the
    encoder reads the others itself. ``views[d]``: how dataset ``d``'s value reads as text for
    the rules (``view(value, sees)``; None: the value itself). ``count_tokens``: content tokens
    of a text (``unit = "tokens"``). ``on_error[d]``: "raise" or "skip" (a ``field`` rule's
    missing field under "skip" becomes a counted skip).
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        encoders: Sequence[Callable[..., list[Any]]],
        rules: Sequence[RuleStage] = (),
        *,
        views: Sequence[Callable[[Any, str], Any] | None] | None = None,
        count_tokens: Callable[[str], int] = len,
        on_error: Sequence[str] | None = None,
    ) -> None:
        self.datasets, self.encoders, self.rules = list(datasets), list(encoders), list(rules)
        self.views = list(views or [None] * len(self.datasets))
        self.count_tokens = count_tokens
        self.on_error = list(on_error or ["raise"] * len(self.datasets))
        self._ruled = [any(r.applies(d) for r in self.rules) for d in range(len(self.datasets))]
        # one call per distinct encoder: datasets sharing an encoder object are encoded together
        firsts: dict[int, int] = {}
        self._encoder_of = [firsts.setdefault(id(e), d) for d, e in enumerate(self.encoders)]
        self._plain = not any(self._ruled) and len(set(self._encoder_of)) == 1
        ProcessLocal.__init__(self)

    # -- the rules -----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """The rules' names, in order: what :class:`~zephon.nodes.FilterCounter` counts under."""
        return [r.name for r in self.rules]

    def fields(self, dataset: int) -> tuple[str, ...]:
        """The metadata fields the ``field`` rules applying to ``dataset`` compare (read only then)."""
        return tuple(dict.fromkeys(r.params["field"] for r in self.rules if r.kind == "field" and r.applies(dataset)))

    def stateful(self, dataset: int) -> RuleStage | None:
        """The first lane-side (``stateful``) rule applying to ``dataset``, if any."""
        return next((r for r in self.rules if r.on_lane and r.applies(dataset)), None)

    def record_name(self, d: int, s: int, r: int) -> str:
        """A record in words, for messages: dataset, file and line/row."""
        where = self.datasets[d].locate(s, r)
        return f"dataset {self.datasets[d].name!r}, file {where['file']!r}, {where['locator']}"

    def judge(self, rec: Record, upto: int | None = None) -> FilterVerdict | None:
        """The verdict of the first rule (of ``[0, upto)``) that drops ``rec``, else None (a
        transform's text is left in ``rec.text``); lane-side rules are not run here."""
        for rule in self.rules[:upto]:
            if rule.on_lane or not rule.applies(rec.dataset):
                continue
            try:
                got = call_rule(rule, rec, self.count_tokens)
            except UnviewableError:
                return None
            if got is not None:
                return got
        return None

    def decide_records(self, d: int, s: int, records: Sequence[int], upto: int | None = None) -> list[Any]:
        """Records ``records`` of shard ``s`` of dataset ``d`` after the rules (``[0, upto)``): each
        one's :class:`Record` (kept), :class:`FilterVerdict` (dropped) or :class:`BadRecord` (read as
        bad, or a ``field`` rule's missing or mistyped field under ``on_error = "skip"``)."""
        ix = self.datasets[d]
        values = ix.read(s, list(records))
        names = self.fields(d)
        fields = read_fields(ix, s, list(records), names) if names else [None] * len(values)
        view = self.views[d]
        out: list[Any] = []
        for r, value, f in zip(records, values, fields):
            if isinstance(value, BadRecord):
                out.append(value)
                continue
            rec = Record(d, s, r, value, f, view)
            try:
                verdict = self.judge(rec, upto)
            except FilterError as e:
                where = ix.locate(s, r)
                if isinstance(e, FieldError) and self.on_error[d] == "skip":
                    out.append(BadRecord(ix.name, where["file"], where["locator"], f"{e.reason} (filter rule)"))
                    continue
                raise FilterError(str(e).replace("{record}", self.record_name(d, s, r))) from e.__cause__
            except ChatTimeoutError as e:  # rendering a conversation for the rules: not a bad record
                raise FilterError(
                    f"rendering the conversation the [[filters]] judge, on {self.record_name(d, s, r)}: {e}; fix the "
                    "chat template (or raise [workers] timeout_s)"
                ) from None
            out.append(rec if verdict is None else verdict)
        return out

    def decide(self, items: Sequence[WorkItem]) -> dict[Key, Any]:
        """Each distinct record's answer (:meth:`decide_records`), by ``(dataset, shard, record)``."""
        keys = sorted(dict.fromkeys(_key(it) for it in items))
        out: dict[Key, Any] = {}
        for (d, s), group in itertools.groupby(keys, key=lambda k: k[:2]):
            records = [r for _, _, r in group]
            for r, got in zip(records, self.decide_records(d, s, records)):
                out[(d, s, r)] = got
        return out

    # -- the batch function --------------------------------------------------------------------
    def __call__(self, items: list[WorkItem]) -> list[Any]:
        if self._plain:  # no rules, one encoder: nothing per item to decide or group
            return self.encoders[0](items, None)
        ruled = [it for it in items if self._ruled[it.dataset]]
        decided = self.decide(ruled) if ruled else {}
        out: list[Any] = [None] * len(items)
        groups: dict[int, list[int]] = {}  # encoder (its first dataset) -> the kept items it encodes
        for j, it in enumerate(items):
            if not isinstance(decided.get(_key(it)), FilterVerdict):
                groups.setdefault(self._encoder_of[it.dataset], []).append(j)
        for e, idx in groups.items():
            given: dict[Key, Any] = {}
            for j in idx:
                got = decided.get(_key(items[j]))
                if isinstance(got, Record):
                    given[_key(items[j])] = got.text if got.text is not None else got.value
                elif got is not None:
                    given[_key(items[j])] = got  # a BadRecord
            for j, doc in zip(idx, self.encoders[e]([items[j] for j in idx], given or None)):
                out[j] = doc
        if decided:
            self._mark(items, decided, out)
        return out

    def _mark(self, items: Sequence[WorkItem], decided: Mapping[Key, Any], out: list[Any]) -> None:
        """Dropped items become :class:`FilteredDoc`; a kept record's first part is
        :class:`Carried` with its text when a lane-side rule applies to its dataset."""
        empty = np.zeros(0, dtype=np.int32)
        for j, it in enumerate(items):
            got = decided.get(_key(it))
            if isinstance(got, FilterVerdict):
                out[j] = FilteredDoc(empty, it.dataset, it, got.rule)
            elif isinstance(got, Record) and it.part == 0 and getattr(out[j], "skipped", None) is None:
                rule = self.stateful(it.dataset)
                if rule is not None:
                    out[j] = Carried(out[j], str(got.sees(rule.sees)))

    def __repr__(self) -> str:
        encoders = ", ".join(dict.fromkeys(type(e).__name__ for e in self.encoders))
        rules = ", ".join(f"{r.name}:{r.kind}" for r in self.rules)
        return f"RecordPipeline(rules=[{rules}], encoders=[{encoders}])"
