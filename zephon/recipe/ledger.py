"""The batch ledger file format, and its writer: what a run consumed, one line per step.

A training loader (``zephon.integrations.torchtitan.ZephonDataLoader``) writes, in the run's dump folder, one
JSON-lines file per rank (``zephon_ledger/rank_00003.jsonl``). Each rank hashes only its own
lanes: a step's line holds the :func:`zephon.batch_sha256` of each of the rank's lane
micro-batches (every field, provenance included) and its tokens per dataset, so nothing
crosses ranks and the files of W ranks together cover all L lanes. The digest of global batch
``b`` is :func:`zephon.engine.ledger_digest` over the L lane digests in lane order; it does not
depend on W, and ``zephon hashes RECIPE --digest ledger`` prints the same digest for the same
step from the recipe alone, so a CPU can verify what a GPU job consumed. A resumed run appends
to the same files; a step done twice (a resume from an earlier checkpoint) keeps its latest
record, and a re-done step with other data is reported as a conflict.

Lines (``"v": 1``)::

    {"kind": "run", "recipe": path, "fingerprint": ..., "lanes": L, "datasets": [names],
     "world_size": W, "rank": r, "lane_range": [lo, hi], "start_batch": b, "time": t}
    {"kind": "step", "batch": b, "trainer_step": b + 1, "world_size": W, "rank": r,
     "lane_range": [lo, hi], "lane_digests": [hex, ...], "dataset_tokens": [[n_d, ...], ...], "time": t,
     "global_batch_size": G, "seq_len": S, "filtered": [{"rule/dataset": n, ...}, ...]}

``global_batch_size`` and ``seq_len``: the step's rows (all ranks) and row length, which a
``[[batch_schedule]]`` changes from a step on.

``filtered`` (only in runs of recipes with ``[[filters]]``): per lane, the documents its filters
dropped so far, per filter and dataset (non-zero counts), when it made the step's micro-batch.

``batch`` counts global batches from 0 (the numbering of ``zephon hashes``); TorchTitan's
trainer step that consumed it is ``batch + 1``.

Reading ledgers back and comparing two runs are tools (:mod:`zephon.tools.ledger`,
:mod:`zephon.tools.ledger_diff`); this module is what a training loader needs at run time.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import numpy as np

__all__ = ["LEDGER_DIR", "LEDGER_GLOB", "LEDGER_VERSION", "LedgerWriter", "dataset_tokens", "ledger_file"]

LEDGER_DIR = "zephon_ledger"  #: the ledger's sub-folder of a run's dump folder
LEDGER_GLOB = "rank_*.jsonl"  #: the files of a ledger folder, one per rank
LEDGER_VERSION = 1  #: the ``"v"`` of every line


def ledger_file(folder: str, rank: int) -> str:
    """The path of ``rank``'s file in a ledger folder.

    >>> ledger_file("zephon_ledger", 3)
    'zephon_ledger/rank_00003.jsonl'
    """
    return os.path.join(folder, f"rank_{rank:05d}.jsonl")


def dataset_tokens(dataset: np.ndarray, rows_per_lane: int, datasets: int) -> list[list[int]]:
    """Per lane (consecutive blocks of ``rows_per_lane`` rows), the non-padding tokens of each
    dataset (``dataset`` is the batch's per-token dataset index, -1 on padding).

    >>> ds = np.array([[0, 0, 1, -1], [1, 1, 1, 1]])
    >>> dataset_tokens(ds, 1, 2)
    [[2, 1], [0, 4]]
    """
    ds = np.asarray(dataset)
    out = []
    for lo in range(0, len(ds), rows_per_lane):
        part = ds[lo : lo + rows_per_lane].ravel()
        out.append(np.bincount(part[part >= 0].astype(np.int64), minlength=datasets).tolist())
    return out


class LedgerWriter:
    """One rank's ledger file, appended to (a resumed run continues the same file).

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> w = LedgerWriter(folder, rank=0, world_size=1, lane_range=range(2), recipe="r.toml", fingerprint="f",
    ...                  datasets=["web"])
    >>> w.write(0, ["ab" * 32, "cd" * 32], [[5], [7]])
    >>> w.close()
    >>> [json.loads(line)["kind"] for line in open(w.path)]
    ['run', 'step']
    """

    def __init__(
        self,
        folder: str,
        *,
        rank: int,
        world_size: int,
        lane_range: range,
        recipe: str,
        fingerprint: str,
        datasets: Sequence[str],
        lanes: int | None = None,
    ) -> None:
        os.makedirs(folder, exist_ok=True)
        self.path = ledger_file(folder, rank)
        self.rank, self.world_size, self.lane_range = rank, world_size, lane_range
        self._head = {
            "v": LEDGER_VERSION,
            "kind": "run",
            "recipe": recipe,
            "fingerprint": fingerprint,
            "lanes": lanes if lanes is not None else lane_range.stop - lane_range.start,
            "datasets": list(datasets),
            "world_size": world_size,
            "rank": rank,
            "lane_range": [lane_range.start, lane_range.stop],
        }
        self._f: TextIO | None = None

    def write(
        self,
        batch: int,
        lane_digests: Sequence[str],
        tokens: Sequence[Sequence[int]],
        filtered: Sequence[Mapping[str, int]] | None = None,
        shape: tuple[int, int] | None = None,
    ) -> None:
        """Record global batch ``batch`` (0-based): this rank's lane digests and tokens per
        dataset, its lanes' filtered documents (recorded when any lane has some), and ``shape``,
        the step's ``(global_batch_size, seq_len)`` (a ``[[batch_schedule]]`` changes them)."""
        if len(lane_digests) != len(self.lane_range):
            raise ValueError(f"rank {self.rank} owns {len(self.lane_range)} lanes, got {len(lane_digests)} digests")
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")
            self._line(dict(self._head, start_batch=int(batch), time=round(time.time(), 3)))
        extra: dict[str, Any] = {"filtered": [dict(f) for f in filtered]} if filtered and any(filtered) else {}
        if shape is not None:
            extra["global_batch_size"], extra["seq_len"] = int(shape[0]), int(shape[1])
        self._line(
            {
                "v": LEDGER_VERSION,
                "kind": "step",
                "batch": int(batch),
                "trainer_step": int(batch) + 1,
                "world_size": self.world_size,
                "rank": self.rank,
                "lane_range": [self.lane_range.start, self.lane_range.stop],
                "lane_digests": list(lane_digests),
                "dataset_tokens": [list(map(int, t)) for t in tokens],
                "time": round(time.time(), 6),
                **extra,
            }
        )

    def _line(self, record: dict[str, Any]) -> None:
        assert self._f is not None
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file (idempotent); the next write reopens it and appends."""
        if self._f is not None:
            self._f.close()
            self._f = None
