"""Lane-keyed checkpoints: JSON only, resharded by key, safe to load.

A rank's state holds one entry per owned lane (``"lane_00007"``) plus entries that are equal on
every rank (format version, lane count, recipe fingerprint, step). The states of any W ranks
merge into one dict that any other W can load, because each rank simply takes its lanes' keys.
For DCP, every entry is stored as JSON ``bytes`` (one value per lane: nothing nested for DCP to
flatten). Parsing is bounded in size and never executes code (no pickle anywhere).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .node import StateError

__all__ = [
    "FORMAT_VERSION",
    "MAX_ENTRY_BYTES",
    "SHARED_KEY",
    "check_version",
    "decode_state",
    "encode_state",
    "is_lane_key",
    "lane_key",
    "load_state",
    "merge_states",
    "migrate",
    "parse_json",
    "save_state",
]

FORMAT_VERSION = 2
SHARED_KEY = "zephon"
MAX_ENTRY_BYTES = 1 << 20  # a lane state is ~1 KB; anything near this is corrupt or hostile


def lane_key(lane: int) -> str:
    """The checkpoint key of a lane (zero-padded so keys sort in lane order).

    >>> lane_key(7)
    'lane_00007'
    """
    return f"lane_{lane:05d}"


def is_lane_key(key: str) -> bool:
    """Whether a checkpoint key is a lane's entry (as opposed to a shared one).

    >>> is_lane_key("lane_00007"), is_lane_key("zephon")
    (True, False)
    """
    return key.startswith("lane_") and key[5:].isdigit()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed in a zephon state")


def parse_json(data: bytes | str, what: str, max_bytes: int = MAX_ENTRY_BYTES) -> Any:
    """Parse one JSON document with a size bound; a clear StateError on anything else.

    Why: checkpoint bytes come from storage that may be corrupt or hostile; this never builds
    anything but JSON values and refuses oversized input before parsing.

    >>> parse_json(b'{"cursor": 3}', "lane_00000")
    {'cursor': 3}
    >>> parse_json(b'{"cursor": NaN}', "lane_00000")
    Traceback (most recent call last):
    ...
    zephon.engine.node.StateError: lane_00000: corrupt or truncated JSON (non-finite number NaN is not allowed ...
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        if len(raw) > max_bytes:
            raise StateError(
                f"{what}: {len(raw)} bytes is larger than any zephon state ({max_bytes}); refusing to parse it"
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise StateError(
                f"{what}: not UTF-8 JSON ({e}); the checkpoint is corrupt or not a zephon checkpoint"
            ) from None
    elif isinstance(data, str):
        text = data
        if len(text) > max_bytes:
            raise StateError(f"{what}: larger than any zephon state; refusing to parse it")
    else:
        raise StateError(f"{what}: expected JSON bytes, got {type(data).__name__}")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise StateError(f"{what}: corrupt or truncated JSON ({e}); restore from an earlier checkpoint") from None


def merge_states(states: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge rank states: lane entries are unioned, shared entries must agree.

    >>> rank0 = {"format_version": 2, "lane_00000": {"c": 1}, "lane_00001": {"c": 4}}
    >>> rank1 = {"format_version": 2, "lane_00002": {"c": 2}, "lane_00003": {"c": 0}}
    >>> sorted(merge_states([rank0, rank1]))
    ['format_version', 'lane_00000', 'lane_00001', 'lane_00002', 'lane_00003']
    """
    merged: dict[str, Any] = {}
    for rank, st in enumerate(states):
        for k, v in st.items():
            if k in merged and merged[k] != v:
                if is_lane_key(k):
                    raise StateError(
                        f"{k} appears in two rank states with different contents; these states are from different runs or steps"
                    )
                raise StateError(
                    f"shared entry {k!r} differs between rank states (rank {rank}: {v!r} vs {merged[k]!r}); "
                    "these states are from different runs or steps"
                )
            merged[k] = v
    return merged


def encode_state(state: Mapping[str, Any]) -> dict[str, bytes]:
    """Router state -> ``{"zephon": meta JSON bytes, "lane_00007": lane JSON bytes, ...}`` for DCP.

    >>> enc = encode_state({"format_version": FORMAT_VERSION, "lane_00007": {"cursor": 3}})
    >>> enc["lane_00007"]
    b'{"cursor":3}'
    >>> decode_state(enc)["lane_00007"]
    {'cursor': 3}
    """
    meta = {k: v for k, v in state.items() if not is_lane_key(k)}
    out = {SHARED_KEY: json.dumps(meta, sort_keys=True, allow_nan=False).encode("utf-8")}
    for k, v in state.items():
        if is_lane_key(k):
            out[k] = json.dumps(v, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return out


def decode_state(encoded: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`encode_state`, validating every entry (an older format stays as it is:
    the pipeline that loads it migrates its lanes, see :func:`migrate`)."""
    if SHARED_KEY not in encoded:
        raise StateError(f"checkpoint has no {SHARED_KEY!r} entry: it was not written by zephon, or is truncated")
    meta = parse_json(encoded[SHARED_KEY], f"checkpoint entry {SHARED_KEY!r}")
    if not isinstance(meta, dict):
        raise StateError(f"checkpoint entry {SHARED_KEY!r} must be a JSON object")
    state: dict[str, Any] = dict(meta)
    for k, v in encoded.items():
        if k == SHARED_KEY:
            continue
        if not is_lane_key(k):
            raise StateError(f"unexpected checkpoint entry {k!r}; expected {SHARED_KEY!r} and lane_NNNNN entries")
        lane_state = parse_json(v, f"checkpoint entry {k!r}")
        if not isinstance(lane_state, dict):
            raise StateError(f"checkpoint entry {k!r} must be a JSON object")
        state[k] = lane_state
    check_version(state)
    return state


# Format history:
#   1: rank-level entries without "shared"; text lanes had no skip_counter node.
#   2: "shared" holds derived, rank-independent values (token estimates, data and tokenizer
#      fingerprints); text lanes count skipped records (skip_counter between mapper and pack).
# What changed inside a lane's state belongs to the pipeline that builds the lane: its lane
# set (zephon.engine.LaneSet.lane_migrations) passes its migrations to migrate() explicitly;
# nothing is registered globally.


def check_version(state: Mapping[str, Any]) -> int:
    """The state's ``format_version``, refusing a missing, corrupt or newer one.

    >>> check_version({"format_version": 99})
    Traceback (most recent call last):
    ...
    zephon.engine.node.StateError: checkpoint format_version 99 is newer than this zephon supports (2); upgrade zephon to load it
    """
    version = state.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise StateError(
            f"checkpoint has no valid format_version ({version!r}); it is corrupt or not a zephon checkpoint"
        )
    if version > FORMAT_VERSION:
        raise StateError(
            f"checkpoint format_version {version} is newer than this zephon supports ({FORMAT_VERSION}); "
            "upgrade zephon to load it"
        )
    if version < 1:
        raise StateError(f"no migration from checkpoint format_version {version} to {FORMAT_VERSION}")
    return version


def migrate(
    state: Mapping[str, Any], lane_migrations: Mapping[int, Callable[[dict[str, Any]], dict[str, Any]]] | None = None
) -> dict[str, Any]:
    """Bring a state written by an older format version to the current one, explicitly:
    the envelope here, each lane's entry with ``lane_migrations[version]`` (the lane set's own,
    see :class:`zephon.engine.LaneSet`). A current state is returned as it is.

    >>> old = {"format_version": 1, "lane_00000": {"cursor": 1}}
    >>> new = migrate(old, {1: lambda lane: dict(lane, skipped=0)})
    >>> new["format_version"] == FORMAT_VERSION, new["shared"], new["lane_00000"]
    (True, {}, {'cursor': 1, 'skipped': 0})
    """
    version = check_version(state)
    if version == FORMAT_VERSION:
        return dict(state)
    out = copy.deepcopy(dict(state))
    while version < FORMAT_VERSION:
        if version == 1:
            out.setdefault("shared", {})
        fn = (lane_migrations or {}).get(version)
        if fn is not None:
            for k in [k for k in out if is_lane_key(k)]:
                out[k] = fn(out[k])
        version += 1
        out["format_version"] = version
    return out


def save_state(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Write a (merged) state as one JSON file, atomically.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "state.json")
    >>> save_state(path, {"format_version": FORMAT_VERSION, "lane_00000": {"cursor": 1}})
    >>> load_state(path)["lane_00000"]
    {'cursor': 1}
    """
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f, sort_keys=True, indent=1, allow_nan=False)
    os.replace(tmp, path)


def load_state(path: str | os.PathLike) -> dict[str, Any]:
    """Read a state written by :func:`save_state`."""
    limit = 256 * MAX_ENTRY_BYTES
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    state = parse_json(raw, os.fspath(path), max_bytes=limit)
    if not isinstance(state, dict):
        raise StateError(f"{os.fspath(path)}: a zephon state is a JSON object")
    check_version(state)
    return state
