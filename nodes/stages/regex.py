"""``kind = "regex"``: keep (``action = "include"``) or drop (``"exclude"``) texts a pattern
matches (``re.search`` syntax), matched by the ``regex`` engine with a time bound per text so a
catastrophically backtracking pattern stops the run naming the record instead of hanging it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import regex

from ..userfn import FilterError
from .rule import FilterVerdict, Record, RuleStage, rule_class

__all__ = ["RegexRule"]


@rule_class("regex")
class RegexRule(RuleStage):
    """``params``: ``pattern``, ``action``; ``timeout``: seconds per match (None: unbounded)."""

    def _search(self) -> Any:
        fn = self.__dict__.get("_search_fn")
        if fn is None:
            fn = self.__dict__["_search_fn"] = regex.compile(self.params["pattern"]).search
        return fn

    def __call__(self, rec: Record, count_tokens: Callable[[str], int] = len) -> FilterVerdict | None:
        p = self.params
        try:
            hit = self._search()(self.text_of(rec), timeout=self.timeout) is not None
        except TimeoutError:
            raise FilterError(
                f"filter {self.name!r} (regex {p['pattern']!r}) did not finish matching within {self.timeout:g} s "
                "on {record}: the pattern backtracks catastrophically on this text (nested repetition such as "
                "(a+)+); rewrite it without nested or overlapping repetition, or raise [workers] timeout_s"
            ) from None
        return self.drop(hit == (p.get("action", "exclude") == "include"))
