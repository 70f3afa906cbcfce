"""Checkpoint files are durable and safe to write concurrently (zephon.engine.durable)."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import stat
import subprocess

import pytest

from zephon.engine.checkpoint import FORMAT_VERSION, load_state, save_state
from zephon.engine.durable import write_atomic


def test_the_file_and_its_folder_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    def replace(a, b):
        synced.append("rename")
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_state(tmp_path / "state.json", {"format_version": FORMAT_VERSION, "lane_00000": {"c": 1}})
    assert synced == ["file", "rename", "folder"]


def _writer(path: str, who: int, n: int) -> None:
    for i in range(n):
        save_state(path, {"format_version": FORMAT_VERSION, "writer": who, "i": i, "pad": "x" * (1000 * who)})


def test_two_processes_writing_one_path_never_fail_and_the_last_complete_save_wins(tmp_path):
    path = str(tmp_path / "state.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w, 150)) for w in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    state = load_state(path, verify=False)
    assert state["i"] == 149 and len(state["pad"]) == 1000 * state["writer"]
    assert os.listdir(tmp_path) == ["state.json"]  # no temporary file left behind


def test_a_failed_write_names_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    real = os.fsync

    def full(fd):
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", full)
    target = tmp_path / "state.json"
    target.write_text('{"old": true}')
    with pytest.raises(OSError, match=r"cannot write .*state\.json: No space left on device \(the disk is full"):
        save_state(target, {"format_version": FORMAT_VERSION})
    assert os.listdir(tmp_path) == ["state.json"] and json.loads(target.read_text()) == {"old": True}


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs (root only): a real full disk."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a small tmpfs needs root (the monkeypatched full-disk test above still runs)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_real_full_disk_keeps_the_last_complete_checkpoint(tiny_disk):
    path = tiny_disk / "state.json"
    save_state(path, {"format_version": FORMAT_VERSION, "step": 1})
    with pytest.raises(OSError, match="cannot write .*state.json.*disk is full"):
        write_atomic(path, b"x" * (256 << 10))
    assert load_state(path, verify=False)["step"] == 1
    assert sorted(os.listdir(tiny_disk)) == ["state.json"]
