"""The ``zephon`` command line's arguments: one sub-command per job, each option with its type
and help (the commands themselves run in :mod:`zephon.tools.cli`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from importlib import metadata
from typing import Any

__all__ = ["DISTRIBUTION", "STATE_FILE", "build_parser", "version_line"]

#: the state file `zephon hashes --save-at` writes and `--resume` reads in a folder
STATE_FILE = "zephon_state.json"


#: the name of zephon's distribution on the package index (``zephon`` there is another project);
#: the import name is ``zephon``
DISTRIBUTION = "zephon-loader"


def version_line() -> str:
    """``zephon VERSION``, the installed distribution's version (``zephon --version``)."""
    try:
        return f"zephon {metadata.version(DISTRIBUTION)}"
    except metadata.PackageNotFoundError:
        return f"zephon (not installed: no {DISTRIBUTION} distribution; run from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    """The ``zephon`` command line: one sub-command per job."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", help="on an error, print the tracebacks too (or set ZEPHON_DEBUG=1)"
    )
    parser = argparse.ArgumentParser(
        prog="zephon", description="Elastically deterministic data loading.", parents=[common]
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_demo_and_hashes(sub, common)
    _add_inspect(sub, common)
    _add_ledger(sub, common)
    _add_warm(sub, common)
    return parser


def _add_demo_and_hashes(sub: Any, common: argparse.ArgumentParser) -> None:
    d = sub.add_parser(
        "demo", help="run the bundled demo offline: decoded rows and hashes across world sizes", parents=[common]
    )
    d.add_argument("--root", default=None, help="where to generate the demo data (default ~/.cache/zephon/demo)")
    d.add_argument("--steps", type=_positive, default=6, help="global batches hashed per world size (default 6)")
    h = sub.add_parser("hashes", help="print `step <t> <sha256>` of every global batch", parents=[common])
    h.add_argument("recipe", help="the recipe TOML file")
    h.add_argument(
        "--world-size",
        type=_positive,
        default=1,
        help="data-parallel ranks simulated in this process (a divisor of the recipe's lanes; the hashes never change)",
    )
    h.add_argument(
        "--steps",
        type=_positive,
        default=10,
        help="global batches to compute (default 10); with --resume, that many MORE after the resumed step",
    )
    h.add_argument(
        "--workers",
        type=_count,
        default=None,
        help="worker count for every pool (default: the recipe's; never changes data)",
    )
    h.add_argument(
        "--backend",
        choices=["thread", "process"],
        default=None,
        help="worker backend (default: the recipe's; never changes the data)",
    )
    h.add_argument(
        "--save-at",
        type=_positive,
        default=None,
        help="save the lane-keyed state after this many steps (with --checkpoint); stderr says where",
    )
    h.add_argument("--checkpoint", default=None, help=f"folder --save-at writes {STATE_FILE} to (created if missing)")
    h.add_argument(
        "--resume",
        default=None,
        help="folder (or file) written by --save-at: continue after its step, on any valid world size",
    )
    h.add_argument(
        "--ledger",
        default=None,
        metavar="DIR",
        help="also write the batch ledger a training run on --world-size ranks writes (zephon ledger show DIR)",
    )
    h.add_argument(
        "--digest",
        choices=["batch", "ledger"],
        default="batch",
        help="batch: sha256 of the global batch; ledger: the digest a run's batch ledger records (zephon ledger)",
    )


def _add_inspect(sub: Any, common: argparse.ArgumentParser) -> None:
    i = sub.add_parser(
        "inspect", help="show the plan: datasets, token shares, lanes; --show N decoded rows", parents=[common]
    )
    i.add_argument("recipe", help="the recipe TOML file")
    i.add_argument("--show", type=_count, default=0, help="decode and print this many rows of the first batch")
    i.add_argument(
        "--world-size", type=_positive, default=None, help="show the lane map and memory of this many ranks (default 1)"
    )
    i.add_argument("--measure-steps", type=_positive, default=4, help="steps run to measure packing efficiency")
    i.add_argument("--warm-steps", type=_positive, default=100, help="steps whose share in the token cache is told")


def _add_warm(sub: Any, common: argparse.ArgumentParser) -> None:
    w = sub.add_parser(
        "warm", help="tokenize what a recipe reads into the token cache ($ZEPHON_TOKEN_CACHE)", parents=[common]
    )
    w.add_argument("recipe", help="the recipe TOML file")
    w.add_argument("--steps", type=_positive, default=None, help="only the next N steps, as the loader reads them")
    w.add_argument("--threads", type=_count, default=0, help="shards (or loader workers) at a time (default: CPUs)")
    w.add_argument("--ray", action="store_true", help="run as a Ray job, one task per shard (the `ray` extra)")
    w.add_argument("--address", default=None, help="the Ray cluster's address (default: a running or local one)")


def _add_ledger(sub: Any, common: argparse.ArgumentParser) -> None:
    led = sub.add_parser("ledger", help="batch ledgers: what a run consumed, per step (show, diff)", parents=[common])
    lsub = led.add_subparsers(dest="ledger_cmd", required=True)
    ls = lsub.add_parser(
        "show", help="print `step <t> <digest>` per global batch of a ledger (as hashes --digest ledger)"
    )
    ls.add_argument("ledger", help="a run's dump folder, or its zephon_ledger/ folder")
    ld = lsub.add_parser(
        "diff", help="compare two ledgers, a ledger and a recipe, or two recipes: first differing step, lanes, data"
    )
    ld.add_argument("a", help="ledger folder, dump folder or recipe .toml")
    ld.add_argument("b", help="ledger folder, dump folder or recipe .toml")
    ld.add_argument(
        "--steps", type=_positive, default=None, help="compare global batches 0..N-1 (two recipes: default 100)"
    )
    ld.add_argument(
        "--world-size", type=_positive, default=1, help="ranks a recipe side is computed with (never changes it)"
    )
    ld.add_argument(
        "--recipe-a", default=None, help="recipe of ledger A, to name documents (default: the one it names)"
    )
    ld.add_argument("--recipe-b", default=None, help="recipe of ledger B")


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, refused with a message otherwise."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {v}")
        return v

    return parse


_positive = _at_least(1)
_count = _at_least(0)
