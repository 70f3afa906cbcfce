"""Opening a FIFO blocks until a writer comes: a loader that opens one it was handed as a file
hangs. The check runs in a child process with a timeout, so a hang fails the test instead of
stopping the suite."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def refusal_of_fifo(path: str, load: str, error: str) -> str:
    """Make a FIFO at ``path``, run ``load`` (Python code naming ``PATH``) in a child process
    and return the message of the ``error`` (an exception class name in scope) it raises; fail
    the test if it blocks or does not raise."""
    os.mkfifo(path)
    code = f"PATH = {path!r}\ntry:\n    {load}\nexcept {error} as e:\n    print(e)\n    raise SystemExit(3)\n"
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"opening a FIFO blocked: {load}")
    assert run.returncode == 3, run.stderr[-2000:]
    return run.stdout
