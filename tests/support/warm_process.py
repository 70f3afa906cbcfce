"""Real processes without the interpreter start: ``python -m MODULE ARGS`` run in a child forked
from a warm interpreter that has imported torch and zephon once.

A fresh ``python -m zephon`` spends 2-4 s importing torch before it does anything; a test file
that runs the command 40 times spends minutes on imports. The child here is still a separate
process (its own pid, exit status, stdout and stderr, working directory, environment and signals),
run by :func:`runpy.run_module` as ``python -m`` runs it; only the imports are shared.

Limits: environment variables read at import time by torch or zephon (``OMP_NUM_THREADS``, ...)
keep the warm interpreter's values, and the child has no stdin. A test about those, or about the
interpreter start itself, runs a plain :func:`subprocess.run`.

Use the session fixture ``zephon_process`` (tests/conftest.py), or :class:`WarmInterpreter` directly.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any

SERVER = r"""
import json, os, runpy, signal, sys, traceback
for _m in sys.argv[1].split(","):
    __import__(_m)
requests, replies = sys.stdin.buffer, sys.stdout.buffer
devnull = os.open(os.devnull, os.O_RDONLY)
for line in requests:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.setpgid(0, 0)
            out = os.open(req["stdout"], os.O_WRONLY)
            err = os.open(req["stderr"], os.O_WRONLY)
            os.dup2(devnull, 0); os.dup2(out, 1); os.dup2(err, 2)
            os.chdir(req["cwd"])
            os.environ.clear(); os.environ.update(req["env"])
            sys.argv = [req["module"], *req["args"]]
            sys.path[0] = req["cwd"]
            try:
                runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else (print(e.code, file=sys.stderr), 1)[1])
            except KeyboardInterrupt:
                traceback.print_exc(); code = 130
            except BaseException:
                traceback.print_exc(); code = 1
            import atexit, threading
            for t in threading.enumerate():
                if t is not threading.main_thread() and not t.daemon:
                    t.join()
            atexit._run_exitfuncs()
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os._exit(code)
    replies.write(b"%d\n" % pid); replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(b"%d\n" % os.waitstatus_to_exitcode(status)); replies.flush()
"""


class WarmInterpreter:
    """A warm interpreter (imports ``preload``) that forks one child per :meth:`run`, one at a time."""

    def __init__(self, preload: tuple[str, ...] = ("torch", "zephon", "zephon.tools.cli")) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, ",".join(preload)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd="/",
        )
        self._lock = threading.Lock()

    def run(
        self,
        args: list[Any],
        *,
        module: str = "zephon",
        timeout: float = 300,
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``python -m module *args`` in a fresh child: like ``subprocess.run(..., capture_output=True,
        text=True, timeout=timeout)``; raises :class:`subprocess.TimeoutExpired` (child killed)."""
        argv = [str(a) for a in args]
        cmd = [sys.executable, "-m", module, *argv]
        with self._lock, tempfile.TemporaryDirectory(prefix="warm-") as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            open(out, "w").close(), open(err, "w").close()
            req = {
                "module": module,
                "args": argv,
                "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                "env": dict(os.environ if env is None else env),
                "stdout": out,
                "stderr": err,
            }
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(json.dumps(req).encode() + b"\n")
            self._proc.stdin.flush()
            pid = int(self._proc.stdout.readline())
            rc_box: list[int] = []
            reader = threading.Thread(target=lambda: rc_box.append(int(self._proc.stdout.readline())), daemon=True)  # type: ignore[union-attr]
            reader.start()
            reader.join(timeout)
            if not rc_box:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, 9)
                reader.join()
                with open(out) as f, open(err) as g:
                    raise subprocess.TimeoutExpired(cmd, timeout, output=f.read(), stderr=g.read())
            with open(out) as f, open(err) as g:
                return subprocess.CompletedProcess(cmd, rc_box[0], f.read(), g.read())

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(timeout=60)


_SHARED: WarmInterpreter | None = None
_SHARED_LOCK = threading.Lock()


def run_zephon(*args: Any, timeout: float = 300, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``python -m zephon ARGS`` in a fresh process forked from this test process's shared warm
    interpreter (started on first use, closed at exit): the drop-in for
    ``subprocess.run([sys.executable, "-m", "zephon", *args], capture_output=True, text=True)``."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED._proc.poll() is not None:
            _SHARED = WarmInterpreter()
            atexit.register(_SHARED.close)
        warm = _SHARED
    return warm.run(list(args), timeout=timeout, **kw)
