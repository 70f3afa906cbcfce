"""The WorkSource: which records each lane reads, in which order, planned from metadata alone.

For every dataset, the records of all epochs form one stream of positions
``q = epoch * N + p``; position ``p`` of an epoch is mapped to a record through a seeded shard
order and a seeded within-shard order (both :class:`IndexPermutation`: O(1) memory, a new order
every epoch). Lane ``l`` of ``L`` takes the positions ``l, l+L, l+2L, ...``, so within an epoch
every record is read by exactly one lane, once, and each lane computes its own slice directly
without enumerating the others'.

Lanes interleave datasets by *estimated tokens*: each record's byte size (metadata) times the
dataset's measured tokens per byte. At every draw the lane picks the dataset whose estimated
tokens in the current schedule phase are furthest below its weight (a deterministic deficit
rule: no random draw, so shares converge within one document's tokens). Records estimated
longer than ``split_tokens`` are planned as several parts (consecutive token slices of the
document, each delivered once), so one huge document cannot swing a lane's mix for hundreds of
steps. The parts of a record are drawn by the lane that drew the record, in order (interleaved
with its other datasets' draws); the tokenize stage makes each part on its own
(:mod:`zephon.nodes.tokenize`: under ``[mixing] split_mode = "text"`` from its range of the text,
so the work is the part's, on whichever worker gets it). Planning the parts from their text
rather than handing a whole document to one place (tokenized once, its tokens held until the
last part is out) keeps memory per lane at one part instead of one document (up to
``max_record_bytes``), and the first batch waits for one part per lane, not one document. Weights may change at
given steps (a curriculum); a lane knows its step from its own estimated token count. The
lane's state is a few integers per dataset.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from zephon.engine import IndexPermutation, StateError, ZNode
from zephon.engine.node import check_state_keys, state_int, state_ints
from zephon.engine.seeding import stable_u64

from .blockorder import BlockOrder

__all__ = ["DatasetPlan", "LaneWorkSource", "WeightSchedule", "WorkItem", "WorkPlan", "read_items"]

POLICIES = ("repeat", "stop")


class WorkItem(NamedTuple):
    """One record to read: dataset / shard / record indices, plus where it sits in the plan."""

    dataset: int
    shard: int
    record: int
    epoch: int
    position: int  # q: position in the dataset's multi-epoch stream
    part: int = 0  # a long record is planned as `parts` consecutive token slices
    parts: int = 1

    @property
    def provenance(self) -> str:
        """Where this record comes from, in words (dataset, shard, record, epoch, part)."""
        part = f", part {self.part + 1}/{self.parts}" if self.parts > 1 else ""
        return f"dataset #{self.dataset}, shard #{self.shard}, record {self.record} (epoch {self.epoch}{part})"


@dataclass
class DatasetPlan:
    """What the WorkSource knows of a dataset: its shard sizes and each record's weight, no contents.

    ``record_weight(shard)`` is an int64 array with one weight per record of the shard, in the
    unit that ``tokens_per_byte`` turns into estimated tokens: the record's byte size for text
    (tokens per byte measured), its estimated tokens for image-text records (``tokens_per_byte``
    1), or 1 per record when mixing by samples.
    """

    name: str
    shard_sizes: Sequence[int]
    record_weight: Callable[[int], np.ndarray]
    tokens_per_byte: float = 1.0
    tokens_per_record: float = 0.0  # fixed per-record extra (BOS/EOS)
    policy: str = "repeat"
    epochs: int | None = None  # with policy "stop": how many epochs (default 1)
    split_tokens: float | None = None  # plan records estimated longer than this as several parts
    block: int = 0  # records per block of the block shuffle (0: the stripe order of versions 1-2)
    num_records: int = field(init=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"dataset {self.name!r}: policy must be one of {POLICIES}, got {self.policy!r}")
        self.shard_sizes = [int(s) for s in self.shard_sizes]
        self.num_records = int(sum(self.shard_sizes))
        if not self.tokens_per_byte > 0:
            raise ValueError(f"dataset {self.name!r}: tokens_per_byte must be > 0, got {self.tokens_per_byte}")

    def parts(self, weight: int) -> int:
        """How many parts a record of ``weight`` is planned as (from its estimated tokens)."""
        if not self.split_tokens:
            return 1
        return max(1, math.ceil((weight * self.tokens_per_byte + self.tokens_per_record) / self.split_tokens))

    @staticmethod
    def part_weight(weight: int, part: int, parts: int) -> int:
        """The share of a record's ``weight`` that part ``part`` of ``parts`` carries (the parts'
        shares add up to the weight exactly).

        >>> [DatasetPlan.part_weight(10, i, 3) for i in range(3)]
        [3, 3, 4]
        """
        return (part + 1) * weight // parts - part * weight // parts

    def estimated_tokens(self, item: WorkItem) -> float:
        """The estimated tokens of one planned item (a record, or one part of a long one; the
        fixed BOS/EOS tokens count with the first part)."""
        weight = int(self.record_weight(item.shard)[item.record])
        share = self.part_weight(weight, item.part, item.parts)
        return share * self.tokens_per_byte + (self.tokens_per_record if item.part == 0 else 0.0)

    @property
    def stream_length(self) -> int | None:
        """Positions available to all lanes together (None = unbounded)."""
        if self.policy == "repeat":
            return None
        return self.num_records * (self.epochs or 1)


@dataclass
class WeightSchedule:
    """Piecewise-constant mixture weights: ``phases[i] = (start_step, weights)``.

    >>> s = WeightSchedule([(0, [3, 1]), (1000, [1, 1])])
    >>> s.weights(s.phase_at(10)), s.weights(s.phase_at(1500))
    ([0.75, 0.25], [0.5, 0.5])"""

    phases: list[tuple[int, list[float]]]

    def __post_init__(self) -> None:
        if not self.phases or self.phases[0][0] != 0:
            raise ValueError("a weight schedule must start at step 0")
        steps = [s for s, _ in self.phases]
        if steps != sorted(set(steps)):
            raise ValueError(f"weight schedule steps must be strictly increasing, got {steps}")
        n = len(self.phases[0][1])
        for s, w in self.phases:
            if len(w) != n:
                raise ValueError(f"weight schedule phase at step {s} has {len(w)} weights, expected {n}")
            if any((not math.isfinite(x)) or x < 0 for x in w) or sum(w) <= 0:
                raise ValueError(f"weights at step {s} must be finite, >= 0 and not all 0, got {w}")

    def phase_at(self, step: float) -> int:
        """Index of the weight phase in force at (estimated) ``step``."""
        i = 0
        for j, (s, _) in enumerate(self.phases):
            if step >= s:
                i = j
        return i

    def weights(self, phase: int) -> list[float]:
        """Normalised dataset weights of ``phase`` (computed once per phase: asked per record)."""
        cache = self.__dict__.setdefault("_normalised", {})
        out = cache.get(phase)
        if out is None:
            w = self.phases[phase][1]
            total = float(sum(w))
            out = cache[phase] = [x / total for x in w]
        return out


class _EpochOrder:
    """Position -> (shard, record) for one dataset epoch, with O(shards) memory."""

    def __init__(self, seed: int, ds_index: int, sizes: Sequence[int], epoch: int) -> None:
        self.key = (seed, ds_index, epoch)
        n_shards = len(sizes)
        shard_perm = IndexPermutation(n_shards, stable_u64("shards", seed, ds_index, epoch))
        self.order = shard_perm.take(np.arange(n_shards)) if n_shards else np.zeros(0, dtype=np.int64)
        ordered_sizes = np.asarray(sizes, dtype=np.int64)[self.order] if n_shards else np.zeros(0, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(ordered_sizes)])
        self._perms: dict[int, IndexPermutation] = {}
        self.sizes = sizes

    def _perm(self, shard: int) -> IndexPermutation:
        perm = self._perms.get(shard)
        if perm is None:
            seed, ds, epoch = self.key
            perm = IndexPermutation(self.sizes[shard], stable_u64("records", seed, ds, epoch, shard))
            if len(self._perms) > 1024:  # shared by all lanes: keep the shards of a usual corpus
                self._perms.clear()
            self._perms[shard] = perm
        return perm

    def locate(self, p: int) -> tuple[int, int]:
        starts = self.__dict__.get("_starts_list")
        if starts is None:
            starts = self.__dict__["_starts_list"] = self.starts.tolist()
        j = bisect.bisect_right(starts, int(p)) - 1
        shard = int(self.order[j])
        return shard, self._perm(shard)[int(p) - starts[j]]

    def locate_many(self, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`locate` for an array of positions of this epoch: one pass whatever
        the number of shards they fall in (with many lanes a lookahead spans all of them)."""
        j = np.searchsorted(self.starts, p, side="right") - 1
        shards = self.order[j].astype(np.int64)
        offsets = p - self.starts[j]
        uniq, which = np.unique(shards, return_inverse=True)
        perms = [self._perm(int(s)) for s in uniq]
        return shards, IndexPermutation.take_each(perms, which.reshape(-1), offsets)


class WorkPlan:
    """The curriculum of a run: datasets, seed, lanes, schedule. Pure description, no I/O."""

    def __init__(
        self,
        datasets: Sequence[DatasetPlan],
        *,
        seed: int,
        lanes: int,
        schedule: WeightSchedule,
        tokens_per_step: float,
    ) -> None:
        if not datasets:
            raise ValueError("a WorkPlan needs at least one dataset")
        if len(schedule.phases[0][1]) != len(datasets):
            raise ValueError(
                f"the weight schedule has {len(schedule.phases[0][1])} weights for {len(datasets)} datasets"
            )
        for d in datasets:
            if d.num_records == 0:
                raise ValueError(f"dataset {d.name!r} has no records; remove it from the recipe or fix its path")
        self.datasets = list(datasets)
        self.seed, self.lanes, self.schedule = seed, lanes, schedule
        self.tokens_per_step = float(tokens_per_step)  # estimated tokens one lane consumes per step
        # epoch orders shared by every lane of the process (the same for all lanes; only the
        # positions a lane takes differ): with 1,024 lanes, one order per lane per epoch was the
        # bulk of a cold start's CPU. Bounded; rebuilt on a miss.
        self._orders: collections.OrderedDict[tuple[int, int], _EpochOrder | BlockOrder] = collections.OrderedDict()
        self._orders_lock = threading.Lock()

    ORDERS_KEPT = 32  # epoch orders always kept (all datasets together) ...
    #: ... and more while ``orders x (64 + shards)`` stays under this (an order costs O(its shards)
    #: plus a constant): where lanes outnumber records every lane spans many epochs in one step,
    #: and a cache of 32 orders made every lane rebuild every epoch (lanes x epochs orders)
    ORDER_BUDGET = 1 << 18

    def epoch_order(self, d: int, epoch: int) -> _EpochOrder | BlockOrder:
        """Dataset ``d``'s order in ``epoch`` (position -> shard, record), shared by all lanes."""
        key = (d, epoch)
        with self._orders_lock:
            order = self._orders.get(key)
            if order is not None:
                self._orders.move_to_end(key)
                return order
        ds = self.datasets[d]
        if ds.block:
            order = BlockOrder(self.seed, d, ds.shard_sizes, epoch, lanes=self.lanes, block=ds.block)
        else:
            order = _EpochOrder(self.seed, d, ds.shard_sizes, epoch)
        with self._orders_lock:
            order = self._orders.setdefault(key, order)
            while len(self._orders) > self.ORDERS_KEPT and (
                len(self._orders) * (64 + max(len(ds.shard_sizes) for ds in self.datasets)) > self.ORDER_BUDGET
            ):
                self._orders.popitem(last=False)
        return order

    def __getstate__(self) -> dict[str, Any]:
        st = dict(self.__dict__)
        st["_orders"], st["_orders_lock"] = collections.OrderedDict(), None
        return st

    def __setstate__(self, st: dict[str, Any]) -> None:
        self.__dict__.update(st)
        self._orders_lock = threading.Lock()

    def item_tokens(self, item: WorkItem) -> float:
        """The estimated tokens of a planned item: what a lane's mapper sizes its read-ahead by."""
        return self.datasets[item.dataset].estimated_tokens(item)

    def lane(self, lane: int) -> LaneWorkSource:
        """The work source node of ``lane`` (a fresh node at the start of the plan)."""
        return LaneWorkSource(self, lane)

    def target_shares(self, phase: int = 0) -> dict[str, float]:
        """Token share per dataset name the mixing converges to in ``phase``."""
        return dict(zip((d.name for d in self.datasets), self.schedule.weights(phase)))

    def simulated_shares(self, draws: int = 4000, lane: int = 0) -> dict[str, float]:
        """Estimated token share per dataset over a lane's first ``draws`` items, from metadata
        alone (the WorkSource run without reading a record): what the mixing delivers early on."""
        src = self.lane(lane)
        est = np.zeros(len(self.datasets))
        for _ in range(draws):
            try:
                it = next(src)
            except StopIteration:
                break
            est[it.dataset] += self.datasets[it.dataset].estimated_tokens(it)
        total = est.sum()
        return {d.name: float(e / total) if total else 0.0 for d, e in zip(self.datasets, est)}


class LaneWorkSource(ZNode[WorkItem]):
    """Lane ``lane``'s slice of the plan as a node yielding :class:`WorkItem` s.

    State: draws so far, per dataset the records taken and their bytes, the schedule phase and
    the bytes taken per dataset within it. Restoring is O(1): the state *is* the position.
    """

    node_type = "work_source"

    def __init__(self, plan: WorkPlan, lane: int, ahead: Callable[[int, np.ndarray], Any] | None = None) -> None:
        super().__init__()
        if not 0 <= lane < plan.lanes:
            raise ValueError(f"lane must be in [0, {plan.lanes}), got {lane}")
        self.plan, self.lane = plan, lane
        #: download-ahead: called with (dataset, shards of the lane's next records, in order) each
        #: time a new window of records is located; a hint only, it changes nothing read
        self.ahead = ahead
        n = len(plan.datasets)
        self._orders: list[_EpochOrder | BlockOrder | None] = [None] * n
        self._clear()

    def _clear(self) -> None:
        n = len(self.plan.datasets)
        self.draws = 0
        self.count = [0] * n
        self.bytes = [0] * n
        self.phase = 0
        self.phase_bytes = [0] * n
        self.phase_count = [0] * n
        self.part = [0] * n  # next part of the record in progress per dataset (0 = none)
        # derived, not state: each dataset's next LOOKAHEAD record locations, computed at once
        self._ahead: list[tuple[int, np.ndarray, np.ndarray, np.ndarray] | None] = [None] * n
        self._window = [self.FIRST_LOOKAHEAD] * n

    def _repr_args(self):
        yield f"lane={self.lane}/{self.plan.lanes}"
        yield "datasets=" + ",".join(d.name for d in self.plan.datasets)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is None:
            return
        n = len(self.plan.datasets)
        st = initial_state
        check_state_keys(self, st, self._STATE_FIELDS)
        try:
            # (stream positions lane + k * lanes must stay within int64)
            count = state_ints(self, "count", st["count"], n, hi=(1 << 62) // self.plan.lanes)
            nbytes = state_ints(self, "bytes", st["bytes"], n)
            pbytes = state_ints(self, "phase_bytes", st["phase_bytes"], n)
            pcount = state_ints(self, "phase_count", st["phase_count"], n)
            part = state_ints(self, "part", st["part"], n)
        except StateError as e:
            raise StateError(f"{e} (one per dataset of the recipe: {n}; the recipe's datasets changed?)") from None
        phase = state_int(self, "phase", st["phase"], 0, len(self.plan.schedule.phases) - 1)
        draws = state_int(self, "draws", st["draws"], sum(count))  # every record started is one draw
        for d, ds in enumerate(self.plan.datasets):
            where = f"dataset {ds.name!r} (#{d})"
            if pcount[d] > count[d] or pbytes[d] > nbytes[d]:
                raise StateError(
                    f"{self!r}: state field 'phase_count'/'phase_bytes' of {where} exceeds 'count'/'bytes' "
                    f"({pcount[d]} > {count[d]} or {pbytes[d]} > {nbytes[d]}): the state is corrupt or edited"
                )
            limit = ds.stream_length
            if limit is not None:
                # the lane takes positions lane, lane + L, ... below the stream's length
                most = max(0, -(-(limit - self.lane) // self.plan.lanes))
                if count[d] > most:
                    raise StateError(
                        f"{self!r}: state field 'count' of {where} is {count[d]}, but this lane has only {most} "
                        "records of it to read: the state is corrupt or edited"
                    )
            if part[d]:
                if count[d] == 0:
                    raise StateError(f"{self!r}: state field 'part' of {where} is {part[d]} before any record")
                _, _, shard, record = self._locate_count(d, count[d] - 1)
                parts = ds.parts(int(ds.record_weight(shard)[record]))
                if part[d] >= parts:
                    raise StateError(
                        f"{self!r}: state field 'part' of {where} is {part[d]}, but the record in progress "
                        f"has {parts} parts: the state is corrupt or edited"
                    )
        self.draws, self.count, self.bytes = draws, count, nbytes
        self.phase, self.phase_bytes, self.phase_count = phase, pbytes, pcount
        self.part = part

    _STATE_FIELDS = ("draws", "count", "bytes", "phase", "phase_bytes", "phase_count", "part")

    def get_state(self) -> dict[str, Any]:
        return self._tagged(
            {
                "draws": self.draws,
                "count": list(self.count),
                "bytes": list(self.bytes),
                "phase": self.phase,
                "phase_bytes": list(self.phase_bytes),
                "phase_count": list(self.phase_count),
                "part": list(self.part),
            }
        )

    # -- planning ---------------------------------------------------------------------------
    def _position(self, d: int, k: int) -> int:
        return self.lane + k * self.plan.lanes

    def _available(self, d: int) -> bool:
        if self.part[d]:
            return True
        limit = self.plan.datasets[d].stream_length
        return limit is None or self._position(d, self.count[d]) < limit

    def _est_tokens(self, d: int, nbytes: int, ncount: int) -> float:
        ds = self.plan.datasets[d]
        return nbytes * ds.tokens_per_byte + ncount * ds.tokens_per_record

    def estimated_tokens(self) -> float:
        """Estimated tokens this lane has drawn so far (how a lane knows its step for schedules)."""
        return sum(self._est_tokens(d, self.bytes[d], self.count[d]) for d in range(len(self.plan.datasets)))

    def _maybe_advance_phase(self) -> None:
        if len(self.plan.schedule.phases) == 1:
            return  # one phase: nothing to advance (skips a per-record sum over datasets)
        step = self.estimated_tokens() / self.plan.tokens_per_step if self.plan.tokens_per_step > 0 else 0.0
        phase = self.plan.schedule.phase_at(step)
        if phase != self.phase:
            self.phase = phase
            self.phase_bytes = [0] * len(self.plan.datasets)
            self.phase_count = [0] * len(self.plan.datasets)

    def _choose(self) -> int | None:
        weights = self.plan.schedule.weights(self.phase)
        best, best_score = None, math.inf
        for d, w in enumerate(weights):
            if w <= 0 or not self._available(d):
                continue
            score = self._est_tokens(d, self.phase_bytes[d], self.phase_count[d]) / w
            if score < best_score:  # ties -> lowest index
                best, best_score = d, score
        if best is None:  # the phase's datasets are exhausted: fall back to any dataset left
            for d in range(len(weights)):
                if self._available(d):
                    return d
        return best

    LOOKAHEAD = 64  # records located at once per dataset, at most
    FIRST_LOOKAHEAD = 8  # the first window after a reset (doubles up to LOOKAHEAD)

    def _lookahead(self, d: int) -> int:
        """The next window: small right after a reset (a restore or cold start of 1,024 lanes
        touches a few records per lane, not 64 per dataset), doubling as the lane goes on, and
        spanning about two epochs at most (where lanes outnumber records, each record of a lane
        is in another epoch, and each epoch's order costs a shard permutation)."""
        size = self._window[d]
        self._window[d] = min(self.LOOKAHEAD, 2 * size)
        ds = self.plan.datasets[d]
        return max(1, min(size, max(4, -(-2 * ds.num_records // self.plan.lanes))))

    def _locate_count(self, d: int, k: int) -> tuple[int, int, int, int]:
        """(position q, epoch, shard, record) of this lane's k-th record of dataset d."""
        ahead = self._ahead[d]
        if ahead is None or not ahead[0] <= k < ahead[0] + len(ahead[1]):
            ks = np.arange(k, k + self._lookahead(d), dtype=np.int64)
            epochs, shards, records = self._locate_positions(d, self.lane + ks * self.plan.lanes, self._order)
            ahead = self._ahead[d] = (k, epochs, shards, records)
            if self.ahead is not None:
                self._hint(d, k)
        i = k - ahead[0]
        return self.lane + k * self.plan.lanes, int(ahead[1][i]), int(ahead[2][i]), int(ahead[3][i])

    def _locate_positions(
        self, d: int, qs: np.ndarray, order_of: Callable[[int, int], _EpochOrder | BlockOrder]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch, shard, record) of dataset ``d``'s stream positions ``qs`` (increasing), one
        vectorised call per epoch; one position at a time, in plain integers, where nearly every
        position is in another epoch (lanes outnumbering records): the same answers, without
        numpy's overhead per one-element call (most of the cold start of 4,096 lanes over 3,000
        records)."""
        epochs, ps = np.divmod(qs, self.plan.datasets[d].num_records)
        shards, records = np.empty_like(qs), np.empty_like(qs)
        if len(qs) > 1 and 2 * (int(epochs[-1]) - int(epochs[0])) >= len(qs):
            for i, (e, p) in enumerate(zip(epochs.tolist(), ps.tolist())):
                shards[i], records[i] = order_of(d, e).locate(p)
            return epochs, shards, records
        for e in np.unique(epochs):
            sel = epochs == e
            shards[sel], records[sel] = order_of(d, int(e)).locate_many(ps[sel])
        return epochs, shards, records

    HINT_RECORDS = 256  # download-ahead: the shards of the lane's next this many records of a dataset

    def _hint(self, d: int, k: int) -> None:
        """Tell ``self.ahead`` the shards of this lane's records k, k+1, ... of dataset d (up to
        HINT_RECORDS of them, within the stream), located without touching the lane's state."""
        ahead, ds = self.ahead, self.plan.datasets[d]
        if ahead is None:
            return
        ks = np.arange(k, k + self.HINT_RECORDS, dtype=np.int64)
        qs = self.lane + ks * self.plan.lanes
        limit = ds.stream_length
        if limit is not None:
            qs = qs[qs < limit]
        if not len(qs) or not ds.num_records:
            return
        ahead(d, self._locate_positions(d, qs, self.plan.epoch_order)[1])

    def _order(self, d: int, epoch: int) -> _EpochOrder | BlockOrder:
        order = self._orders[d]
        if order is None or order.key[2] != epoch:
            order = self._orders[d] = self.plan.epoch_order(d, epoch)
        return order

    def _locate(self, d: int, q: int) -> tuple[int, int, int]:
        """Scalar reference for :meth:`_locate_count` (one position, no lookahead)."""
        epoch, p = divmod(q, self.plan.datasets[d].num_records)
        shard, record = self._order(d, epoch).locate(p)
        return epoch, shard, record

    def next(self) -> WorkItem:
        self._maybe_advance_phase()
        d = self._choose()
        if d is None:
            raise StopIteration
        ds = self.plan.datasets[d]
        i = self.part[d]
        first = i == 0
        q, epoch, shard, record = self._locate_count(d, self.count[d] - (0 if first else 1))
        weight = int(ds.record_weight(shard)[record])
        parts = ds.parts(weight)
        share = ds.part_weight(weight, i, parts)
        self.draws += 1
        if first:
            self.count[d] += 1
            self.phase_count[d] += 1
        self.bytes[d] += share
        self.phase_bytes[d] += share
        self.part[d] = i + 1 if i + 1 < parts else 0
        return WorkItem(d, shard, record, epoch, q, i, parts)


def read_items(
    datasets: Sequence[Any], items: Sequence[WorkItem], given: Mapping[tuple[int, int, int], Any] | None = None
) -> list[Any]:
    """Each item's record, in order: as ``given`` holds it (by ``(dataset, shard, record)``: what
    the record pipeline read, a transform's new text), else read from ``datasets``, one read per
    (dataset, shard) group: the one read path of every encoder."""
    out: list[Any] = [None] * len(items)
    todo = []
    for i, it in enumerate(items):
        got = given.get((it.dataset, it.shard, it.record)) if given else None
        if got is None:
            todo.append(i)
        else:
            out[i] = got
    todo.sort(key=lambda i: (items[i].dataset, items[i].shard))
    for (d, s), group in itertools.groupby(todo, key=lambda i: (items[i].dataset, items[i].shard)):
        idx = list(group)
        for i, rec in zip(idx, datasets[d].read(s, [items[i].record for i in idx])):
            out[i] = rec
    return out
