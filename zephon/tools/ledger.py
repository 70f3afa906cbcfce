"""The batch ledger: what a run consumed, one line per step, and how two runs compare.

A training loader (``zephon.integrations.torchtitan.ZephonDataLoader``) writes, in the run's dump folder, one
JSON-lines file per rank (``zephon_ledger/rank_00003.jsonl``). Each rank hashes only its own
lanes: a step's line holds the :func:`zephon.batch_sha256` of each of the rank's lane
micro-batches (every field, provenance included) and its tokens per dataset, so nothing
crosses ranks and the files of W ranks together cover all L lanes. The digest of global batch
``b`` is :func:`zephon.engine.digest.ledger_digest` over the L lane digests in lane order; it does not
depend on W, and ``zephon hashes RECIPE --digest ledger`` prints the same digest for the same
step from the recipe alone, so a CPU can verify what a GPU job consumed. A resumed run appends
to the same files; a step done twice (a resume from an earlier checkpoint) keeps its latest
record, and a re-done step with other data is reported as a conflict.

Lines (``"v": 1``)::

    {"kind": "run", "recipe": path, "fingerprint": ..., "lanes": L, "datasets": [names],
     "world_size": W, "rank": r, "lane_range": [lo, hi], "start_batch": b, "time": t}
    {"kind": "step", "batch": b, "trainer_step": b + 1, "world_size": W, "rank": r,
     "lane_range": [lo, hi], "lane_digests": [hex, ...], "dataset_tokens": [[n_d, ...], ...], "time": t}

``batch`` counts global batches from 0 (the numbering of ``zephon hashes``); TorchTitan's
trainer step that consumed it is ``batch + 1``.

:func:`diff` compares two ledgers, or a ledger and a recipe, or two recipes: the first
differing global batch, the lanes that differ, and, through the recipes' provenance, which
datasets and which documents differ (``zephon ledger diff A B``).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from zephon.data import DataError
from zephon.engine import StateError
from zephon.engine.digest import ledger_digest
from zephon.recipe import Recipe, RecipeError

__all__ = [
    "LEDGER_DIR",
    "LEDGER_VERSION",
    "Ledger",
    "LedgerDiff",
    "LedgerWriter",
    "RecipeSteps",
    "dataset_tokens",
    "diff",
    "find_ledger",
    "lane_documents",
    "open_source",
    "read_ledger",
    "recipe_differences",
    "run_ledger_diff",
    "run_ledger_show",
]

LEDGER_DIR = "zephon_ledger"
LEDGER_VERSION = 1


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
    >>> read_ledger(folder).lane_digests(0) == ["ab" * 32, "cd" * 32]
    True
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
        self.path = os.path.join(folder, f"rank_{rank:05d}.jsonl")
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

    def write(self, batch: int, lane_digests: Sequence[str], tokens: Sequence[Sequence[int]]) -> None:
        """Record global batch ``batch`` (0-based): this rank's lane digests and tokens per dataset."""
        if len(lane_digests) != len(self.lane_range):
            raise ValueError(f"rank {self.rank} owns {len(self.lane_range)} lanes, got {len(lane_digests)} digests")
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")
            self._line(dict(self._head, start_batch=int(batch), time=round(time.time(), 3)))
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


@dataclass
class _LaneEntry:
    digest: str
    tokens: list[int]
    time: float
    where: str


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
        if os.path.isdir(folder) and glob.glob(os.path.join(folder, "rank_*.jsonl")):
            return folder
    return None


def read_ledger(path: str) -> Ledger:
    """Read every rank's file of a ledger folder (or a dump folder holding ``zephon_ledger/``)."""
    folder = find_ledger(path)
    if folder is None:
        raise ValueError(f"{path!r} holds no ledger (no rank_*.jsonl files, nor a {LEDGER_DIR}/ folder with them)")
    out = Ledger(folder)
    for file in sorted(glob.glob(os.path.join(folder, "rank_*.jsonl"))):
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
                for j, lane in enumerate(range(lo, hi)):
                    e = _LaneEntry(
                        rec["lane_digests"][j], rec["dataset_tokens"][j], rec["time"], f"{os.path.basename(file)}:{n}"
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
            for r in self._loader.routers:
                lanes.extend(r.last_lane_digests)
            self._digests.append(lanes)
            self._tokens.append(dataset_tokens(b["dataset"], self.recipe.rows_per_lane, len(self.recipe.datasets)))
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


def _recipe_of(src: Source, override: str | None) -> Recipe | None:
    if override:
        return Recipe.from_toml(override)
    if isinstance(src, RecipeSteps):
        return src.recipe
    return src.recipe()


@dataclass
class LedgerDiff:
    """What :func:`diff` found."""

    compared: int = 0
    differing: int = 0
    first: int | None = None
    lanes: list[int] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    only_in: str | None = None  # "a" / "b": batches one side has and the other does not

    @property
    def same(self) -> bool:
        """Whether every compared global batch is identical."""
        return self.differing == 0 and self.only_in is None


def _batches(src: Source, steps: int | None) -> list[int] | None:
    if isinstance(src, Ledger):
        got = src.batches()
        return got if steps is None else [b for b in got if b < steps]
    return None


def diff(
    a: Source,
    b: Source,
    *,
    steps: int | None = None,
    recipe_a: str | None = None,
    recipe_b: str | None = None,
    max_lanes: int = 4,
    max_documents: int = 5,
) -> LedgerDiff:
    """Compare two sources (ledgers or recipes) global batch by global batch.

    Reports the first differing batch, its differing lanes, the datasets whose tokens differ in
    them and, where a recipe is available for a side (a recipe source, ``recipe_a`` /
    ``recipe_b``, or the recipe a ledger's run names, if unchanged), the documents that are in
    one side's lane micro-batch and not the other's. Two recipes are compared over ``steps``
    batches (default 100, or to the end of a finite one)."""
    if a.lanes != b.lanes:
        raise ValueError(f"the two sides have different lane counts ({a.lanes} vs {b.lanes}): nothing lines up")
    out = LedgerDiff()
    ba, bb = _batches(a, steps), _batches(b, steps)
    if ba is not None and bb is not None:
        common = sorted(set(ba) & set(bb))
        if set(ba) != set(bb):
            out.only_in = "a" if set(ba) - set(bb) else "b"
            out.lines.append(f"batches recorded: A {_span(ba)}, B {_span(bb)}; comparing the {len(common)} both hold")
    else:
        common = ba if ba is not None else bb if bb is not None else list(range(100 if steps is None else steps))
    for t in common:
        da, db = a.lane_digests(t), b.lane_digests(t)
        if da is None or db is None:
            side = "A" if da is None else "B"
            out.lines.append(f"{side} ends before global batch {t} (its data ended after {t} batches)")
            out.only_in = "b" if da is None else "a"
            break
        out.compared += 1
        if da == db:
            continue
        out.differing += 1
        if out.first is None:
            out.first = t
            out.lanes = [l for l in range(a.lanes) if da[l] != db[l]]
    if out.first is None:
        return out
    t = out.first
    names = a.datasets if a.datasets == b.datasets else [f"{x}|{y}" for x, y in zip(a.datasets, b.datasets)]
    changed: set[str] = set()
    ra, rb = _recipe_of(a, recipe_a), _recipe_of(b, recipe_b)
    lines = [
        f"first differing global batch: {t} (trainer step {t + 1})",
        f"lanes that differ there: {_lanes(out.lanes)} ({len(out.lanes)} of {a.lanes})",
    ]
    if ra is not None and rb is not None:
        lines.extend(f"recipe difference: {d}" for d in recipe_differences(ra, rb))
    for lane in out.lanes[:max_lanes]:
        ta, tb = a.tokens(t, lane), b.tokens(t, lane)
        parts = []
        for d, name in enumerate(names):
            x = ta[d] if ta is not None and d < len(ta) else None
            y = tb[d] if tb is not None and d < len(tb) else None
            if x != y:
                changed.add(name)
            delta = f" ({y - x:+d})" if isinstance(x, int) and isinstance(y, int) and x != y else ""
            parts.append(f"{name} {x}/{y}{delta}")
        lines.append(f"  lane {lane}: tokens per dataset (A/B): " + ", ".join(parts))
        if ra is None or rb is None:
            missing = "A" if ra is None else "B"
            lines.append(
                f"    documents: no recipe for {missing} (pass --recipe-{missing.lower()} RECIPE to name the documents)"
            )
            continue
        docs_a, docs_b = lane_documents(ra, t, lane), lane_documents(rb, t, lane)
        for side, mine, theirs, recipe in (("A", docs_a, docs_b, ra), ("B", docs_b, docs_a, rb)):
            only = _by_document(mine - theirs)
            for doc in only:
                changed.add(recipe.datasets[doc[0]].name)
            if only:
                shown = ", ".join(_document(recipe, doc, spans) for doc, spans in list(only.items())[:max_documents])
                more = f" and {len(only) - max_documents} more" if len(only) > max_documents else ""
                lines.append(f"    only in {side}: {shown}{more}")
    out.datasets = sorted(changed)
    lines.append(f"datasets that differ: {', '.join(out.datasets) or '(none by tokens: same mix, other documents)'}")
    out.lines = lines + out.lines
    return out


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def recipe_differences(a: Recipe, b: Recipe) -> list[str]:
    """What differs between two recipes' data definitions (``key: A -> B``, datasets by name),
    and which datasets' files or which tokenizer differ (from their fingerprints).

    >>> from zephon.tools.demo import demo_recipe
    >>> import tempfile
    >>> r = demo_recipe(tempfile.mkdtemp(), scale=0.01)
    >>> recipe_differences(r, r.replace(seed=5))
    ['seed: 1234 -> 5']
    """

    def flat(r: Recipe) -> dict[str, Any]:
        d = dict(r.data_definition())
        d["datasets"] = {s.pop("name"): s for s in (dict(x) for x in d["datasets"])}
        names = [s.name for s in r.datasets]  # schedule phases by dataset name (phase 0 = the weights above)
        d["schedule"] = {str(step): dict(zip(names, w)) for step, w in d["schedule"] if step > 0}
        return _flatten(d)

    fa, fb = flat(a), flat(b)
    absent = object()

    def show(v: Any) -> str:
        return "(absent)" if v is absent else repr(v) if isinstance(v, str) else str(v)

    keys = sorted(k for k in set(fa) | set(fb) if fa.get(k, absent) != fb.get(k, absent))
    out = [f"{k}: {show(fa.get(k, absent))} -> {show(fb.get(k, absent))}" for k in keys]
    sa, sb = a.prepare().shared_state(), b.prepare().shared_state()
    for name in sorted(set(sa["data"]) & set(sb["data"])):
        if sa["data"][name] != sb["data"][name]:
            out.append(
                f"the files of dataset {name!r} differ (index fingerprints {sa['data'][name]} vs {sb['data'][name]})"
            )
    if sa["tokenizer"] != sb["tokenizer"]:
        out.append("the tokenizers differ")
    return out


def _by_document(segments: AbstractSet[tuple[int, ...]]) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """Segments grouped by document ``(dataset, shard, record, epoch)``, their token ranges merged
    where they touch (a document packed across two rows of a micro-batch is one entry)."""
    out: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for seg in sorted(segments):
        spans = out.setdefault(tuple(seg[:4]), [])
        if spans and spans[-1][1] == seg[4]:
            spans[-1] = (spans[-1][0], seg[5])
        else:
            spans.append((seg[4], seg[5]))
    return out


def _document(recipe: Recipe, doc: tuple[int, ...], spans: Sequence[tuple[int, int]]) -> str:
    d, shard, record, epoch = doc
    name = recipe.datasets[d].name
    tokens = ", ".join(f"{a}:{b}" for a, b in spans)
    if shard < 0:
        return f"{name} (tokens {tokens})"
    loc = recipe.indexes[d].locate(shard, record)
    return f"{name} {os.path.basename(loc['file'])} {loc['locator']} (epoch {epoch}, tokens {tokens})"


def _span(batches: Sequence[int]) -> str:
    return f"{batches[0]}..{batches[-1]}" if batches else "none"


def _lanes(lanes: Sequence[int]) -> str:
    return ", ".join(map(str, lanes[:16])) + (" ..." if len(lanes) > 16 else "")


def _describe(path: str, src: Source) -> str:
    if isinstance(src, Ledger):
        runs = len(src.runs)
        return (
            f"{path}: ledger, global batches {_span(src.batches())}, {runs} run(s), recipe {src.runs[-1].get('recipe')}"
        )
    return f"{path}: recipe, computed here on {src.world_size} rank(s)"


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


def run_ledger_diff(
    a: str,
    b: str,
    *,
    steps: int | None = None,
    world_size: int = 1,
    recipe_a: str | None = None,
    recipe_b: str | None = None,
    out: TextIO | None = None,
) -> int:
    """``zephon ledger diff A B``: exit status 0 when every compared batch is identical, 1 when
    they differ."""
    out = sys.stdout if out is None else out
    sa, sb = open_source(a, world_size), open_source(b, world_size)
    try:
        print("A = " + _describe(a, sa), file=out)
        print("B = " + _describe(b, sb), file=out)
        d = diff(sa, sb, steps=steps, recipe_a=recipe_a, recipe_b=recipe_b)
    finally:
        for s in (sa, sb):
            if isinstance(s, RecipeSteps):
                s.close()
    for line in d.lines:
        print(line, file=out)
    verdict = "identical" if d.differing == 0 else f"{d.differing} differ"
    print(f"global batches compared: {d.compared}, {verdict}", file=out)
    return 0 if d.same else 1
