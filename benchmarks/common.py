"""Pieces the text and vision halves of the benchmark share."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Sequence
from typing import Any


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
