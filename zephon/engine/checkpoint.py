"""Lane-keyed checkpoints: JSON only, resharded by key, checked before anything is restored.

A rank's state holds one entry per owned lane (``"lane_00007"``) plus entries that are equal on
every rank (:data:`STATE_KEYS`: format version, lane count, seed, recipe fingerprint, step, the
pipeline's shared values and their digest). The states of any W ranks merge into one dict that
any other W can load, because each rank simply takes its lanes' keys. For DCP, every entry is
stored as JSON ``bytes`` (one value per lane: nothing nested for DCP to flatten).

Since format 3 every lane entry says which lane it is and at which step it was saved, and
carries a SHA-256 digest of its canonical JSON bound to the run (lane, step, lane count, seed,
fingerprint); the shared entries carry one digest too (:func:`seal_state`). :func:`verify_state`
refuses an edited, corrupt, swapped, misplaced or foreign entry, naming the lane and the field,
before any node is reset. A digest catches corruption and mix-ups, not a deliberate forgery: who
edits a state and recomputes the digest is not stopped by it (each node still range-checks its
own values on restore). Parsing is bounded in size and never executes code (no pickle anywhere).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .durable import write_atomic
from .node import StateError

__all__ = [
    "FORMAT_VERSION",
    "LANE_ENTRY_KEYS",
    "MAX_ENTRY_BYTES",
    "MAX_SHARED_BYTES",
    "SHARED_KEY",
    "STATE_KEYS",
    "check_version",
    "decode_state",
    "encode_state",
    "is_lane_key",
    "lane_key",
    "lane_state",
    "load_state",
    "merge_states",
    "migrate",
    "parse_json",
    "save_state",
    "seal_state",
    "verify_state",
]

FORMAT_VERSION = 3
SHARED_KEY = "zephon"
#: the entries of a state besides its lane entries (equal on every rank); anything else is refused.
#: A new shared entry is added here, in one line: the shared digest covers every one of them, and
#: a state written before it existed still verifies (only the entries below are required).
STATE_KEYS = ("type", "version", "format_version", "lanes", "seed", "fingerprint", "step", "shared", "digest")
#: the entries every format-3 state has
_REQUIRED_KEYS = ("type", "version", "format_version", "lanes", "seed", "fingerprint", "step", "shared", "digest")
#: the keys of one lane's entry (format 3): its identity, the step it was saved at, the lane
#: pipeline's state, and the digest binding them to the run
LANE_ENTRY_KEYS = ("lane", "step", "state", "digest")
MAX_ENTRY_BYTES = 64 << 10  # one lane's entry is ~1 KB (skip counts included); anything near this is corrupt
MAX_SHARED_BYTES = 1 << 20  # the shared entries: token estimates and fingerprints per dataset
_RUN_KEYS = ("lanes", "seed", "fingerprint")  # what a lane's digest binds besides its lane and step


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


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _lane_digest(lane: int, step: Any, body: Any, run: Mapping[str, Any]) -> str:
    bound = {"lane": lane, "step": step, "state": body, **{k: run.get(k) for k in _RUN_KEYS}}
    return hashlib.sha256(b"zephon.lane\x00" + _canonical(bound)).hexdigest()


def _shared_digest(state: Mapping[str, Any]) -> str:
    meta = {k: v for k, v in state.items() if not is_lane_key(k) and k != "digest"}
    return hashlib.sha256(b"zephon.shared\x00" + _canonical(meta)).hexdigest()


def seal_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A router state whose lane entries are the lanes' pipeline states -> the checkpoint form:
    every lane entry wrapped as ``{"lane", "step", "state", "digest"}`` and the shared entries
    given their ``digest`` (see :func:`verify_state`).

    >>> st = seal_state({"type": "router", "version": 1, "format_version": FORMAT_VERSION, "lanes": 2,
    ...                  "seed": 0, "fingerprint": "f", "step": 3, "shared": {}, "lane_00001": {"cursor": 7}})
    >>> sorted(st["lane_00001"]), st["lane_00001"]["state"], len(st["digest"])
    (['digest', 'lane', 'state', 'step'], {'cursor': 7}, 64)
    >>> verify_state(st)   # silent: consistent
    """
    out: dict[str, Any] = {k: v for k, v in state.items() if not is_lane_key(k) and k != "digest"}
    for k, body in state.items():
        if is_lane_key(k):
            lane = int(k[5:])
            out[k] = {"lane": lane, "step": state.get("step"), "state": body, "digest": ""}
            out[k]["digest"] = _lane_digest(lane, state.get("step"), body, state)
    out["digest"] = _shared_digest(out)
    return out


def lane_state(state: Mapping[str, Any], lane: int) -> dict[str, Any]:
    """The pipeline state of ``lane`` inside a (format 3) checkpoint, unwrapped from its entry.

    >>> st = seal_state({"format_version": FORMAT_VERSION, "lanes": 1, "seed": 0, "fingerprint": "",
    ...                  "step": 0, "shared": {}, "lane_00000": {"cursor": 2}})
    >>> lane_state(st, 0)
    {'cursor': 2}
    """
    key = lane_key(lane)
    entry = state.get(key)
    if not isinstance(entry, dict) or not isinstance(entry.get("state"), dict):
        raise StateError(f"{key}: no lane entry with a 'state' object in this checkpoint")
    return entry["state"]


def _meta_int(state: Mapping[str, Any], key: str, lo: int) -> int:
    v = state.get(key)
    if type(v) is not int or not lo <= v < 2**63:
        raise StateError(f"checkpoint entry {key!r} must be an integer >= {lo}, got {v!r}; it is corrupt or edited")
    return v


def verify_state(state: Mapping[str, Any]) -> None:
    """Refuse a (format 3) state that is not internally consistent, naming the entry and the field:
    an unknown entry, a lane key that is malformed or beyond the lane count, a lane entry that
    holds another lane's state, was saved at another step, or whose digest does not match its
    content (edited, corrupt, or from another run), and shared entries whose digest does not
    match. Pure and cheap (a SHA-256 over each entry); run on every restore before any node is
    reset. The run's own settings (lane count, seed, fingerprint) are compared by the router.

    >>> st = seal_state({"type": "router", "version": 1, "format_version": FORMAT_VERSION, "lanes": 2,
    ...                  "seed": 0, "fingerprint": "f", "step": 3, "shared": {}, "lane_00000": {"c": 1},
    ...                  "lane_00001": {"c": 2}})
    >>> st["lane_00000"], st["lane_00001"] = st["lane_00001"], st["lane_00000"]
    >>> verify_state(st)
    Traceback (most recent call last):
    ...
    zephon.engine.node.StateError: checkpoint entry lane_00000 holds the state of lane 1 (field 'lane'): entries were swapped ...
    """
    if not isinstance(state, Mapping):
        raise StateError(f"a zephon state is a JSON object, got {type(state).__name__}")
    for k in state:
        if not isinstance(k, str) or (not is_lane_key(k) and k not in STATE_KEYS):
            raise StateError(
                f"checkpoint has an unknown entry {k!r}; a zephon state holds {', '.join(STATE_KEYS)} and "
                "lane_NNNNN entries. It was edited, or written by something else"
            )
    missing = [k for k in _REQUIRED_KEYS if k not in state]
    if missing:
        raise StateError(f"checkpoint has no {missing[0]!r} entry; it is truncated or not a zephon checkpoint")
    lanes = _meta_int(state, "lanes", 1)
    step = _meta_int(state, "step", 0)
    _meta_int(state, "seed", 0)
    if not isinstance(state.get("shared"), dict):
        raise StateError(f"checkpoint entry 'shared' must be a JSON object, got {type(state['shared']).__name__}")
    if state.get("digest") != _shared_digest(state):
        raise StateError(
            "checkpoint's shared entries do not match their digest (field 'digest'): the step, seed, "
            "fingerprint, lane count or shared values were edited or corrupted, or come from another "
            "checkpoint; restore from an unmodified checkpoint"
        )
    for k, entry in state.items():
        if not is_lane_key(k):
            continue
        lane = int(k[5:])
        if k != lane_key(lane):
            raise StateError(f"checkpoint entry {k!r} is not a lane key (lane_NNNNN, 5 digits); it was edited")
        if lane >= lanes:
            raise StateError(
                f"checkpoint entry {k} is beyond the checkpoint's lane count (lanes = {lanes}, lanes 0..{lanes - 1}); "
                "it was added by hand or comes from another run"
            )
        if not isinstance(entry, dict) or sorted(entry) != sorted(LANE_ENTRY_KEYS):
            got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise StateError(
                f"checkpoint entry {k} must hold exactly {', '.join(LANE_ENTRY_KEYS)}, got {got}; "
                "it is truncated, edited, or from another format"
            )
        if entry["lane"] != lane or type(entry["lane"]) is not int:
            raise StateError(
                f"checkpoint entry {k} holds the state of lane {entry['lane']!r} (field 'lane'): entries were "
                "swapped or renamed; restore from an unmodified checkpoint"
            )
        if entry["step"] != step or type(entry["step"]) is not int:
            raise StateError(
                f"checkpoint entry {k} was saved at step {entry['step']!r} (field 'step') but the checkpoint is at "
                f"step {step}: entries of different checkpoints were mixed"
            )
        if not isinstance(entry["state"], dict):
            raise StateError(f"checkpoint entry {k}: field 'state' must be a JSON object")
        if entry["digest"] != _lane_digest(lane, step, entry["state"], state):
            raise StateError(
                f"checkpoint entry {k} does not match its digest (field 'digest'): its state was edited or "
                "corrupted, or it belongs to another run (seed, fingerprint or lane count); restore from an "
                "unmodified checkpoint"
            )


def encode_state(state: Mapping[str, Any]) -> dict[str, bytes]:
    """Router state -> ``{"zephon": meta JSON bytes, "lane_00007": lane JSON bytes, ...}`` for DCP.

    >>> enc = encode_state({"format_version": FORMAT_VERSION, "lane_00007": {"cursor": 3}})
    >>> enc["lane_00007"]
    b'{"cursor":3}'
    """
    meta = {k: v for k, v in state.items() if not is_lane_key(k)}
    out = {SHARED_KEY: json.dumps(meta, sort_keys=True, allow_nan=False).encode("utf-8")}
    for k, v in state.items():
        if is_lane_key(k):
            out[k] = _canonical(v)
    return out


def decode_state(encoded: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`encode_state`, bounding and validating every entry; a current-format
    state is verified (:func:`verify_state`: digests, lane identities, no unknown entries). An
    older format stays as it is: the pipeline that loads it migrates its lanes (:func:`migrate`).

    >>> st = seal_state({"format_version": FORMAT_VERSION, "lanes": 8, "seed": 0, "fingerprint": "",
    ...                  "step": 0, "shared": {}, "type": "router", "version": 1, "lane_00007": {"cursor": 3}})
    >>> decode_state(encode_state(st))["lane_00007"]["state"]
    {'cursor': 3}
    """
    if SHARED_KEY not in encoded:
        raise StateError(f"checkpoint has no {SHARED_KEY!r} entry: it was not written by zephon, or is truncated")
    meta = parse_json(encoded[SHARED_KEY], f"checkpoint entry {SHARED_KEY!r}", max_bytes=MAX_SHARED_BYTES)
    if not isinstance(meta, dict):
        raise StateError(f"checkpoint entry {SHARED_KEY!r} must be a JSON object")
    lanes_in_meta = [k for k in meta if is_lane_key(k)]
    if lanes_in_meta:
        raise StateError(f"checkpoint entry {SHARED_KEY!r} holds a lane entry {lanes_in_meta[0]!r}; it was edited")
    state: dict[str, Any] = dict(meta)
    for k, v in encoded.items():
        if k == SHARED_KEY:
            continue
        if not is_lane_key(k):
            raise StateError(f"unexpected checkpoint entry {k!r}; expected {SHARED_KEY!r} and lane_NNNNN entries")
        entry = parse_json(v, f"checkpoint entry {k!r}")
        if not isinstance(entry, dict):
            raise StateError(f"checkpoint entry {k!r} must be a JSON object")
        state[k] = entry
    if check_version(state) == FORMAT_VERSION:
        verify_state(state)
    return state


# Format history:
#   1: rank-level entries without "shared"; text lanes had no skip_counter node.
#   2: "shared" holds derived, rank-independent values (token estimates, data and tokenizer
#      fingerprints); text lanes count skipped records (skip_counter between mapper and pack).
#   3: every lane entry is {"lane", "step", "state", "digest"} and the shared entries carry a
#      "digest" (seal_state / verify_state); skip counters (version 2) keep a per-dataset streak.
# What changed inside a lane's state belongs to the pipeline that builds the lane: its lane
# set (zephon.engine.LaneSet.lane_migrations) passes its migrations to migrate() explicitly;
# nothing is registered globally.


def check_version(state: Mapping[str, Any]) -> int:
    """The state's ``format_version``, refusing a missing, corrupt or newer one.

    >>> check_version({"format_version": 99})
    Traceback (most recent call last):
    ...
    zephon.engine.node.StateError: checkpoint format_version 99 is newer than this zephon supports (3); upgrade zephon to load it
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
    the envelope here, each lane's pipeline state with ``lane_migrations[version]`` (the lane
    set's own, see :class:`zephon.engine.LaneSet`); the result is sealed (:func:`seal_state`).
    Formats before 3 carried no digests, so a migrated state is only as trustworthy as the file
    it came from (each node still checks its values). A current state is returned as it is.

    >>> old = {"format_version": 1, "lanes": 1, "seed": 0, "fingerprint": "", "step": 0,
    ...        "lane_00000": {"cursor": 1}}
    >>> new = migrate(old, {1: lambda lane: dict(lane, skipped=0)})
    >>> new["format_version"] == FORMAT_VERSION, new["shared"], lane_state(new, 0)
    (True, {}, {'cursor': 1, 'skipped': 0})
    """
    version = check_version(state)
    if version == FORMAT_VERSION:
        return dict(state)
    out = copy.deepcopy(dict(state))
    # formats 1 and 2 keep each lane's pipeline state directly under its key
    lanes = {k: out.pop(k) for k in [k for k in out if is_lane_key(k)]}
    while version < FORMAT_VERSION:
        if version == 1:
            out.setdefault("shared", {})
        fn = (lane_migrations or {}).get(version)
        if fn is not None:
            lanes = {k: fn(v) for k, v in lanes.items()}
        version += 1
    out["format_version"] = FORMAT_VERSION
    out.update(lanes)
    return seal_state(out)


def save_state(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Write a (merged) state as one JSON file, atomically and durably (fsynced file and folder,
    a temporary name of its own: see :func:`zephon.engine.durable.write_atomic`).

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "state.json")
    >>> save_state(path, {"format_version": FORMAT_VERSION, "lane_00000": {"cursor": 1}})
    >>> load_state(path, verify=False)["lane_00000"]
    {'cursor': 1}
    """
    write_atomic(path, json.dumps(state, sort_keys=True, indent=1, allow_nan=False).encode("utf-8"))


def load_state(path: str | os.PathLike, *, lanes: int | None = None, verify: bool = True) -> dict[str, Any]:
    """Read a state written by :func:`save_state`. The file's size is checked before it is read:
    at most what ``lanes`` lane entries and the shared entries can take (any lane count when
    ``lanes`` is None: 256 MiB). A current-format state is verified (:func:`verify_state`)."""
    name = os.fspath(path)
    # save_state indents: a lane entry takes up to ~3x its compact size in the file
    limit = 256 << 20 if lanes is None else 4 * (MAX_SHARED_BYTES + lanes * MAX_ENTRY_BYTES)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise StateError(
                f"{name}: {size} bytes is larger than any zephon state"
                + (f" of {lanes} lanes" if lanes is not None else "")
                + f" ({limit}); refusing to read it. It is not a zephon state, or it is corrupt"
            )
        raw = f.read(limit + 1)
    state = parse_json(raw, name, max_bytes=limit)
    if not isinstance(state, dict):
        raise StateError(f"{name}: a zephon state is a JSON object")
    if check_version(state) == FORMAT_VERSION and verify:
        try:
            verify_state(state)
        except StateError as e:
            raise StateError(f"{name}: {e}") from None
    return state
