"""Process workers and the main script: refuse to start them from an unguarded script's top level.

Why a module of its own: the check reads the main thread's stack and the script's syntax tree,
nothing of a pool; :class:`zephon.engine.workers.WorkerPool` calls it before its first process
starts.
"""

from __future__ import annotations

import ast
import os
import sys
import threading

from .node import PipelineError

__all__ = ["MainGuardError", "guarded", "refuse_unguarded_main"]


class MainGuardError(PipelineError):
    """Process workers were asked for from the top level of a script that has no
    ``if __name__ == "__main__":`` guard (see :func:`refuse_unguarded_main`)."""


def refuse_unguarded_main(start_method: str) -> None:
    """Refuse to start process workers from a script's top level outside an
    ``if __name__ == "__main__":`` block, naming the line and the fix.

    Why: under the "spawn" and "forkserver" start methods every worker imports the main script
    again, as multiprocessing does, so an unguarded script runs its loader again in each worker:
    the workers then fail in their bootstrap (with multiprocessing's long message, a pool
    reported dead or hung after ``timeout_s``) or, where the script catches that, run the whole
    script once more each. Read from the main thread's stack and the script's syntax tree,
    before any process starts; a script multiprocessing does not re-import (a ``__main__.py``,
    ``python -c``, a notebook, the "fork" start method) is never refused."""
    if start_method == "fork":
        return
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if not isinstance(path, str) or (spec_name or "").endswith("__main__"):
        return  # (multiprocessing does not re-run a package's __main__.py, nor code without a file)
    if spec_name is None and os.path.splitext(os.path.basename(path))[0] == "ipython":
        return
    path = os.path.abspath(path)
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    line = None
    while frame is not None:  # the outermost frame of the script's own top level
        if frame.f_code.co_name == "<module>" and os.path.abspath(frame.f_code.co_filename) == path:
            line = frame.f_lineno
        frame = frame.f_back
    if line is None or guarded(path, line):
        return
    raise MainGuardError(
        f"{path}:{line} starts process workers at the script's top level, without an "
        '`if __name__ == "__main__":` guard: each worker would run the script again. Put the code '
        'that builds and iterates the loader under `if __name__ == "__main__":` (or use workers.backend = "thread")'
    )


def guarded(path: str, line: int) -> bool:
    """Whether ``line`` of the script ``path`` is inside an ``if`` that tests ``__name__``
    (True when the script cannot be read or parsed: refuse only what is known)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return True
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and node.lineno <= line <= (node.end_lineno or node.lineno)
            and any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test))
        ):
            return True
    return False
