"""The ``zephon`` command line."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import List, Optional

__all__ = ["main"]


def _toy_demo(steps: int = 6, lanes: int = 8) -> int:
    from zephon import GlobalLoader, WorkerConfig, batch_sha256, decode_state, encode_state
    from zephon.testing import toy_lane

    lane = functools.partial(toy_lane, n=None)
    print(f"synthetic pipeline: {lanes} lanes, range source -> ordered map -> toy packer -> shuffle -> batch")
    table = {}
    for world in (1, 2, 4, 8):
        for workers in (WorkerConfig(0), WorkerConfig(2, "thread")):
            with GlobalLoader(lane, lanes=lanes, world_size=world, seed=1234, workers=workers) as g:
                table[(world, workers.count)] = [batch_sha256(next(g))[:12] for _ in range(steps)]
    # save at W=4 after 3 steps, resume at W=2
    with GlobalLoader(lane, lanes=lanes, world_size=4, seed=1234) as g:
        first = [batch_sha256(next(g))[:12] for _ in range(3)]
        state = decode_state(encode_state(g.state_dict()))
    with GlobalLoader(lane, lanes=lanes, world_size=2, seed=1234) as g:
        g.load_state_dict(state)
        table[("4->2", 0)] = first + [batch_sha256(next(g))[:12] for _ in range(steps - 3)]
    print(f"{'world':>6} {'workers':>7}  " + " ".join(f"step{t:<8}" for t in range(steps)))
    for (world, count), hs in table.items():
        print(f"{world!s:>6} {count:>7}  " + " ".join(hs))
    same = len({tuple(h) for h in table.values()}) == 1
    print("identical global batches across world sizes, workers and resume:", "YES" if same else "NO")
    return 0 if same else 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="zephon", description="Elastically deterministic data loading.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="run the bundled demo offline and show that hashes match across world sizes")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        return _toy_demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
