"""Checkpoint bytes are JSON: corrupt, truncated, edited or hostile input gives a clear error naming
the entry and the field, never code execution, never a silent restore."""

import copy
import json
import os
import pickle

import pytest

from zephon import StateError
from zephon.engine.checkpoint import (
    FORMAT_VERSION,
    MAX_ENTRY_BYTES,
    MAX_SHARED_BYTES,
    STATE_KEYS,
    decode_state,
    encode_state,
    lane_state,
    load_state,
    migrate,
    save_state,
    seal_state,
    verify_state,
)


def good():
    return seal_state(
        {
            "type": "router",
            "version": 1,
            "format_version": FORMAT_VERSION,
            "lanes": 2,
            "seed": 0,
            "fingerprint": "f",
            "step": 3,
            "shared": {},
            "lane_00000": {"a": 1},
            "lane_00001": {"a": 2},
        }
    )


def test_roundtrip():
    enc = encode_state(good())
    assert all(isinstance(v, bytes) for v in enc.values())
    assert decode_state(enc) == good()
    assert lane_state(decode_state(enc), 1) == {"a": 2}


@pytest.mark.parametrize(
    "entry, match",
    [
        (b'{"a": 1', "corrupt or truncated"),
        (b"\xff\xfe", "not UTF-8"),
        (pickle.dumps({"a": 1}), "not UTF-8|corrupt"),
        (b'{"a": NaN}', "corrupt"),
        (b"[1, 2]", "JSON object"),
        (b"1" * (MAX_ENTRY_BYTES + 1), "larger than any zephon state"),
        (b"[" * 60000, "corrupt"),
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


def _edited(edit):
    st = copy.deepcopy(good())
    edit(st)
    return st


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda st: st["lane_00001"]["state"].update(a=3), r"lane_00001 does not match its digest \(field 'digest'\)"),
        (lambda st: st.update(lane_00000=st["lane_00001"], lane_00001=st["lane_00000"]), "holds the state of lane 1"),
        (lambda st: st["lane_00000"].update(step=4), r"saved at step 4 \(field 'step'\).*at step 3"),
        (lambda st: st.update(step=4), "shared entries do not match their digest"),
        (lambda st: st.update(seed=1), "shared entries do not match their digest"),
        (lambda st: st["shared"].update(x=1), "shared entries do not match their digest"),
        (lambda st: st.update(surprise={"x": 1}), "unknown entry 'surprise'"),
        (
            lambda st: st.update(lane_00007=copy.deepcopy(st["lane_00000"])),
            "lane_00007 is beyond the checkpoint's lane count",
        ),
        (lambda st: st.update(lane_7=copy.deepcopy(st["lane_00000"])), "'lane_7' is not a lane key"),
        (lambda st: st["lane_00000"].pop("digest"), "must hold exactly lane, step, state, digest"),
        (lambda st: st["lane_00000"].update(lane=True), "holds the state of lane True"),
        (lambda st: st.update(step=True), "'step' must be an integer"),
        (lambda st: st.update(lanes=10**30), "'lanes' must be an integer"),
        (lambda st: st.pop("digest"), "no 'digest' entry"),
    ],
    ids=[
        "edited_lane",
        "swapped_lanes",
        "lane_from_other_step",
        "changed_step",
        "changed_seed",
        "edited_shared",
        "unknown_entry",
        "extra_lane",
        "malformed_lane_key",
        "truncated_lane_entry",
        "bool_lane_id",
        "bool_step",
        "huge_lanes",
        "no_digest",
    ],
)
def test_edited_states_are_refused_naming_entry_and_field(edit, match):
    st = _edited(edit)
    with pytest.raises(StateError, match=match):
        verify_state(st)
    with pytest.raises(StateError, match=match):  # the DCP path refuses it too
        decode_state(encode_state(st))


def test_state_keys_are_one_constant(monkeypatch):
    """The entries besides lanes are STATE_KEYS, in one place: a new shared entry is one more name
    there. It is then accepted and covered by the shared digest, and a state written before it
    existed still verifies."""
    import zephon.engine.checkpoint as ck

    assert set(good()) - {"lane_00000", "lane_00001"} == set(STATE_KEYS)
    with pytest.raises(StateError, match="unknown entry 'end'"):
        verify_state(seal_state({**good(), "end": {"at": 5}}))
    monkeypatch.setattr(ck, "STATE_KEYS", (*STATE_KEYS, "end"))
    raw = {k: (v["state"] if k.startswith("lane_") else v) for k, v in good().items()}
    st = seal_state({**raw, "end": {"at": 5}})
    verify_state(st)
    st["end"]["at"] = 6
    with pytest.raises(StateError, match="shared entries do not match their digest"):
        verify_state(st)
    verify_state(good())


def test_shared_entry_size_is_capped_before_parsing():
    enc = encode_state(good())
    enc["zephon"] = b" " * (MAX_SHARED_BYTES + 1)
    with pytest.raises(StateError, match="larger than any zephon state"):
        decode_state(enc)
    meta = json.loads(encode_state(good())["zephon"])
    meta["junk"] = "x" * (900 << 10)  # under the cap: refused as an unknown entry
    with pytest.raises(StateError, match="unknown entry 'junk'"):
        decode_state(dict(encode_state(good()), zephon=json.dumps(meta).encode()))


def test_state_file_size_is_checked_before_reading(tmp_path):
    p = tmp_path / "zephon_state.json"
    with open(p, "wb") as f:  # a sparse 300 MB file: refused from its size, never read
        f.truncate(300 << 20)
    with pytest.raises(StateError, match="larger than any zephon state"):
        load_state(p)
    save_state(p, good())
    assert load_state(p, lanes=2) == good()
    with open(p, "ab") as f:
        f.truncate(os.path.getsize(p) + (20 << 20))
    with pytest.raises(StateError, match="larger than any zephon state of 2 lanes"):
        load_state(p, lanes=2)


def test_edited_state_file_is_refused(tmp_path):
    p = tmp_path / "zephon_state.json"
    st = good()
    st["lane_00000"]["state"]["a"] = 5
    save_state(p, st)
    with pytest.raises(StateError, match="lane_00000 does not match its digest"):
        load_state(p)


def test_migration_from_format_2_seals_the_lanes():
    v2 = {k: v for k, v in good().items() if k != "digest"}
    for k in ("lane_00000", "lane_00001"):
        v2[k] = v2[k]["state"]
    v2["format_version"] = 2
    new = migrate(v2, {2: lambda lane: dict(lane, b=0)})
    verify_state(new)
    assert new["format_version"] == FORMAT_VERSION and lane_state(new, 1) == {"a": 2, "b": 0}
