"""User functions of ``[[filters]]``: imported by path, called with checks, stateful ones kept.

A stateless function (``kind = "function"`` / ``"transform"``) is a plain callable, run by the
workers. A stateful one (``kind = "stateful"``) keeps state across the documents of its lane
("drop near-duplicates seen so far in this lane", "at most N documents per source"), so it runs
on the lane's own thread, in the lane's order, and its state is part of the lane's checkpoint.
It is a class with this small protocol::

    class KeepFirstPerSource:
        def __init__(self, **params): ...       # the entry's params
        def __call__(self, text: str) -> bool: ...   # True keeps the document, False drops it
        def state(self) -> dict: ...            # JSON-able: everything __call__'s answers depend on
        def load(self, state: dict) -> None: ...  # continue exactly from a state() of another instance

Why this is elastic and resumable: a lane's documents and their order do not depend on the
world size, and the state travels in the lane's checkpoint (as JSON, deep-copied when taken), so
a lane restored on any rank continues with the same state. Keep the state bounded (a capped
set, counters): it is copied at every checkpoint of the lane's packer.

    >>> try:
    ...     StatefulFunction("f", "collections:Counter", {})
    ... except FilterError as e:
    ...     print(str(e).split(": a stateful")[0])
    the stateful filter 'f' ('collections:Counter') has no method __call__()
"""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from zephon.engine.bounded import BoundedCaller, CallTimeoutError

__all__ = ["STATEFUL_METHODS", "FilterError", "StatefulFunction", "call_bound", "call_user", "resolve_function"]

#: the methods a stateful filter's class has besides ``__init__(**params)``
STATEFUL_METHODS = ("__call__", "state", "load")


class FilterError(ValueError):
    """A filter or transform failed on a record, or returned what it must not; the message names
    the rule, its function and the record."""

    user_error = True


_BOUND = threading.local()


@contextmanager
def call_bound(seconds: float | None) -> Iterator[None]:
    """Within it, each user-function call made on this thread (:func:`call_user`) must return
    within ``seconds``: the pre-run checks and token estimation run user code in the main
    process, where no worker timeout applies, so a slow or hung function is refused there."""
    prev = getattr(_BOUND, "bound", None)
    caller = BoundedCaller()
    _BOUND.bound = (seconds, caller) if seconds is not None else None
    try:
        yield
    finally:
        _BOUND.bound = prev
        caller.close()


def call_user(where: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)``, under the thread's :func:`call_bound` if any: past it, a
    :class:`FilterError` naming ``where`` (its message holds ``{record}`` for the caller)."""
    bound = getattr(_BOUND, "bound", None)
    if bound is None:
        return fn(*args, **kw)
    seconds, caller = bound
    try:
        return caller.call(seconds, fn, *args, **kw)
    except CallTimeoutError:
        raise FilterError(
            f"{where} did not return within {seconds:g} s on {{record}} (the pre-run checks bound each call of "
            "user code by [workers] timeout_s); make it faster, or raise [workers] timeout_s"
        ) from None


def resolve_function(path: str) -> Callable[..., Any]:
    """The callable named ``"package.module:function"`` (``function`` may be dotted:
    ``module:Class.method``); a clear error when it cannot be imported.

    >>> resolve_function("os.path:join")("a", "b")
    'a/b'
    """
    if not isinstance(path, str) or path.count(":") != 1:
        raise FilterError(f"a user function is named 'package.module:function', got {path!r}")
    mod, name = path.split(":")
    try:
        obj: Any = importlib.import_module(mod)
    except Exception as e:  # an import that fails for any reason is the user's to fix
        raise FilterError(
            f"cannot import module {mod!r} of the user function {path!r}: {type(e).__name__}: {e}. "
            "Install it or put its folder on PYTHONPATH"
        ) from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise FilterError(f"module {mod!r} has no {name!r} (the user function {path!r}); check the name")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FilterError(f"the user function {path!r} is a {type(obj).__name__}, not a function")
    return obj


class StatefulFunction:
    """One instance of a stateful filter's class, its calls and state checked; errors name the
    rule, the class and (through ``{record}``, filled in by the caller) the record."""

    def __init__(self, rule: str, path: str, params: Mapping[str, Any]) -> None:
        self.rule, self.path = rule, path
        cls = resolve_function(path)
        self.where = f"stateful filter {rule!r} ({path!r})"
        missing = [
            m for m in STATEFUL_METHODS if not any(callable(vars(k).get(m)) for k in getattr(cls, "__mro__", ())[:-1])
        ]
        if not isinstance(cls, type) or missing:
            what = f"has no method {missing[0]}()" if isinstance(cls, type) else "is not a class"
            raise FilterError(
                f"the {self.where} {what}: a stateful filter is a "
                "class with __init__(**params), __call__(text) -> bool, state() -> dict and load(state)"
            )
        try:
            self.obj = call_user(self.where, cls, **dict(params))
        except FilterError as e:
            raise FilterError(str(e).replace(" on {record}", f" when built as {path}(**params)")) from None
        except Exception as e:
            raise FilterError(f"{self.where}: {path}(**params) raised {type(e).__name__}: {e}; check params") from e

    def __call__(self, text: str) -> bool:
        """Keep (True) or drop (False) ``text``; the message of an error holds ``{record}``."""
        try:
            got = call_user(self.where, self.obj, text)
        except FilterError:
            raise
        except Exception as e:
            raise FilterError(
                f"{self.where} raised {type(e).__name__}: {e} on {{record}}; fix the class (or drop the rule)"
            ) from e
        if not isinstance(got, (bool, np.bool_)):
            raise FilterError(
                f"{self.where} returned a {type(got).__name__}, not a bool, on {{record}}: a stateful filter returns "
                "True to keep the document, False to drop it"
            )
        return bool(got)

    def state(self) -> dict[str, Any]:
        """A deep copy of the instance's state (through JSON: what a checkpoint holds)."""
        try:
            st = call_user(self.where, self.obj.state)
            if not isinstance(st, dict):
                raise TypeError(f"state() returned a {type(st).__name__}, not a dict")
            return json.loads(json.dumps(st, sort_keys=True))
        except FilterError:
            raise
        except (TypeError, ValueError) as e:
            raise FilterError(
                f"{self.where}: its state is not JSON ({e}); state() must return a dict of plain values (lists, "
                "numbers, strings), since it goes into the lane's checkpoint"
            ) from None

    def load(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state` of any instance with the same params)."""
        try:
            call_user(self.where, self.obj.load, json.loads(json.dumps(state)))
        except FilterError:
            raise
        except Exception as e:
            raise FilterError(f"{self.where}: load(state) raised {type(e).__name__}: {e}") from e

    def __repr__(self) -> str:
        return f"StatefulFunction({self.rule!r}, {self.path!r})"
