"""The contract of a filter stage: one rule of a recipe's ``[[filters]]``, applied to a record.

A rule is built once from the recipe (:func:`FilterRule` picks the class of its kind, one kind a
file beside this one) and called by :class:`~zephon.nodes.stages.RecordPipeline` on each record
of the datasets it applies to, in recipe order, between the read and the encoder. Its contract
is small: given a :class:`Record`, return None (keep it: a ``transform`` may have set
``record.text``) or a :class:`FilterVerdict` (drop it; the record keeps its slot and is counted
under the rule's name by :class:`~zephon.nodes.FilterCounter`). Every answer is a function of
the record and of the recipe alone, never of what a lane saw before, so the decision is the same
on every worker, rank and resume (a ``stateful`` rule is the exception, and runs on the lane).

A rule reads what it judges through ``record.sees(self.sees)``: a text dataset's text (after
any transform before it), a chat dataset's conversation as its template renders it
(``sees = "rendered"``) or its record's JSON text (``"raw"``), an image-text sample's caption
(its text segments joined by line breaks), a pretokenized document's stored ids.

    >>> rule = FilterRule("short", "length", params={"unit": "chars", "min": 5})
    >>> rule.apply(0, 0, 0, "hello world"), rule.apply(0, 1, 0, "hi")
    ('hello world', FilterVerdict(rule='short'))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ..userfn import FilterError, resolve_function

__all__ = ["SEES", "FilterRule", "FilterVerdict", "Record", "RuleStage", "rule_class", "user_stage"]

#: what a text rule of a chat dataset sees: the rendered conversation, or the record's JSON
SEES = ("rendered", "raw")


class FilterVerdict(NamedTuple):
    """A record dropped by rule ``rule`` (its name)."""

    rule: str


class Record:
    """One record on its way through the stages: where it is, what the read gave (``value``:
    a text, a conversation's JSON text, stored ids, an image-text sample), its metadata
    ``fields`` (read only for ``field`` rules), and ``text``: a transform's new text (None: the
    read text). ``view`` turns the value into what a rule sees (see the module doc)."""

    __slots__ = ("_seen", "_view", "dataset", "fields", "record", "shard", "text", "value")

    def __init__(
        self,
        dataset: int,
        shard: int,
        record: int,
        value: Any,
        fields: Mapping[str, Any] | None = None,
        view: Callable[[Any, str], Any] | None = None,
    ) -> None:
        self.dataset, self.shard, self.record, self.value, self.fields = dataset, shard, record, value, fields
        self.text: str | None = None
        self._view = view
        self._seen: dict[str, Any] = {}

    def sees(self, how: str = "rendered") -> Any:
        """The text (or stored ids) a rule judges: a transform's text if one ran, else the value
        seen ``how`` (the dataset's view, computed once per record)."""
        if self.text is not None:
            return self.text
        if self._view is None:
            return self.value
        got = self._seen.get(how)
        if got is None:
            got = self._seen[how] = self._view(self.value, how)
        return got


@dataclass
class RuleStage:
    """One rule: ``name`` (unique, counted under it), ``kind``, the datasets it applies to
    (indices; None: all), its parameters, a user ``function`` path, the ``duplicates`` lists of
    a dedup rule, the ``timeout`` of a regular expression's match, and what it ``sees``."""

    name: str
    kind: str
    datasets: tuple[int, ...] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    function: str | None = None
    duplicates: Mapping[int, frozenset[tuple[int, int]]] = field(default_factory=dict)
    timeout: float | None = None
    sees: str = "rendered"

    #: whether the rule needs a text (not stored ids) to judge
    needs_text: ClassVar[bool] = True
    #: whether the rule runs on the lane (its state in the lane's checkpoint), not on the workers
    on_lane: ClassVar[bool] = False

    def applies(self, dataset: int) -> bool:
        """Whether the rule applies to dataset ``dataset`` (an index of the recipe's datasets)."""
        return self.datasets is None or dataset in self.datasets

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __call__(self, rec: Record, count_tokens: Callable[[str], int] = len) -> FilterVerdict | None:
        """None to keep ``rec`` (maybe with a new ``rec.text``), or the verdict that drops it."""
        raise NotImplementedError(f"{type(self).__name__} does not judge records")

    def apply(
        self,
        shard: int,
        record: int,
        dataset: int,
        text: str,
        count_tokens: Callable[[str], int] = len,
        fields: Mapping[str, Any] | None = None,
    ) -> Any:
        """The text (maybe transformed) if a record with ``text`` is kept, else a :class:`FilterVerdict`."""
        rec = Record(dataset, shard, record, text, fields)
        got = self(rec, count_tokens)
        return got if got is not None else rec.sees(self.sees)

    def drop(self, keep: bool) -> FilterVerdict | None:
        """None when ``keep``, else this rule's verdict."""
        return None if keep else FilterVerdict(self.name)

    def text_of(self, rec: Record) -> str:
        """The text ``rec`` shows this rule; a rule that needs a text refuses stored ids (the
        recipe refuses such a rule before the run; this guards a rule built by hand)."""
        got = rec.sees(self.sees)
        if isinstance(got, np.ndarray):
            raise FilterError(
                f"filter {self.name!r} ({self.kind}) judges text, and {{record}} is pretokenized (stored token ids); "
                "restrict the filter with datasets = [...] to datasets with text"
            )
        return str(got)


_KINDS: dict[str, type[RuleStage]] = {}


def rule_class(*kinds: str) -> Callable[[type[RuleStage]], type[RuleStage]]:
    """Register a rule class for ``kinds`` (what :func:`FilterRule` builds for them)."""

    def register(cls: type[RuleStage]) -> type[RuleStage]:
        for k in kinds:
            _KINDS[k] = cls
        return cls

    return register


def user_stage(path: str) -> type[RuleStage]:
    """The user's own rule class named ``"package.module:Class"`` (a ``kind = "stage"`` entry):
    a :class:`RuleStage` subclass, imported by path (by every worker)."""
    cls = resolve_function(path)
    if not (isinstance(cls, type) and issubclass(cls, RuleStage)):
        raise FilterError(
            f"the stage {path!r} is not a subclass of zephon.nodes.stages.RuleStage; a stage is a class with "
            "__call__(record, count_tokens) -> None (keep) or FilterVerdict (drop)"
        )
    return cls


def FilterRule(name: str, kind: str, *args: Any, **kw: Any) -> RuleStage:  # noqa: N802 (a class-like factory)
    """The rule of kind ``kind`` (a :class:`RuleStage` subclass registered for it; for ``kind =
    "stage"``, the user's class named by ``function``), with the :class:`RuleStage` fields; an
    unknown kind is refused."""
    if kind == "stage":
        function = args[2] if len(args) > 2 else kw.get("function")
        return user_stage(str(function))(name, kind, *args, **kw)
    cls = _KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown filter kind {kind!r}; one of {', '.join(sorted(_KINDS))}")
    return cls(name, kind, *args, **kw)
