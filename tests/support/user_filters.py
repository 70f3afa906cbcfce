"""User functions for the [[filters]] tests: importable as ``user_filters:NAME`` (tests/support is on sys.path)."""

from __future__ import annotations

import itertools

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
