"""Profile zephon's text path with py-spy (sampling, all threads, CPU-active samples only;
imports and the harness's memory sampler are left out).

``profile_zephon`` runs the same throughput measurement as the benchmark under
``py-spy record --threads -f raw`` and summarises the collapsed stacks: share of samples per
thread, and the top functions by self and by inclusive samples. The tokenizer's Rust code is not
visible to py-spy: its time is attributed to the Python line that calls ``encode_batch_fast``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from typing import Any

# imports and the benchmark's own memory sampler are not the loader's work
_DROP = ("_find_and_load", "RssSampler", "psutil/")
_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    f = m.group("file")
    for marker in ("site-packages/", "/work/main/", "lib/python3."):
        if marker in f:
            f = f.split(marker, 1)[1]
            if marker == "lib/python3.":
                f = "stdlib/" + f.split("/", 1)[1]
            break
    return f"{m.group('fn')} ({f})"


def samples(raw_path: str) -> Iterator[tuple[str, list[str], int]]:
    """(thread name, frames outermost first, sample count) of each stack in a py-spy raw file;
    imports and the harness's own sampler are left out."""
    with open(raw_path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, n = line.rpartition(" ")
            try:
                count = int(n)
            except ValueError:
                continue
            if any(x in stack for x in _DROP):
                continue
            frames = stack.split(";")
            thread, frames = frames[0], frames[1:]
            if thread.startswith("process ") and frames:  # --subprocesses adds a process frame
                thread, frames = frames[0], frames[1:]
            yield (thread.split(": ", 1)[1] if ": " in thread else "(unnamed thread)"), frames, count


def summarise(raw_path: str, top: int = 15) -> dict[str, Any]:
    threads: dict[str, int] = collections.Counter()
    self_c: dict[str, int] = collections.Counter()
    incl: dict[str, int] = collections.Counter()
    total = 0
    for tname, frames, n in samples(raw_path):
        threads[tname] += n
        total += n
        if frames:
            self_c[_short(frames[-1])] += n
            for fr in {_short(x) for x in frames}:
                incl[fr] += n
    pct = lambda c: round(100.0 * c / total, 1) if total else 0.0  # noqa: E731
    return {
        "samples": total,
        "threads": [(t, pct(c)) for t, c in threads.most_common()],
        "self": [(fn, pct(c)) for fn, c in self_c.most_common(top)],
        "inclusive": [(fn, pct(c)) for fn, c in incl.most_common(top)],
    }


def profile_zephon(runner, settings: dict[str, Any], threads: int, steps: int, tmp: str) -> dict[str, Any]:
    pyspy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(pyspy):
        return {"error": "py-spy is not installed (pip install py-spy)"}
    raw = os.path.join(tmp, f"pyspy_{threads}.txt")
    res = runner.call(
        {"kind": "throughput", "contender": "zephon", "threads": threads, "steps": steps, "settings": settings},
        prefix=[pyspy, "record", "-r", "200", "--threads", "-f", "raw", "-o", raw, "--"],
    )
    if not res.get("ok") or not os.path.exists(raw):
        return {"error": res.get("error", "py-spy wrote no profile")}
    out = summarise(raw)
    out["tokens_per_s_under_profiler"] = res["result"]["tokens_per_s"]
    return out


if __name__ == "__main__":  # python benchmarks/profile_text.py RAW_FILE
    print(json.dumps(summarise(sys.argv[1]), indent=1))
