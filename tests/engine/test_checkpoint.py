"""Checkpoint bytes are JSON: corrupt, truncated or hostile input gives a clear error, never code execution."""

import pickle

import pytest

from zephon import StateError, decode_state, encode_state
from zephon.engine.checkpoint import MAX_ENTRY_BYTES, load_state, migrate, save_state


def good():
    return {
        "type": "router",
        "version": 1,
        "format_version": 2,
        "lanes": 2,
        "seed": 0,
        "fingerprint": "f",
        "step": 3,
        "shared": {},
        "lane_00000": {"a": 1},
        "lane_00001": {"a": 2},
    }


def test_roundtrip():
    enc = encode_state(good())
    assert all(isinstance(v, bytes) for v in enc.values())
    assert decode_state(enc) == good()


@pytest.mark.parametrize(
    "entry, match",
    [
        (b'{"a": 1', "corrupt or truncated"),
        (b"\xff\xfe", "not UTF-8"),
        (pickle.dumps({"a": 1}), "not UTF-8|corrupt"),
        (b'{"a": NaN}', "corrupt"),
        (b"[1, 2]", "JSON object"),
        (b"1" * (MAX_ENTRY_BYTES + 1), "larger than any zephon state"),
        (b"[" * 100000, "corrupt"),
    ],
)
def test_bad_lane_bytes(entry, match):
    enc = encode_state(good())
    enc["lane_00001"] = entry
    with pytest.raises(StateError, match=match):
        decode_state(enc)


def test_not_a_zephon_checkpoint():
    with pytest.raises(StateError, match="not written by zephon"):
        decode_state({"lane_00000": b"{}"})
    enc = encode_state(good())
    enc["model"] = b"{}"
    with pytest.raises(StateError, match="unexpected checkpoint entry"):
        decode_state(enc)


def test_versions():
    st = good()
    st["format_version"] = 99
    with pytest.raises(StateError, match="newer than this zephon"):
        migrate(st)
    st["format_version"] = "x"
    with pytest.raises(StateError, match="no valid format_version"):
        migrate(st)


def test_file_roundtrip(tmp_path):
    p = tmp_path / "state.json"
    save_state(p, good())
    assert load_state(p) == good()
    p.write_bytes(b'{"format_version": 1, ')
    with pytest.raises(StateError, match="truncated"):
        load_state(p)
