"""Profile zephon's vision path with py-spy (sampling, all threads, CPU-active samples only).

``profile_zephon_vision`` runs the benchmark's zephon throughput measurement under
``py-spy record --threads -f raw`` and summarises the collapsed stacks the way
``profile_text.summarise`` does (threads, top functions by self and inclusive samples), plus the
top *lines* by self samples with their source text: Pillow's decode and resize and numpy's
array operations run in C without Python frames, so their time is attributed to the Python line
that calls them (``im.load()``, ``im.resize(...)``, ``x /= std``, ``np.ascontiguousarray``),
which tells them apart.

    python benchmarks/profile_vision.py RAW_FILE     # summarise a raw py-spy file
"""

from __future__ import annotations

import collections
import json
import linecache
import os
import shutil
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.profile_text import _FRAME, _short, samples, summarise  # noqa: E402


def summarise_lines(raw_path: str, top: int = 15) -> dict[str, Any]:
    """Top lines by self samples: ``[(function (file:line), source text, %)]``; and the share of
    samples spent waiting (``Condition.wait``, ``Event.wait``, queue gets, ``lock.acquire``)."""
    lines: dict[str, int] = collections.Counter()
    src: dict[str, str] = {}
    total = 0
    for _, frames, n in samples(raw_path):
        total += n
        if not frames:
            continue
        last = frames[-1].strip()
        m = _FRAME.match(last)
        key = last
        if m and m.group("line"):
            key = f"{_short(last)[:-1]}:{m.group('line')})"
            if key not in src:
                src[key] = linecache.getline(m.group("file"), int(m.group("line"))).strip()
        lines[key] += n
    pct = lambda c: round(100.0 * c / total, 1) if total else 0.0  # noqa: E731
    return {"lines": [(k, src.get(k, ""), pct(c)) for k, c in lines.most_common(top)]}


def profile_zephon_vision(
    runner, settings: dict[str, Any], threads: int, steps: int, warmup: int, tmp: str
) -> dict[str, Any]:
    pyspy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(pyspy):
        return {"error": "py-spy is not installed (pip install py-spy)"}
    raw = os.path.join(tmp, f"pyspy_vision_{threads}.txt")
    res = runner.call(
        {
            "kind": "vthroughput",
            "contender": "zephon",
            "threads": threads,
            "steps": steps,
            "warmup": warmup,
            "settings": settings,
        },
        prefix=[pyspy, "record", "-r", "200", "--threads", "-f", "raw", "-o", raw, "--"],
    )
    if not res.get("ok") or not os.path.exists(raw):
        return {"error": res.get("error", "py-spy wrote no profile")}
    out = summarise(raw)
    out.update(summarise_lines(raw))
    out["images_per_s_under_profiler"] = res["result"]["images_per_s"]
    return out


if __name__ == "__main__":  # python benchmarks/profile_vision.py RAW_FILE
    out = summarise(sys.argv[1])
    out.update(summarise_lines(sys.argv[1]))
    print(json.dumps(out, indent=1))
