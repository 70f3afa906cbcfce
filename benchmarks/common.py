"""Pieces the text and vision halves of the benchmark share."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_chunks(
    fn: Callable[[Any], int],
    chunks: Sequence[Any],
    threads: int,
    target: int,
    cpu: Callable[[], float] | None = None,
) -> tuple[int, float, float | None]:
    """Run ``fn`` (chunk -> units done) over ``chunks`` (cycling) on ``threads`` threads until
    ``target`` units, keeping 4 chunks per thread in flight and collecting in order, like a loader
    would. Returns (units, seconds, CPU seconds or None): how the limits are measured."""
    total = 0
    with cf.ThreadPoolExecutor(threads) as ex:
        c0 = cpu() if cpu else 0.0
        t0 = time.perf_counter()
        done = False
        while not done:
            futs = []
            for c in chunks:
                futs.append(ex.submit(fn, c))
                if len(futs) >= 4 * threads:
                    total += futs.pop(0).result()
                    if total >= target:
                        done = True
                        break
            for f in futs:
                if not done:
                    total += f.result()
                    done = total >= target
                else:
                    f.cancel()
        dt = time.perf_counter() - t0
        c1 = cpu() if cpu else 0.0
    return total, dt, (c1 - c0 if cpu else None)


def bracketed_rounds(
    plan: dict, has_zephon: bool, others: Callable[[int, int], list], measure: Callable[[str, int, int, int], None]
) -> None:
    """Each other contender runs between two zephon runs (Z X1 Z X2 Z ... Z), the order of the
    others reversed every round, so its ratio uses the zephon runs right before and after it and
    machine drift cancels. ``others(round, threads)`` lists the contenders of that pass."""
    for rnd in range(plan["rounds"]):
        for threads in plan["threads"]:
            xs = list(others(rnd, threads))
            if rnd % 2:
                xs = xs[::-1]
            slot = 0
            if has_zephon:
                measure("zephon", threads, rnd, slot)
            for c in xs:
                slot += 1
                measure(c, threads, rnd, slot)
                if has_zephon and plan.get("bracket", True):
                    slot += 1
                    measure("zephon", threads, rnd, slot)


class RssSampler:
    """Peak resident memory of this process plus all its children, sampled every 50 ms."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        total = 0
        try:
            total = self.proc.memory_info().rss
            for c in self.proc.children(recursive=True):
                with contextlib.suppress(Exception):
                    total += c.memory_info().rss
        except Exception:
            pass
        self.peak = max(self.peak, total)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._sample()

    def __enter__(self) -> RssSampler:
        self._sample()
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sample()
        self._stop.set()
        self._t.join()

    def cpu_s(self) -> float:
        """User + system CPU seconds of this process and its live children so far."""
        total = 0.0
        for p in [self.proc] + self.proc.children(recursive=True):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except Exception:
                pass
        return total


class Runner:
    """Runs one measurement: in a fresh Python process (``run.py --worker SPEC``: clean peak RSS,
    no leftover threads), or in this process through ``worker_main`` (the smoke size)."""

    def __init__(self, inprocess: bool, tmp: str, log, worker_main: Callable[[str], None]) -> None:
        self.inprocess, self.tmp, self.log, self.n = inprocess, tmp, log, 0
        self.worker_main = worker_main

    def call(self, spec: dict[str, Any], timeout: float = 900, prefix: list[str] | None = None) -> dict[str, Any]:
        self.n += 1
        spec = dict(spec, out=os.path.join(self.tmp, f"r{self.n}.json"))
        if self.inprocess and prefix is None:
            self.worker_main(json.dumps(spec))
        else:
            cmd = (prefix or []) + [sys.executable, os.path.join(HERE, "run.py"), "--worker", json.dumps(spec)]
            try:
                p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
            if not os.path.exists(spec["out"]):
                tail = (p.stderr or "")[-2000:]
                return {"ok": False, "error": f"worker exited with {p.returncode} and no result: {tail}"}
        with open(spec["out"]) as f:
            res = json.load(f)
        if not res["ok"]:
            self.log(f"    ! {res['error']}")
        return res


def available_mod(mod: str) -> str | None:
    """None if ``mod`` can be imported here, else why a contender that needs it is skipped."""
    try:
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    except ModuleNotFoundError:
        return f"{mod} is not installed"
    return None


#: the packages whose versions a results file records
BENCH_PACKAGES = (
    "zephon-loader",  # the distribution (the import name is zephon)
    "grain",
    "torch",
    "torchdata",
    "torchtitan",
    "tokenizers",
    "datasets",
    "numpy",
    "pillow",
    "matplotlib",
    "py-spy",
)


def versions(packages: Sequence[str] = BENCH_PACKAGES) -> dict[str, str]:
    """Python's version and each package's ("not installed" where it is missing)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for p in packages:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "not installed"
    return out


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        import psutil

        mem = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": mem,
        "platform": platform.platform(),
        "loadavg_start": os.getloadavg(),
    }


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def measured_parser(sizes: Sequence[str], out: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark that runs each measurement in its own process: ``--size``
    (the whole benchmark), ``--one KIND`` with ``--root`` and ``--steps`` (one measurement, what
    the benchmark spawns), ``--out`` (where results go); the benchmark adds its own."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="default", choices=sorted(sizes))
    ap.add_argument("--one", default=None)
    ap.add_argument("--root", default="")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--out", default=out)
    return ap
