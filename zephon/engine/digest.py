"""Batch digests: what a batch ledger records of each step without any data crossing ranks."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["batch_sha256", "ledger_digest"]


def _plain(value: Any) -> Any:
    """Tuples (named ones included) and lists as plain ones: a batch's hash is over its data,
    not over the Python types that carry it."""
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def batch_sha256(batch: Any) -> str:
    """SHA-256 of a batch: per field in sorted name order its name, dtype, shape and bytes."""
    h = hashlib.sha256()

    def feed(name: str, value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value):
                feed(f"{name}.{k}" if name else str(k), value[k])
            return
        if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
            value = value.detach().cpu().numpy()
        if isinstance(value, np.ndarray):
            arr = np.ascontiguousarray(value)
            h.update(name.encode())
            h.update(str(arr.dtype.str).encode())
            h.update(repr(tuple(arr.shape)).encode())
            h.update(arr.tobytes())
        else:
            h.update(name.encode())
            h.update(repr(_plain(value)).encode())

    feed("", batch)
    return h.hexdigest()


_LEDGER_TAG = b"zephon-ledger-v1\0"


def ledger_digest(lane_digests: Sequence[str]) -> str:
    """The digest of one global batch from its lanes' digests (:func:`batch_sha256` of each
    lane's micro-batch, all lanes in lane order): SHA-256 over a tag, the lane count and the raw
    lane digests.

    Why per lane: rank r of W hashes only its own lanes, a contiguous block, so the digest of the
    global batch is computed from what each rank wrote without any data crossing ranks, and it
    is the same for every W (the lanes' micro-batches are).

    >>> lanes = [batch_sha256({"x": np.arange(3) + l}) for l in range(4)]
    >>> ledger_digest(lanes) == ledger_digest(lanes[:2] + lanes[2:])
    True
    >>> ledger_digest(lanes) == ledger_digest(lanes[::-1])
    False
    """
    h = hashlib.sha256(_LEDGER_TAG + len(lane_digests).to_bytes(4, "big"))
    for d in lane_digests:
        raw = bytes.fromhex(d)
        if len(raw) != 32:
            raise ValueError(f"a lane digest is a SHA-256 hex string (64 characters), got {d!r}")
        h.update(raw)
    return h.hexdigest()
