"""Bounds on rendering a chat template: time and output size per conversation.

A chat template is user code (Jinja): nested loops can run for hours and a template can multiply
its input. Each conversation's renderings run under a :class:`RenderBudget` set on the thread
(:class:`RenderScope`); the template environment's attribute, item and call hooks check its
deadline, and the join of its output checks the size (:func:`bounded_template`). With no budget
set the hooks do nothing, so transformers' own use of the cached template is unchanged. One
rendering can also note where the template first reads each message (``ids`` / ``events``), which
is how :mod:`zephon.data.chat` finds assistant spans without rendering every prefix.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ChatTimeoutError",
    "RenderBudget",
    "RenderScope",
    "bounded_template",
    "current_budget",
    "late_message",
    "too_long_message",
]


class ChatTimeoutError(RuntimeError):
    """Rendering a conversation took longer than the renderer's ``timeout_s``: not a bad record
    (whether it happens depends on the machine), so the run stops; the message says the fix."""

    user_error = True


@dataclass
class RenderBudget:
    """What one conversation's renderings may use, and (one rendering) where each message starts."""

    deadline: float
    limit: int
    ids: dict[int, int] = field(default_factory=dict)  # id(message dict) -> its index, when tracking
    events: list[tuple[int, int]] = field(default_factory=list)  # (message, output chars so far)
    pos: int = 0


_BUDGET = threading.local()


def current_budget() -> RenderBudget | None:
    """The budget of the conversation this thread is rendering, if any."""
    return getattr(_BUDGET, "budget", None)


class RenderScope:
    """Sets a budget on the thread while one conversation renders (restoring the previous one)."""

    def __init__(self, seconds: float, limit: int) -> None:
        self.budget = RenderBudget(time.monotonic() + seconds, limit)

    def __enter__(self) -> RenderBudget:
        self.prev = current_budget()
        _BUDGET.budget = self.budget
        return self.budget

    def __exit__(self, *exc: Any) -> None:
        _BUDGET.budget = self.prev


def _check(obj: Any = None) -> None:
    """Called on each attribute, item and call of a template: the time bound, and (when tracking)
    which message the template reads at which point of its output."""
    b = current_budget()
    if b is None:
        return
    if time.monotonic() > b.deadline:
        raise ChatTimeoutError("timed out")
    if b.ids:
        k = b.ids.get(id(obj))
        if k is not None:
            b.events.append((k, b.pos))


def bounded_template(compiled: Any, too_long: type[Exception]) -> Any:
    """``compiled`` (transformers' cached template) with its environment's attribute, item and
    call hooks checking the thread's budget (no budget: as before), and its ``render`` join
    checking the output size (over it: ``too_long``, a bad record)."""
    env = compiled.environment
    if env.__dict__.get("_zephon_bounded"):
        return compiled
    getattr_, getitem_, call_, concat_ = env.getattr, env.getitem, env.call, env.concat

    def getattr_hook(obj: Any, attribute: str) -> Any:
        _check(obj)
        return getattr_(obj, attribute)

    def getitem_hook(obj: Any, argument: Any) -> Any:
        _check(obj)
        return getitem_(obj, argument)

    def call_hook(__context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check()
        return call_(__context, __obj, *args, **kwargs)

    def concat_hook(pieces: Any) -> str:
        b = current_budget()
        if b is None:
            return str(concat_(pieces))
        out, n = [], 0
        for piece in pieces:
            n += len(piece)
            if n > b.limit:
                raise too_long(too_long_message(b.limit))
            out.append(piece)
        return "".join(out)

    env.getattr, env.getitem, env.call, env.concat = getattr_hook, getitem_hook, call_hook, concat_hook
    env.__dict__["_zephon_bounded"] = True
    return compiled


def too_long_message(limit: int) -> str:
    """Why a conversation whose rendering passed ``limit`` characters is a bad record."""
    return (
        f"the chat template renders it to more than {limit} characters (1 Mi plus 64 per character of the "
        "conversation): it multiplies its input; fix the template"
    )


def late_message(seconds: float) -> str:
    """Why a conversation that did not render within ``seconds`` stops the run, and the fix."""
    return (
        f"the chat template did not finish rendering it within {seconds:g} s ([workers] timeout_s bounds each "
        "conversation): the template loops too much (nested loops over the messages?); fix the template, or "
        "raise [workers] timeout_s"
    )
