"""User functions that take too long on some records: the time bounds of the pre-run checks."""

from __future__ import annotations

import threading
import time

#: set by a test once the pre-run checks are done: :func:`hangs_when_set` then hangs
HANG = threading.Event()


def sleepy(text: str, seconds: float = 30.0, word: str = "record") -> bool:
    """A filter that sleeps ``seconds`` on texts holding ``word`` (all of a test corpus)."""
    if word in text:
        time.sleep(seconds)
    return True


def hangs_when_set(text: str, seconds: float = 6.0) -> bool:
    """A filter that passes the pre-run checks and then, once :data:`HANG` is set, sleeps
    ``seconds`` on its next call (a call that, for a run bounded by less, never returns)."""
    if HANG.is_set():
        HANG.clear()
        time.sleep(seconds)
    return True


def sleepy_transform(text: str, seconds: float = 30.0) -> str:
    """A transform that sleeps ``seconds`` on every text."""
    time.sleep(seconds)
    return text


class SleepyStateful:
    """A stateful filter that sleeps on its third call (the pre-run checks reach it)."""

    def __init__(self, seconds: float = 30.0) -> None:
        self.seconds, self.n = seconds, 0

    def __call__(self, text: str) -> bool:
        self.n += 1
        if self.n == 3:
            time.sleep(self.seconds)
        return True

    def state(self) -> dict:
        return {"n": self.n}

    def load(self, state: dict) -> None:
        self.n = int(state["n"])


class SlowToBuild(SleepyStateful):
    """A stateful filter whose constructor sleeps (run when the recipe is read)."""

    def __init__(self, seconds: float = 30.0) -> None:
        time.sleep(seconds)
        super().__init__(seconds)
