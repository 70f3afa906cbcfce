"""Lanes: a run's fixed set of independent pipelines, and which rank owns which.

A run has a fixed number L of lanes. Each lane is a pipeline built from a pure description (a
function of a :class:`LaneContext`) and owns its work, operator state and random streams, so
its output depends only on (recipe, seed, L, lane id). Rank r of W owns the contiguous lanes
``[r*L/W, (r+1)*L/W)`` (:func:`lanes_of_rank`, the one owner of that arithmetic) and its local
batch at step t is their step-t outputs in lane order; global batch t is therefore the same
bytes for every W that divides L. A :class:`LaneSet` says how the lanes are built, which values
derived at start travel in the checkpoint, and where a finite run ends (:mod:`.end`); the
:mod:`.router` merges one rank's lanes.
"""

from __future__ import annotations

import copy
import math
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from .end import END_MODES, LaneEnd
from .node import PipelineError, StateError, close_node
from .seeding import lane_rng
from .workers import PoolSet, WorkerConfig, WorkerPool

__all__ = [
    "LaneBuilder",
    "LaneContext",
    "LaneMigration",
    "LaneSet",
    "check_world_size",
    "count_lane_steps",
    "divisors",
    "lanes_of_rank",
]


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (valid world sizes, valid micro-batch sizes).

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def check_world_size(lanes: int, world_size: int) -> None:
    """Refuse a world size that does not divide the lane count, listing the valid ones."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if lanes % world_size:
        raise ValueError(
            f"{lanes} lanes cannot be split over {world_size} data-parallel ranks: the world size must "
            f"divide the lane count. Valid world sizes for lanes = {lanes}: {divisors(lanes)}. "
            "The lane count is fixed for the life of a run; choose it up front as a multiple of every "
            "DP size you may use (e.g. 64 or 256)."
        )


def lanes_of_rank(lanes: int, world_size: int, rank: int) -> range:
    """The contiguous block of lanes rank ``rank`` of ``world_size`` owns.

    >>> lanes_of_rank(16, 4, 1)
    range(4, 8)
    """
    check_world_size(lanes, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    per = lanes // world_size
    return range(rank * per, (rank + 1) * per)


@dataclass
class LaneContext:
    """What a lane's pipeline builder gets: its identity, seed and the rank's shared pools."""

    seed: int
    lane: int
    lanes: int
    workers: WorkerConfig = field(default_factory=WorkerConfig)
    pools: PoolSet = field(default_factory=PoolSet)
    lanes_on_rank: int = 1

    def rng(self, op: str, epoch: int = 0, counter: int = 0) -> np.random.Generator:
        """This lane's random stream for (operator, epoch, counter)."""
        return lane_rng(self.seed, self.lane, op, epoch, counter)

    def pool(self, config: WorkerConfig | None = None) -> WorkerPool | None:
        """The rank's shared pool for ``config`` (default: the recipe's workers); None = inline."""
        return self.pools.get(config or self.workers)

    def max_in_flight(self, config: WorkerConfig | None = None, per_worker: int = 16) -> int:
        """Per-lane pending tasks: the lane being pulled keeps every worker of the shared pool busy
        (two chunks per worker, so a worker never idles while the consumer collects a result),
        capped so that all the lanes of a rank together hold about ``per_worker`` chunks per
        worker (results held in flight are memory: the vision path passes fewer).

        Lanes are pulled one at a time (a shuffle window refills many chunks of one lane), so a
        budget split evenly over lanes left workers idle: measured 88% busy at 2 workers and
        8 lanes with 2 chunks per lane, 99% with 4. With many lanes (at least 4 per worker) one
        chunk per lane is enough: the pool runs the chunk a lane waits for first (demand-first),
        and the other lanes' chunks keep the workers busy meanwhile; two per lane queued 512
        chunks at 256 lanes (2,048 at 1,024) before the first batch.

        >>> ctx = LaneContext(seed=0, lane=0, lanes=256, lanes_on_rank=256)
        >>> ctx.max_in_flight(WorkerConfig(2)), LaneContext(0, 0, 8, lanes_on_rank=8).max_in_flight(WorkerConfig(2))
        (1, 4)
        """
        count = (config or self.workers).count
        if count == 0:
            return 1
        floor = 1 if self.lanes_on_rank >= 4 * count else 2
        return max(floor, min(2 * count, math.ceil(per_worker * count / max(1, self.lanes_on_rank))))


LaneBuilder = Callable[[LaneContext], BaseNode]
LaneMigration = Callable[[dict[str, Any]], dict[str, Any]]


def count_lane_steps(
    build: LaneBuilder,
    *,
    lanes: int,
    seed: int,
    workers: WorkerConfig | None = None,
    pools: PoolSet | None = None,
    progress: bool | None = None,
) -> list[int]:
    """How many micro-batches each lane of a finite pipeline holds: a dry run of every lane
    (built, iterated to its end, closed), with the given workers and shared pools.

    Exact whatever the pipeline does (skips, packing, splits, schedules): the count is what the
    lane delivers. It costs a pass over the data, so callers cache it (a recipe does, keyed by
    its data fingerprint). ``progress``: a progress bar (default: when stderr is a terminal).

    >>> import functools
    >>> from zephon.engine.testing import toy_lane
    >>> count_lane_steps(functools.partial(toy_lane, n=40), lanes=4, seed=0)
    [4, 5, 4, 4]
    """
    workers = workers or WorkerConfig()
    own = pools is None
    pools = pools if pools is not None else PoolSet()
    ids: Any = range(lanes)
    if progress or (progress is None and sys.stderr.isatty() and lanes >= 8):
        from tqdm.std import tqdm

        ids = tqdm(ids, desc="counting the micro-batches of each lane (one pass over the data)", unit="lane")
    out = []
    try:
        for l in ids:
            node = build(LaneContext(seed=seed, lane=l, lanes=lanes, workers=workers, pools=pools))
            n = 0
            try:
                node.reset(None)
                while True:
                    try:
                        next(node)
                    except StopIteration:
                        break
                    n += 1
            finally:
                close_node(node)
            out.append(n)
    finally:
        if own:
            pools.close()
    return out


class LaneSet:
    """How a run builds its lanes, and the rank-independent values they are built from.

    Why: a pipeline may derive values when it starts (a recipe measures tokens per byte to plan
    its mixture). Those values are data: a resumed run must use the ones the checkpoint was made
    with, not re-derive them. A lane set saves them in every checkpoint (:meth:`shared_state`)
    and on restore hands the router the lane set they describe (:meth:`adopt`), without
    changing itself. It also knows how its lanes' states moved between checkpoint format
    versions (:attr:`lane_migrations`, applied by the router on restore).

    A plain function of a :class:`LaneContext` is a lane set with no derived values:

    >>> from zephon.engine.testing import RangeSource
    >>> lanes = LaneSet(lambda ctx: RangeSource(None, ctx.lane, ctx.lanes))
    >>> next(lanes(LaneContext(seed=0, lane=1, lanes=4))), lanes.shared_state(), lanes.adopt({}) is lanes
    (1, {}, True)

    **Finite pipelines.** A lane set whose lanes end says how (``end="drop"`` or ``"pad"``, see
    :class:`LaneEnd`; ``pad`` gives lane l's padding item); the router then ends every rank on
    the same global step. The per-lane counts come from :meth:`count_steps` (by default a dry
    run, :func:`count_lane_steps`; a subclass may cache it), are computed once per lane set
    (:meth:`lane_end`), travel in the checkpoint's ``shared`` entry and are adopted on restore.
    A lane that ends in a lane set without an end is an error, never a silent divergence:

    >>> finite = LaneSet(lambda ctx: RangeSource(4 + 2 * ctx.lane, ctx.lane, 2), end="drop")
    >>> finite.shared_state()  # not counted yet: the same keys, empty counts
    {'end': {'mode': 'drop', 'lane_steps': []}}
    >>> finite.lane_end(lanes=2, seed=0)
    LaneEnd(mode='drop', lane_steps=(2, 3))
    >>> finite.shared_state()
    {'end': {'mode': 'drop', 'lane_steps': [2, 3]}}
    """

    #: checkpoint format version -> the function moving one lane's state to the next version
    lane_migrations: Mapping[int, LaneMigration] = {}
    #: the entries of ``shared`` this base class writes and adopts (a subclass adds its own)
    shared_keys: tuple[str, ...] = ("end",)

    def __init__(self, build: LaneBuilder, *, end: str | None = None, pad: Callable[[int], Any] | None = None) -> None:
        if end is not None and end not in END_MODES:
            raise ValueError(f"end must be None (the lanes never end) or one of {END_MODES}, got {end!r}")
        if end == "pad" and pad is None:
            raise ValueError('end = "pad" needs pad= (a function of the lane giving its padding micro-batch)')
        self.build = build
        #: how the run ends: None (the lanes never end), "drop" or "pad"
        self.end_mode = end
        self.pad = pad
        self._end: LaneEnd | None = None
        self._end_lock = threading.Lock()

    def __call__(self, ctx: LaneContext) -> BaseNode:
        """The pipeline of lane ``ctx.lane`` (a torchdata node yielding its micro-batches)."""
        return self.build(ctx)

    # -- finite pipelines -----------------------------------------------------------------------
    def count_steps(
        self, *, lanes: int, seed: int, workers: WorkerConfig | None = None, pools: PoolSet | None = None
    ) -> list[int]:
        """Micro-batches each lane holds (a dry run; override to cache it)."""
        return count_lane_steps(self.build, lanes=lanes, seed=seed, workers=workers, pools=pools)

    def lane_end(
        self, *, lanes: int, seed: int, workers: WorkerConfig | None = None, pools: PoolSet | None = None
    ) -> LaneEnd | None:
        """Where the run ends (None: its lanes never end), computed on first use with the
        caller's workers and pools, or the value a checkpoint carried (:meth:`adopt_end`)."""
        if self.end_mode is None:
            return None
        with self._end_lock:
            if self._end is None or self._end.lanes != lanes:
                steps = self.count_steps(lanes=lanes, seed=seed, workers=workers, pools=pools)
                self._end = LaneEnd(self.end_mode, tuple(int(n) for n in steps))
            return self._end

    @property
    def known_end(self) -> LaneEnd | None:
        """The end if it was already computed or adopted (never starts a dry run)."""
        return self._end

    def pad_item(self, lane: int) -> Any:
        """Lane ``lane``'s padding micro-batch (``end = "pad"``, after the lane's own end)."""
        if self.pad is None:
            raise PipelineError(f"{self!r} has no padding item (end = {self.end_mode!r})")
        return self.pad(lane)

    def adopt_end(self, shared: Mapping[str, Any]) -> LaneSet:
        """``self``, or a copy that uses the end a checkpoint's ``shared`` entry carries (so a
        resume never recounts); refuses a checkpoint written with another end mode. An end not
        counted yet (:meth:`LaneEnd.uncounted_json`) or absent (older checkpoints) adopts nothing."""
        raw = shared.get("end")
        if raw is None:
            return self
        end = None if LaneEnd.is_uncounted(raw) else LaneEnd.from_json(raw)
        mode = raw["mode"] if end is None else end.mode
        if self.end_mode is None:
            steps = "" if end is None else f", {end.steps} steps"
            raise StateError(
                f"the checkpoint is of a finite run (end = {mode!r}{steps}) but this pipeline never "
                "ends; resume with the pipeline (recipe) that wrote it"
            )
        if mode != self.end_mode:
            raise StateError(
                f"the checkpoint was written with end = {mode!r} but the pipeline has end = {self.end_mode!r}: "
                f"the runs have different last steps. Set end = {mode!r} to resume, or start a new run."
            )
        if end is None or self._end == end:
            return self
        new = copy.copy(self)
        new._end, new._end_lock = end, threading.Lock()
        return new

    # -- checkpoints ----------------------------------------------------------------------------
    def shared_state(self) -> dict[str, Any]:
        """The derived values to save under the checkpoint's ``shared`` entry (JSON): here a
        finite run's end, with empty counts until they are known (the same keys at every step)."""
        if self.end_mode is None:
            return {}
        return {"end": LaneEnd.uncounted_json(self.end_mode) if self._end is None else self._end.to_json()}

    def adopt(self, shared: Mapping[str, Any]) -> LaneSet:
        """The lane set a checkpoint with ``shared`` describes: ``self``, or a new one built from
        the checkpoint's values. Raises :class:`StateError` naming what changed when the
        checkpoint cannot be resumed with this pipeline."""
        return self.adopt_end(shared)

    def explain_fingerprint(self, fingerprint: str, shared: Mapping[str, Any] | None = None) -> str:
        """What resumes a checkpoint written under another fingerprint (its ``shared`` values
        given), when the lane set can tell (a recipe knows which of its data versions wrote it,
        and what its filters and fork were): a sentence, or ""."""
        return ""

    def __repr__(self) -> str:
        end = "" if self.end_mode is None else f", end={self.end_mode!r}"
        return f"{type(self).__name__}({getattr(self.build, '__name__', self.build)!r}{end})"
