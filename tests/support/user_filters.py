"""User functions for the [[filters]] tests: importable as ``user_filters:NAME`` (tests/support is on sys.path)."""

from __future__ import annotations

import itertools

from zephon.nodes.stages import FilterVerdict, Record, RuleStage

_calls = itertools.count()


def has_word(text: str, word: str = "the") -> bool:
    """Keep documents that contain ``word``."""
    return word in text.split()


def upper(text: str) -> str:
    """A transform: the text in capitals."""
    return text.upper()


def explode(text: str) -> bool:
    """A filter that raises on some records."""
    if "e" in text:
        raise KeyError("no e allowed")
    return True


def wrong_type(text: str) -> int:
    """Returns a count, not a bool."""
    return len(text)


def flaky(text: str) -> bool:
    """Not deterministic: answers alternate between calls."""
    return next(_calls) % 2 == 0


class AtMostPerSource:
    """Stateful: keep at most ``n`` documents per source (the text's first word) in a lane."""

    def __init__(self, n: int = 2) -> None:
        self.n, self.seen = n, {}

    def __call__(self, text: str) -> bool:
        src = (text.split() or [""])[0]
        self.seen[src] = self.seen.get(src, 0) + 1
        return self.seen[src] <= self.n

    def state(self) -> dict:
        return {"seen": dict(self.seen)}

    def load(self, state: dict) -> None:
        self.seen = dict(state["seen"])


class NearDuplicates:
    """Stateful: drop a text whose first ``prefix`` characters an earlier text of the lane had
    (at most ``cap`` prefixes remembered, oldest forgotten first)."""

    def __init__(self, prefix: int = 24, cap: int = 1000) -> None:
        self.prefix, self.cap, self.seen = prefix, cap, []

    def __call__(self, text: str) -> bool:
        key = text[: self.prefix]
        if key in self.seen:
            return False
        self.seen = (self.seen + [key])[-self.cap :]
        return True

    def state(self) -> dict:
        return {"seen": list(self.seen)}

    def load(self, state: dict) -> None:
        self.seen = list(state["seen"])


class Forgetful(AtMostPerSource):
    """Stateful, but its state() leaves out what its answers depend on."""

    def state(self) -> dict:
        return {"seen": {}}


class NotJson(AtMostPerSource):
    """Stateful, but its state is a set (not JSON)."""

    def state(self) -> dict:
        return {"seen": set(self.seen)}


class NoLoad:
    """A stateful class without load()."""

    def __init__(self) -> None:
        pass

    def __call__(self, text: str) -> bool:
        return True

    def state(self) -> dict:
        return {}


class Counts(AtMostPerSource):
    """Stateful, but returns a count, not a bool."""

    def __call__(self, text: str) -> bool:
        super().__call__(text)
        return len(self.seen)  # type: ignore[return-value]


class ShortFirstLine(RuleStage):
    """A user's own stage (``kind = "stage"``): drop a record whose first line is shorter than
    ``params["min"]`` characters, reading what the rule sees and the record's dataset."""

    def __call__(self, rec: Record, count_tokens=len) -> FilterVerdict | None:
        text = self.text_of(rec)
        return self.drop(len(text.split("\n", 1)[0]) >= self.params.get("min", 0))


class BrokenStage(RuleStage):
    """A user's stage that fails: raises on records with an "e", returns a str on others."""

    def __call__(self, rec: Record, count_tokens=len):
        if "e" in self.text_of(rec)[:20]:
            raise KeyError("no e allowed")
        return "keep"
