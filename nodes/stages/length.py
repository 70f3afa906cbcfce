"""``kind = "length"``: keep a record whose length lies within ``[min, max]``, in characters of
the text it sees or in content tokens (no BOS/EOS; a pretokenized record's stored ids count)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .rule import FilterVerdict, Record, RuleStage, rule_class

__all__ = ["LengthRule"]


@rule_class("length")
class LengthRule(RuleStage):
    """``params``: ``unit`` ("chars" or "tokens"), ``min`` (default 0), ``max`` (optional)."""

    @property
    def needs_text(self) -> bool:  # type: ignore[override]
        return self.params.get("unit", "chars") != "tokens"

    def __call__(self, rec: Record, count_tokens: Callable[[str], int] = len) -> FilterVerdict | None:
        p = self.params
        if p.get("unit", "chars") == "tokens":
            seen = rec.sees(self.sees)
            n = len(seen) if isinstance(seen, np.ndarray) else count_tokens(seen)
        else:
            n = len(self.text_of(rec))
        lo, hi = p.get("min", 0), p.get("max")
        return self.drop(lo <= n and (hi is None or n <= hi))
