"""Ledgers read back: a ledger folder, or the same record computed from a recipe.

The file format and its writer are :mod:`zephon.recipe.ledger` (a training loader writes one
file per rank). :class:`Ledger` is a folder read back (per global batch and lane, the latest
record, with conflicts noted); :class:`RecipeSteps` computes the same record from a recipe on
this machine, so a CPU can check what a GPU job consumed. ``zephon ledger show`` prints the
digests; :mod:`zephon.tools.ledger_diff` compares two sources.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from zephon.data import DataError
from zephon.engine import StateError
from zephon.engine.digest import ledger_digest
from zephon.recipe import Recipe, RecipeError
from zephon.recipe.ledger import LEDGER_DIR, LEDGER_GLOB, LEDGER_VERSION, LedgerWriter, dataset_tokens

__all__ = [
    "Ledger",
    "RecipeSteps",
    "Source",
    "find_ledger",
    "lane_documents",
    "ledger_writers",
    "open_source",
    "read_ledger",
    "run_ledger_show",
    "write_ledgers",
]


@dataclass
class _LaneEntry:
    digest: str
    tokens: list[int]
    time: float
    where: str
    filtered: dict[str, int] = field(default_factory=dict)


@dataclass
class Ledger:
    """A ledger folder read back: per global batch and lane, the latest record."""

    path: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    entries: dict[int, dict[int, _LaneEntry]] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)

    @property
    def lanes(self) -> int:
        """The run's lane count (from its run records)."""
        counts = {int(r["lanes"]) for r in self.runs}
        if len(counts) != 1:
            raise ValueError(f"{self.path}: the ledger's runs have lane counts {sorted(counts)}")
        return counts.pop()

    @property
    def datasets(self) -> list[str]:
        """Dataset names of the (latest) run."""
        return list(self.runs[-1]["datasets"]) if self.runs else []

    @property
    def fingerprints(self) -> list[str]:
        """The recipe fingerprints of the runs that wrote the ledger, in order of first use."""
        out: list[str] = []
        for r in self.runs:
            if r["fingerprint"] not in out:
                out.append(r["fingerprint"])
        return out

    def batches(self) -> list[int]:
        """Global batches with every lane recorded, ascending."""
        L = self.lanes
        return sorted(b for b, lanes in self.entries.items() if len(lanes) == L)

    def incomplete(self) -> list[int]:
        """Global batches with some lanes missing (a rank's file lost, or a run killed mid-write)."""
        L = self.lanes
        return sorted(b for b, lanes in self.entries.items() if len(lanes) != L)

    def lane_digests(self, batch: int) -> list[str] | None:
        """The L lane digests of ``batch`` in lane order (None if incomplete or absent)."""
        lanes = self.entries.get(batch, {})
        if len(lanes) != self.lanes:
            return None
        return [lanes[l].digest for l in range(self.lanes)]

    def digest(self, batch: int) -> str | None:
        """:func:`zephon.engine.digest.ledger_digest` of ``batch`` (what ``zephon hashes --digest ledger`` prints)."""
        d = self.lane_digests(batch)
        return None if d is None else ledger_digest(d)

    def tokens(self, batch: int, lane: int) -> list[int] | None:
        """Tokens per dataset of ``lane``'s micro-batch at ``batch``."""
        e = self.entries.get(batch, {}).get(lane)
        return None if e is None else e.tokens

    def filtered(self, batch: int, lane: int) -> dict[str, int] | None:
        """Documents ``lane``'s filters had dropped by ``batch``, per ``"filter/dataset"``."""
        e = self.entries.get(batch, {}).get(lane)
        return None if e is None else e.filtered

    def recipe(self) -> Recipe | None:
        """The recipe the latest run names, if it is there and still has the fingerprint."""
        if not self.runs:
            return None
        path, fp = self.runs[-1].get("recipe"), self.runs[-1].get("fingerprint")
        if not path or not os.path.exists(path):
            return None
        try:
            r = Recipe.from_toml(path)
            return r if r.fingerprint == fp else None
        except (RecipeError, StateError, DataError, OSError, ValueError):
            return None


def find_ledger(path: str) -> str | None:
    """The ledger folder at ``path``: the folder itself (it has ``rank_*.jsonl``), or its
    ``zephon_ledger`` sub-folder (a run's dump folder); None if neither."""
    for folder in (path, os.path.join(path, LEDGER_DIR)):
        if os.path.isdir(folder) and glob.glob(os.path.join(folder, LEDGER_GLOB)):
            return folder
    return None


def read_ledger(path: str) -> Ledger:
    """Read every rank's file of a ledger folder (or a dump folder holding ``zephon_ledger/``)."""
    folder = find_ledger(path)
    if folder is None:
        raise ValueError(f"{path!r} holds no ledger (no rank_*.jsonl files, nor a {LEDGER_DIR}/ folder with them)")
    out = Ledger(folder)
    for file in sorted(glob.glob(os.path.join(folder, LEDGER_GLOB))):
        with open(file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    out.conflicts.append(f"{os.path.basename(file)}:{n}: not JSON (a line cut short by a crash?)")
                    continue
                if rec.get("v") != LEDGER_VERSION:
                    raise ValueError(f"{file}:{n}: ledger version {rec.get('v')!r}, this zephon reads {LEDGER_VERSION}")
                if rec["kind"] == "run":
                    out.runs.append(rec)
                    continue
                lo, hi = rec["lane_range"]
                b = int(rec["batch"])
                lanes = out.entries.setdefault(b, {})
                filtered = rec.get("filtered") or [{}] * (hi - lo)
                for j, lane in enumerate(range(lo, hi)):
                    e = _LaneEntry(
                        rec["lane_digests"][j],
                        rec["dataset_tokens"][j],
                        rec["time"],
                        f"{os.path.basename(file)}:{n}",
                        dict(filtered[j]),
                    )
                    old = lanes.get(lane)
                    if old is not None and old.digest != e.digest:
                        out.conflicts.append(
                            f"global batch {b} lane {lane} was recorded twice with different data "
                            f"({old.where} and {e.where}): a resumed run re-did the step on other data"
                        )
                    if old is None or e.time >= old.time:
                        lanes[lane] = e
    out.runs.sort(key=lambda r: r.get("time", 0))
    if not out.runs:
        raise ValueError(f"{folder}: the ledger files hold no run record")
    return out


class RecipeSteps:
    """The same record a ledger holds, computed from a recipe on this machine: per global batch,
    the lane digests and tokens per dataset (computed in order on first use, kept)."""

    def __init__(self, recipe: Recipe, world_size: int = 1, workers: Any = None) -> None:
        self.recipe, self.world_size, self.workers = recipe, world_size, workers
        self.path = os.path.join(recipe.base_dir, "(recipe)")
        self._digests: list[list[str]] = []
        self._tokens: list[list[list[int]]] = []
        self._filtered: list[list[dict[str, int]]] = []
        self._loader: Any = None
        self.ended_after: int | None = None  # batches the recipe holds, once its end was reached

    @property
    def lanes(self) -> int:
        """The recipe's lane count."""
        return self.recipe.lanes

    @property
    def datasets(self) -> list[str]:
        """The recipe's dataset names."""
        return [d.name for d in self.recipe.datasets]

    def _advance(self, batch: int) -> bool:
        if self._loader is None:
            self._loader = self.recipe.global_loader(self.world_size, workers=self.workers, digests=True)
        while len(self._digests) <= batch:
            if self.ended_after is not None:
                return False
            try:
                b = next(self._loader)
            except StopIteration:
                self.ended_after = len(self._digests)
                self.close()
                return False
            lanes: list[str] = []
            counts: list[dict[str, int]] = []
            for r in self._loader.routers:
                lanes.extend(r.last_lane_digests)
                counts.extend(r.last_lane_counts)
            self._digests.append(lanes)
            self._filtered.append(counts)
            rows = self.recipe.rows_per_lane_at(len(self._tokens))
            self._tokens.append(dataset_tokens(b["dataset"], rows, len(self.recipe.datasets)))
        return True

    def lane_digests(self, batch: int) -> list[str] | None:
        """The L lane digests of ``batch`` (None past the end of a finite recipe)."""
        return self._digests[batch] if self._advance(batch) else None

    def digest(self, batch: int) -> str | None:
        """The ledger digest of ``batch``."""
        d = self.lane_digests(batch)
        return None if d is None else ledger_digest(d)

    def tokens(self, batch: int, lane: int) -> list[int] | None:
        """Tokens per dataset of ``lane``'s micro-batch at ``batch``."""
        return self._tokens[batch][lane] if self._advance(batch) else None

    def filtered(self, batch: int, lane: int) -> dict[str, int] | None:
        """Documents ``lane``'s filters had dropped by ``batch``, per ``"filter/dataset"``."""
        return self._filtered[batch][lane] if self._advance(batch) else None

    def close(self) -> None:
        """Stop the loader (idempotent)."""
        if self._loader is not None:
            self._loader.close()
            self._loader = None


def lane_documents(recipe: Recipe, batch: int, lane: int) -> set[tuple[int, int, int, int, int, int]]:
    """The segments of ``lane``'s micro-batch at global batch ``batch`` of ``recipe``, from its
    provenance: ``(dataset, shard, record, epoch, tok_start, tok_end)`` per document piece
    (regenerated by running that one lane to the batch)."""
    router = recipe.router(world_size=recipe.lanes, rank=lane, prefetch=0)
    try:
        mb = None
        for _ in range(batch + 1):
            mb = next(router)
    except StopIteration:
        return set()
    finally:
        router.close()
    assert mb is not None
    return {tuple(int(v) for v in seg) for row in mb["provenance"] for seg in row}  # type: ignore[misc]


Source = Any  # a Ledger or a RecipeSteps


def open_source(path: str, world_size: int = 1) -> Source:
    """A ledger folder (or a dump folder with ``zephon_ledger/``), or a recipe TOML."""
    if os.path.isdir(path):
        return read_ledger(path)
    if path.endswith(".toml") and os.path.isfile(path):
        return RecipeSteps(Recipe.from_toml(path), world_size)
    raise ValueError(f"{path!r} is neither a ledger folder, a dump folder with {LEDGER_DIR}/, nor a recipe .toml")


def _span(batches: Sequence[int]) -> str:
    return f"{batches[0]}..{batches[-1]}" if batches else "none"


def _lanes(lanes: Sequence[int]) -> str:
    return ", ".join(map(str, lanes[:16])) + (" ..." if len(lanes) > 16 else "")


def run_ledger_show(path: str, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print ``step <batch> <digest>`` for every complete global batch of a ledger (the lines
    ``zephon hashes --digest ledger`` prints for the same steps); warnings on stderr."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    led = read_ledger(path)
    for b in led.batches():
        print(f"step {b} {led.digest(b)}", file=out)
    for note in led.conflicts:
        print(f"zephon ledger: warning: {note}", file=err)
    if led.incomplete():
        print(f"zephon ledger: warning: global batches with lanes missing: {_lanes(led.incomplete())}", file=err)
    if len(led.fingerprints) > 1:
        print(f"zephon ledger: warning: the runs used {len(led.fingerprints)} different recipes", file=err)
    return 0


def ledger_writers(recipe: Recipe, world_size: int, folder: str, recipe_path: str) -> list[LedgerWriter]:
    """One ledger writer per rank, as a training run on ``world_size`` ranks has (``zephon hashes --ledger``)."""
    per = recipe.lanes // world_size
    names = [d.name for d in recipe.datasets]
    src = os.path.abspath(recipe_path) if recipe_path else "<recipe>"
    return [
        LedgerWriter(
            folder,
            rank=r,
            world_size=world_size,
            lane_range=range(r * per, (r + 1) * per),
            lanes=recipe.lanes,
            recipe=src,
            fingerprint=recipe.fingerprint,
            datasets=names,
        )
        for r in range(world_size)
    ]


def write_ledgers(
    writers: list[LedgerWriter],
    recipe: Recipe,
    t: int,
    digests: list[str],
    batch: Any,
    filtered: list[dict[str, int]] | None = None,
) -> None:
    """Global batch ``t``'s line in each rank's ledger: its lanes' digests, tokens per dataset
    and filtered documents."""
    if not writers:
        return
    tokens = dataset_tokens(batch["dataset"], recipe.rows_per_lane_at(t), len(recipe.datasets))
    shape = (recipe.global_batch_size_at(t), recipe.seq_len_at(t))
    for w in writers:
        lo, hi = w.lane_range.start, w.lane_range.stop
        w.write(t, digests[lo:hi], tokens[lo:hi], None if filtered is None else filtered[lo:hi], shape)
