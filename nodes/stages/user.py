"""User code as rules: ``kind = "function"`` (``fn(text, **params) -> bool``: keep or drop),
``"transform"`` (``fn(text, **params) -> str``: the new text later rules and the tokenizer see)
and ``"stateful"`` (a class run on the lane, in lane order: :mod:`zephon.nodes.userfn`).

User functions travel by their import path and are imported once per worker process; each call
is checked (the return type) and bounded in time where it runs (:func:`~zephon.nodes.call_user`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..userfn import FilterError, call_user, resolve_function
from .rule import FilterVerdict, Record, RuleStage, rule_class

__all__ = ["StatefulRule", "UserRule"]


@rule_class("function", "transform")
class UserRule(RuleStage):
    """``function``: "package.module:function"; ``params``: its keyword arguments."""

    def _fn(self) -> Callable[..., Any]:
        fn = self.__dict__.get("_resolved")
        if fn is None:
            fn = self.__dict__["_resolved"] = resolve_function(str(self.function))
        return fn

    def __call__(self, rec: Record, count_tokens: Callable[[str], int] = len) -> FilterVerdict | None:
        where = f"filter {self.name!r} ({self.kind} {self.function!r})"
        try:
            got = call_user(where, self._fn(), self.text_of(rec), **dict(self.params))
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
            rec.text = got
            return None
        if not isinstance(got, (bool, np.bool_)):
            raise FilterError(
                f"{where} returned a {type(got).__name__}, not a bool, on {{record}}: a filter "
                "function returns True to keep the document, False to drop it"
            )
        return self.drop(bool(got))


@rule_class("stateful")
class StatefulRule(RuleStage):
    """A class keeping state across its lane's documents: run by
    :class:`~zephon.nodes.FilterCounter` on the lane, never by the workers (they keep every
    record for it and send its text along)."""

    on_lane = True

    def __call__(self, rec: Record, count_tokens: Callable[[str], int] = len) -> FilterVerdict | None:
        return None  # judged on the lane
