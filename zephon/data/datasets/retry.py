"""Remote storage faults: which errors are transient (a 5xx answer, a dropped connection, a
stall), retrying them with backoff inside a bounded time, and the timeouts of HTTP storage.

Why here: fsspec's HTTP file system raises aiohttp's own exceptions (not OSError) and waits up
to aiohttp's defaults (minutes) on a stalled server. Every remote operation of the text index
goes through :func:`with_retries`, so a flaky server costs a few retries and a dead one a clear
error naming the URL, within ``ZEPHON_IO_RETRY_S`` seconds.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "RangeIgnoredError",
    "bound_retries",
    "env_number",
    "io_retry_s",
    "io_timeout_s",
    "retried_io",
    "storage_failure",
    "storage_options",
    "transient",
    "with_retries",
]

T = TypeVar("T")

try:  # aiohttp comes with fsspec's HTTP backend; without it there are no aiohttp errors to catch
    import aiohttp as _aiohttp
except ImportError:  # pragma: no cover - aiohttp is installed with fsspec[http]
    _aiohttp = None  # type: ignore[assignment]

#: botocore errors (S3 through s3fs) worth retrying: connections refused, dropped or timed out
_BOTO_TRANSIENT = frozenset({"ConnectionError", "HTTPClientError", "ReadTimeoutError", "ConnectTimeoutError"})

#: HTTP statuses worth retrying: the server is overloaded or failed for the moment
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class RangeIgnoredError(Exception):
    """A server answered a byte-range request with more bytes than asked (it ignores Range)."""


def io_timeout_s() -> float:
    """Seconds one storage request may stall (no bytes) before it counts as failed:
    ``$ZEPHON_IO_TIMEOUT_S``, default 30."""
    return env_number("ZEPHON_IO_TIMEOUT_S", 30.0, "seconds")


def io_retry_s() -> float:
    """Seconds transient storage errors are retried before the read fails:
    ``$ZEPHON_IO_RETRY_S``, default 60."""
    return env_number("ZEPHON_IO_RETRY_S", 60.0, "seconds")


def env_number(name: str, default: float, unit: str = "") -> float:
    """A non-negative number from the environment variable ``name`` (``default`` when unset or
    empty); anything else is refused naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    what = f" of {unit}" if unit else ""
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"${name} must be a number{what}, got {raw!r}") from None
    if not v >= 0:
        raise ValueError(f"${name} must be >= 0{' ' + unit if unit else ''}, got {raw!r}")
    return v


def storage_options(url: str) -> dict[str, Any]:
    """fsspec options for opening ``url``: for ``http(s)://``, aiohttp timeouts that end a stalled
    request after :func:`io_timeout_s` (aiohttp's default waits 5 minutes).

    >>> storage_options("/data/a.jsonl"), sorted(storage_options("http://h/a.jsonl"))
    ({}, ['client_kwargs'])
    """
    low = url.lower()
    if low.startswith(("s3://", "s3a://")):
        # botocore waits 60 s on a stalled read and retries on its own: one bounded try per
        # request (s3fs adds a few quick ones), retried within $ZEPHON_IO_RETRY_S by with_retries
        t = io_timeout_s()
        return {"config_kwargs": {"connect_timeout": t, "read_timeout": t, "retries": {"max_attempts": 1}}}
    if _aiohttp is None or not low.startswith(("http://", "https://")):
        return {}
    t = io_timeout_s()
    return {"client_kwargs": {"timeout": _aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t)}}


def bound_retries(fs: Any) -> None:
    """Leave the retrying to :func:`with_retries` (bounded by ``$ZEPHON_IO_RETRY_S``): s3fs
    retries each request 5 times inside each of its own 5 retries, so one stalled S3 read took
    25 timeouts (minutes) before zephon saw it. Only a file system made with zephon's
    :func:`storage_options` (its timeouts) is changed."""
    if "s3" in getattr(fs, "protocol", ()) and isinstance(getattr(fs, "retries", None), int):
        fs.retries = 1


def transient(e: BaseException) -> str | None:
    """What went wrong, if ``e`` is a storage error worth retrying (a 5xx/429 answer, a dropped
    or refused connection, a truncated body, a timeout); None if it is not.

    >>> transient(ConnectionResetError(104, "reset")), transient(FileNotFoundError("x"))
    ('connection error (ConnectionResetError: [Errno 104] reset)', None)
    """
    if isinstance(e, FileNotFoundError):
        # fsspec's HTTP info() turns every failure of HEAD and GET into FileNotFoundError
        cause = e.__cause__
        return transient(cause) if cause is not None else None
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)) or type(e).__name__ == "FSTimeoutError":
        return f"no answer within {io_timeout_s():g} s (timeout; $ZEPHON_IO_TIMEOUT_S)"
    if _aiohttp is not None:
        if isinstance(e, _aiohttp.ClientResponseError):
            if e.status in _RETRY_STATUS:
                return f"HTTP {e.status} {e.message}".rstrip()
            return None
        if isinstance(e, (_aiohttp.ClientPayloadError, _aiohttp.ClientConnectionError)):
            return f"connection dropped ({type(e).__name__}: {e})"
    if isinstance(e, (ConnectionError, EOFError)):
        return f"connection error ({type(e).__name__}: {e})"
    names = {c.__name__ for c in type(e).__mro__ if c.__module__.startswith("botocore")}
    if names & _BOTO_TRANSIENT:  # S3 through s3fs: botocore's own connection and timeout errors
        timeout = "Timeout" in type(e).__name__
        return f"{'no answer within ' + format(io_timeout_s(), 'g') + ' s (timeout)' if timeout else 'connection error'} ({type(e).__name__}: {e})"
    return None


def storage_failure(e: BaseException) -> str | None:
    """What went wrong, if ``e`` is an HTTP client error that is not worth retrying (a 403, a
    redirect loop, ...); None if it is not one."""
    if _aiohttp is not None and isinstance(e, _aiohttp.ClientError):
        if isinstance(e, _aiohttp.ClientResponseError):
            return f"the server answered HTTP {e.status} {e.message}".rstrip()
        return f"{type(e).__name__}: {e}"
    return None


def with_retries(fn: Callable[[], T], fail: Callable[[str], BaseException], budget_s: float | None = None) -> T:
    """``fn()``, retried with exponential backoff (0.1 s doubling, at most 5 s) while it raises a
    :func:`transient` error and the ``budget_s`` (default :func:`io_retry_s`) lasts; then raises
    ``fail(reason)`` (reason: the last error, the number of tries and the time spent). Other
    errors propagate at once."""
    budget = io_retry_s() if budget_s is None else budget_s
    t0 = time.monotonic()
    delay = 0.1
    tries = 0
    while True:
        tries += 1
        try:
            return fn()
        except Exception as e:
            why = transient(e)
            if why is None:
                raise
            spent = time.monotonic() - t0
            if spent + delay > budget:
                raise fail(f"{why}; gave up after {tries} tries over {spent:.1f} s") from None
        time.sleep(delay)
        delay = min(delay * 2, 5.0)


def retried_io(
    fn: Callable[[], T],
    doing: str,
    err: Callable[[str, str], BaseException],
    translate: Callable[[Exception], None] | None = None,
) -> T:
    """``fn()`` on a remote file, the way every reader does it: transient faults retried within
    :func:`io_retry_s` (then ``err(what, fix)`` naming the storage failure), an HTTP client error
    that is not worth retrying raised as ``err`` at once; ``translate(e)`` first raises a reader's
    own error for the faults it knows (a server that ignores Range). Other errors propagate."""

    def fail(why: str) -> BaseException:
        return err(
            f"{doing} failed: the storage kept failing ({why})",
            "Check that the server is up and reachable; raise $ZEPHON_IO_RETRY_S (seconds of retries) or "
            "$ZEPHON_IO_TIMEOUT_S (seconds one request may stall) to wait longer.",
        )

    try:
        return with_retries(fn, fail)
    except Exception as e:
        if translate is not None:
            translate(e)
        why = storage_failure(e)
        if why is None:
            raise
        raise err(f"{doing} failed: {why}", "Check the URL and the server's permissions.") from None
