"""``kind = "field"``: a record's metadata field (a JSONL key, a Parquet/Arrow column) against
``min`` / ``max`` (numbers) or ``in`` / ``not_in`` (lists of values). A missing or null field,
NaN, or a value of the wrong type raises :class:`FieldError` naming the record (or is a counted
skip under the dataset's ``on_error = "skip"``): never a silent pass."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..userfn import FilterError
from .rule import FilterVerdict, Record, RuleStage, rule_class

__all__ = ["FieldError", "FieldRule", "field_in"]

_NUMBER = (int, float, np.integer, np.floating)


class FieldError(FilterError):
    """A ``field`` rule met a record without the field, or with a value of the wrong type: an
    error naming the record, or a counted skip under the dataset's ``on_error = "skip"``
    (``reason``: the skip's reason, short and stable)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


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


@rule_class("field")
class FieldRule(RuleStage):
    """``params``: ``field`` and ``min`` / ``max`` or ``in`` / ``not_in``."""

    needs_text = False

    def __call__(self, rec: Record, count_tokens: Callable[[str], int] = len) -> FilterVerdict | None:
        return self.drop(self.keeps(rec.fields or {}))

    def keeps(self, fields: Mapping[str, Any]) -> bool:
        """Whether a record with metadata ``fields`` is kept (raises :class:`FieldError`)."""
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
