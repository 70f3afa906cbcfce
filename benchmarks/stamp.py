"""The stamp of a results file: the commit, machine and command that made it.

Every results file (``benchmarks/results/*``, ``docs/img/*.json``) carries one, so a number read in
the README or the docs says where it comes from: a JSON file under ``"stamp"``, a Markdown report
in its first line (``stamp_line``). ``tests/system/test_results_stamps.py`` fails on a results file
without one. Standard library only: ``scripts/`` imports it too.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["STAMP_LINE", "stamp", "stamp_files", "stamp_line", "write_results"]

#: a Markdown report's stamp line (``stamp_line``)
STAMP_LINE = re.compile(r"^_(Made at commit|Committed in) `[0-9a-f]{7,40}`")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def default_command() -> str:
    """The command line of this process, the script's path relative to the checkout."""
    script = sys.argv[0] if sys.argv else ""
    if script and os.path.isabs(script) and script.startswith(ROOT + os.sep):
        script = os.path.relpath(script, ROOT)
    return " ".join(["python", shlex.quote(script), *map(shlex.quote, sys.argv[1:])]).strip()


def stamp(command: str | None = None, loadavg_start: Any = None) -> dict[str, Any]:
    """Which commit (and whether the tree had uncommitted changes), machine (cores, CPU, load) and
    command made a results file; ``loadavg_start``: the load when the measurements began."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": _git("rev-parse", "HEAD") or "unknown (not a git checkout)",
        "dirty": bool(status),
        "from": "run",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command or default_command(),
        "machine": {
            "cores": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "cpu": _cpu(),
            "platform": platform.platform(),
            "loadavg_start": [round(x, 2) for x in (loadavg_start or os.getloadavg())],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        },
    }


def stamp_line(st: dict[str, Any]) -> str:
    """The stamp as the first line of a Markdown report."""
    m = st.get("machine", {})
    start = m.get("loadavg_start")
    load = "/".join(f"{x:g}" for x in start) if isinstance(start, list) else str(start or "")
    dirty = " with uncommitted changes" if st.get("dirty") else ""
    if st.get("from") == "run":
        made = f"_Made at commit `{st['commit'][:12]}`{dirty}, {st.get('date', '')}"
    else:
        made = (
            f"_Committed in `{st['commit'][:12]}`, {st.get('date', '')} (stamp from git history: the run was made "
            "on the tree just before that commit)"
        )
    cores = m.get("cores") or "? (not recorded)"
    return f"{made}: `{st.get('command', '')}` on {cores} cores ({m.get('cpu') or '?'}), load average {load or '?'} at the start._"


def _started(data: dict[str, Any]) -> Any:
    """The load average a results file recorded at its start, if it did."""
    m = data.get("machine")
    if isinstance(m, dict):
        return m.get("loadavg_start") or m.get("load_avg_start")
    return None


def stamp_files(json_path: str, *md_paths: str, command: str | None = None) -> dict[str, Any]:
    """Stamp a results JSON (a ``"stamp"`` entry first) and its Markdown reports (a first line),
    after the writer wrote them; the JSON's own stamp is kept when it has one (a redraw)."""
    with open(json_path) as f:
        data = json.load(f)
    st = data.get("stamp") if isinstance(data.get("stamp"), dict) else None
    if st is None:
        st = stamp(command, loadavg_start=_started(data))
    with open(json_path, "w") as f:
        json.dump({"stamp": st, **{k: v for k, v in data.items() if k != "stamp"}}, f, indent=1, default=str)
        f.write("\n")
    for md in md_paths:
        with open(md) as f:
            lines = [line for line in f.read().split("\n") if not STAMP_LINE.match(line)]
        while len(lines) > 1 and lines[0].startswith("# ") and lines[1] == "" and lines[2:3] == [""]:
            del lines[1]  # the blank line left by a removed stamp
        head = 1 if lines and lines[0].startswith("# ") else 0  # below the title
        with open(md, "w") as f:
            f.write("\n".join([*lines[:head], *([""] if head else []), stamp_line(st), "", *lines[head:]]))
    return st


#: the command of each results file made before stamps, as its writer's usage gives it (the runs
#: did not all record theirs)
HISTORY_COMMANDS = {
    "block_shuffle": "python benchmarks/block_shuffle.py",
    "memory_budget": "python -m benchmarks.memory_budget",
    "scale_2core_test": "python benchmarks/scale.py --workers 1,2,4 --tag 2core_test",
    "text_small": "python benchmarks/run.py --size small --only text",
    "vision_small": "python benchmarks/run.py --size small --only vision",
    "verify_reads": "python benchmarks/verify_reads.py",
    "work": "python benchmarks/work.py",
    "ablation": "python scripts/ablation_experiment.py --bf16 (stopped by hand; bf16_check: --bf16-only, see its note)",
    "gpu_count": "python scripts/gpu_count_experiment.py",
    "titan_resume": "python scripts/plot_titan_resume.py",
}


def write_results(out: str, name: str, data: dict[str, Any], text: str) -> None:
    """Write a benchmark's results, ``<out>/<name>.json`` (``data``) and ``<out>/<name>.md``
    (``text``), and stamp both."""
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, name)
    with open(base + ".json", "w") as f:
        json.dump(data, f, indent=1, default=str)
    with open(base + ".md", "w") as f:
        f.write(text)
    stamp_files(base + ".json", base + ".md")


def history_stamp(json_path: str) -> dict[str, Any]:
    """The stamp of a results file made before stamps existed, from git history: the commit that
    last changed it (the run was made on the tree just before that commit), its command (recorded,
    or its writer's usage) and the machine it recorded."""
    rel = os.path.relpath(os.path.abspath(json_path), ROOT)
    commit, date = (_git("log", "-1", "--format=%H %cs", "--", rel).split() + ["", ""])[:2]
    if not commit:
        raise SystemExit(f"{rel}: not in git history; stamp it by running its benchmark")
    with open(json_path) as f:
        data = json.load(f)
    name = os.path.basename(json_path)[: -len(".json")]
    recorded = isinstance(data.get("command"), str)
    m = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    load = _started(data)
    return {
        "commit": commit,
        "dirty": None,
        "from": "git history: the commit that added this file; the run was made on the tree just before it",
        "date": date,
        "command": data["command"] if recorded else HISTORY_COMMANDS.get(name, "unknown (not recorded)"),
        "command_recorded": recorded,
        "machine": {
            "cores": m.get("cores", m.get("cpus")),
            "affinity": m.get("affinity"),
            "cpu": m.get("cpu", "not recorded"),
            "platform": m.get("platform", "not recorded"),
            "loadavg_start": [round(x, 2) for x in load] if load else "not recorded",
        },
    }


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/stamp.py --from-history FILE.json...``: stamp results files made before
    stamps (and their ``.md`` beside them) from git history."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--from-history", nargs="+", required=True, metavar="JSON")
    for path in ap.parse_args(argv).from_history:
        with open(path) as f:
            if isinstance(json.load(f).get("stamp"), dict):
                print(f"{path}: already stamped")
                continue
        st = history_stamp(path)
        md = path[: -len(".json")] + ".md"
        _write_stamp(path, st, md if os.path.exists(md) else None)
        print(f"{path}: stamped from git history ({st['commit'][:12]})")
    return 0


def _write_stamp(json_path: str, st: dict[str, Any], md: str | None) -> None:
    with open(json_path) as f:
        data = json.load(f)
    with open(json_path, "w") as f:
        json.dump({"stamp": st, **data}, f, indent=1, default=str)
        f.write("\n")
    if md:
        stamp_files(json_path, md)


if __name__ == "__main__":
    sys.exit(main())
