"""Lanes and the lane-to-rank router.

A run has a fixed number L of lanes. Each lane is a pipeline built from a pure description (a
function of a :class:`LaneContext`) and owns its work, operator state and random streams, so
its output depends only on (recipe, seed, L, lane id). Rank r of W owns the contiguous lanes
``[r*L/W, (r+1)*L/W)`` and its local batch at step t is their step-t outputs in lane order;
global batch t is therefore the same bytes for every W that divides L.
"""

from __future__ import annotations

import copy
import hashlib
import math
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from .checkpoint import FORMAT_VERSION, lane_key, merge_states, migrate
from .node import PipelineError, StateError, ZNode, close_node, upstream_nodes
from .seeding import lane_rng
from .workers import PoolSet, WorkerConfig, WorkerPool

__all__ = [
    "GlobalLoader",
    "LaneContext",
    "LaneSet",
    "Router",
    "batch_sha256",
    "check_world_size",
    "collate",
    "divisors",
    "lanes_of_rank",
    "valid_world_sizes",
]


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (valid world sizes, valid micro-batch sizes).

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def valid_world_sizes(lanes: int) -> list[int]:
    """The data-parallel sizes a run with ``lanes`` lanes can use (its divisors).

    >>> valid_world_sizes(12)
    [1, 2, 3, 4, 6, 12]
    """
    return divisors(lanes)


def check_world_size(lanes: int, world_size: int) -> None:
    """Refuse a world size that does not divide the lane count, listing the valid ones."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if lanes % world_size:
        raise ValueError(
            f"{lanes} lanes cannot be split over {world_size} data-parallel ranks: the world size must "
            f"divide the lane count. Valid world sizes for lanes = {lanes}: {valid_world_sizes(lanes)}. "
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


def collate(items: Sequence[Any]) -> Any:
    """Concatenate lane micro-batches in lane order (dicts of arrays, arrays, or lists).

    A single array passes through without a copy (one lane per rank, one rank per loader):
    copying a multimodal batch's pixels cost a fifth of the consumer's time in the benchmark.
    """
    first = items[0]
    if isinstance(first, dict):
        return {k: collate([it[k] for it in items]) for k in first}
    if isinstance(first, np.ndarray):
        return first if len(items) == 1 else np.concatenate(items, axis=0)
    if isinstance(first, list):
        return [x for it in items for x in it]
    try:
        import torch

        if isinstance(first, torch.Tensor):
            return first if len(items) == 1 else torch.cat(list(items), dim=0)
    except ImportError:  # pragma: no cover
        pass
    return list(items)


def _plain(value: Any) -> Any:
    """Tuples (named ones included) and lists as plain ones: a batch's hash is over its data,
    not over the Python types that carry it."""
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def batch_sha256(batch: Any) -> str:
    """SHA-256 of a batch: per field in sorted name order its name, dtype, shape and bytes."""
    h = hashlib.sha256()

    def feed(name: str, value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value):
                feed(f"{name}.{k}" if name else str(k), value[k])
            return
        if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
            value = value.detach().cpu().numpy()
        if isinstance(value, np.ndarray):
            arr = np.ascontiguousarray(value)
            h.update(name.encode())
            h.update(str(arr.dtype.str).encode())
            h.update(repr(tuple(arr.shape)).encode())
            h.update(arr.tobytes())
        else:
            h.update(name.encode())
            h.update(repr(_plain(value)).encode())

    feed("", batch)
    return h.hexdigest()


LaneBuilder = Callable[[LaneContext], BaseNode]
LaneMigration = Callable[[dict[str, Any]], dict[str, Any]]


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
    """

    #: checkpoint format version -> the function moving one lane's state to the next version
    lane_migrations: Mapping[int, LaneMigration] = {}

    def __init__(self, build: LaneBuilder) -> None:
        self.build = build

    def __call__(self, ctx: LaneContext) -> BaseNode:
        """The pipeline of lane ``ctx.lane`` (a torchdata node yielding its micro-batches)."""
        return self.build(ctx)

    def shared_state(self) -> dict[str, Any]:
        """The derived values to save under the checkpoint's ``shared`` entry (JSON)."""
        return {}

    def adopt(self, shared: Mapping[str, Any]) -> LaneSet:
        """The lane set a checkpoint with ``shared`` describes: ``self``, or a new one built from
        the checkpoint's values. Raises :class:`StateError` naming what changed when the
        checkpoint cannot be resumed with this pipeline."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self.build, '__name__', self.build)!r})"


class Router(ZNode[Any]):
    """One rank's view of the run: its lanes, merged in lane order into its local batch.

    ``lanes_from`` builds one lane's pipeline from its :class:`LaneContext` (a function, or a
    :class:`LaneSet` carrying derived values); it is called lazily for each owned lane. The
    state is lane-keyed (see :mod:`zephon.engine.checkpoint`), so the states of any W ranks can
    be merged and loaded by any other W.
    """

    node_type = "router"

    def __init__(
        self,
        lanes_from: LaneBuilder | LaneSet,
        *,
        lanes: int,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        fingerprint: str = "",
        workers: WorkerConfig | None = None,
        pools: PoolSet | None = None,
        collate_fn: Callable[[Sequence[Any]], Any] = collate,
        prefetch: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0 (local batches computed ahead), got {prefetch!r}")
        # prefetch > 0: a background thread computes up to `prefetch` local batches ahead, each
        # with the state after it, so a training step never waits on a burst of work (e.g. a
        # shuffle window refill) and state_dict() still describes exactly what was delivered
        self.prefetch = prefetch
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._delivered: dict[str, Any] | None = None
        if not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"lanes must be a positive integer, got {lanes!r}")
        self.owned = lanes_of_rank(lanes, world_size, rank)
        self.lane_set = lanes_from if isinstance(lanes_from, LaneSet) else LaneSet(lanes_from)
        self.lanes, self.world_size, self.rank, self.seed = lanes, world_size, rank, seed
        self.fingerprint = fingerprint
        self.workers = workers or WorkerConfig()
        self._own_pools = pools is None
        self.pools = pools if pools is not None else PoolSet()
        self.collate_fn = collate_fn
        self._lanes: list[BaseNode] | None = None
        self.step = 0  # local batches delivered
        self._produced = 0  # local batches computed (ahead of `step` when prefetching)
        self._cold = False  # the next pull is the first after a reset (see _next_of_lanes)

    def _repr_args(self):
        yield f"lanes={self.lanes}"
        yield f"rank={self.rank}/{self.world_size} owns {self.owned.start}..{self.owned.stop - 1}"
        yield f"workers={self.workers.count} {self.workers.backend}"

    def upstreams(self) -> list[BaseNode]:
        return list(self._lanes or [])

    @property
    def lane_nodes(self) -> list[BaseNode]:
        """The final node of each lane this rank owns, in lane order (for metrics and display)."""
        if self._lanes is None:
            self._lanes = [
                self.lane_set(
                    LaneContext(
                        seed=self.seed,
                        lane=l,
                        lanes=self.lanes,
                        workers=self.workers,
                        pools=self.pools,
                        lanes_on_rank=len(self.owned),
                    )
                )
                for l in self.owned
            ]
        return self._lanes

    def check_run(self, state: Mapping[str, Any]) -> None:
        """Refuse a state written by another run configuration, naming what changed (pure: it
        changes nothing)."""
        fv = state.get("format_version")
        if fv != FORMAT_VERSION:
            raise StateError(
                f"checkpoint format_version is {fv!r}, this zephon reads {FORMAT_VERSION}; "
                "load it through zephon.decode_state and a pipeline that knows its migrations"
            )
        if state.get("lanes") != self.lanes:
            raise StateError(
                f"the checkpoint was written with lanes = {state.get('lanes')!r} but the pipeline has lanes = "
                f"{self.lanes}. The lane count is fixed for the life of a run: set lanes = {state.get('lanes')!r} "
                "to resume, or start a new run without the checkpoint."
            )
        if state.get("seed") != self.seed:
            raise StateError(
                f"the checkpoint was written with seed = {state.get('seed')!r} but the pipeline has seed = "
                f"{self.seed}; set seed = {state.get('seed')!r} to resume, or start a new run."
            )
        shared = state.get("shared")
        if not isinstance(shared, dict):
            raise StateError(f"checkpoint 'shared' entry must be a JSON object, got {type(shared).__name__}")

    def _check_fingerprint(self, state: Mapping[str, Any]) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise StateError(
                f"the recipe changed since the checkpoint was written (fingerprint {state.get('fingerprint')!r} "
                f"vs {self.fingerprint!r}): resuming would feed different data. Restore the original recipe, "
                "or start a new run."
            )

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._stop_prefetch()
        self._reset_lanes(initial_state)
        if self.prefetch:
            self._delivered = self._snapshot()
            self._start_prefetch()

    def _reset_lanes(self, initial_state: dict[str, Any] | None) -> None:
        if initial_state is None:
            for n in self.lane_nodes:
                n.reset(None)
            self.step = self._produced = 0
            self._prime_lanes()
            return
        initial_state = migrate(initial_state, self.lane_set.lane_migrations)
        self.check_run(initial_state)
        # the derived values the checkpoint was made with (data and tokenizer checked, naming
        # what changed); a lane set built from other values replaces ours before any lane resets
        lane_set = self.lane_set.adopt(initial_state["shared"])
        self._check_fingerprint(initial_state)
        if lane_set is not self.lane_set:
            self._close_lanes()
            self.lane_set = lane_set
        nodes = self.lane_nodes
        missing = [lane_key(l) for l in self.owned if lane_key(l) not in initial_state]
        if missing:
            raise StateError(
                f"rank {self.rank}/{self.world_size} needs {len(missing)} lane entries that the checkpoint lacks "
                f"(first: {missing[0]}); merge the states of all ranks that wrote it (zephon.merge_states)"
            )
        step = initial_state.get("step")
        if not isinstance(step, int) or step < 0:
            raise StateError(f"checkpoint 'step' must be a non-negative integer, got {step!r}")
        self._restore_lanes(list(zip(self.owned, nodes)), initial_state)
        self.step = self._produced = step

    def _compute(self) -> Any:
        outs = self._next_of_lanes()
        self._produced += 1
        if not self.prefetch:
            self.step = self._produced
        return self.collate_fn(outs)

    def next(self) -> Any:
        if not self.prefetch:
            return self._compute()
        q = self._queue
        if q is None:
            raise PipelineError(f"{self!r}: the prefetch thread is not running; reset() the router first")
        while True:
            try:
                kind, value, state = q.get(timeout=1.0)
                break
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    raise PipelineError(f"{self!r}: the prefetch thread is gone") from None
        if kind == "ok":
            self._delivered = state
            self.step = state["step"]  # the step delivered, not the one the thread is computing
            return value
        q.put((kind, value, state))  # keep raising the same end / error
        if kind == "end":
            raise StopIteration
        raise value

    # -- many lanes: priming, parallel cold start and restore --------------------------------
    # Why: a lane submits its first chunk only when it is pulled and a restore replays lane by
    # lane, so with hundreds of lanes the first batch and a restore were latency-bound (256
    # lanes: 13-77 s to the first batch, 95 s to restore). Every lane is primed (its first chunks
    # submitted, nothing waited for) after a reset, and the first pull and a restore's replays
    # run on a few threads. Each lane is touched by one thread at a time and lanes share no
    # state but thread-safe pools, so every lane's output is unchanged.
    def _lane_threads(self) -> int:
        """Threads for a cold first pull or a restore: 1 with few lanes or no worker pool."""
        pools = [m.pool for m in self._primables() if getattr(m, "pool", None) is not None]
        if len(self.owned) < 8 or not pools:
            return 1
        return min(len(self.owned), 4 * max(p.config.count for p in pools) + 4)

    def _primables(self) -> list[Any]:
        """The nodes of this rank's lanes that can be primed (they have a ``prime()``)."""
        out: list[Any] = []
        seen: set[int] = set()
        stack = list(self.lane_nodes)
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            if callable(getattr(n, "prime", None)):
                out.append(n)
            stack.extend(upstream_nodes(n))
        return out

    def _prime_lanes(self) -> None:
        """Submit every lane's first chunks (in lane order) before the first pull."""
        for n in sorted(self._primables(), key=lambda m: getattr(m, "lane", 0) or 0):
            n.prime()
        self._cold = True

    def _next_of_lanes(self) -> list[Any]:
        """Each lane's next output, in lane order; the first pull after a reset on a few threads."""
        if self._cold:
            self._cold = False
            return _par_map(next, list(self.lane_nodes), self._lane_threads())
        return [next(n) for n in self.lane_nodes]

    def _restore_lanes(self, pairs: list[tuple[int, BaseNode]], state: Mapping[str, Any]) -> None:
        """Reset each lane to its state (a replay of up to one flush interval), on a few threads."""
        bar = None
        if len(pairs) >= 8 and sys.stderr.isatty():
            # a restore replays up to one flush interval per lane: show it when it can take a while
            from tqdm.auto import tqdm

            bar = tqdm(total=len(pairs), desc=f"rank {self.rank}: restoring lanes (replay)", unit="lane", leave=False)

        def restore(pair: tuple[int, BaseNode]) -> None:
            pair[1].reset(state[lane_key(pair[0])])
            if bar is not None:
                bar.update(1)

        try:
            _par_map(restore, pairs, self._lane_threads())
        finally:
            if bar is not None:
                bar.close()
        self._prime_lanes()

    # -- prefetch -----------------------------------------------------------------------------
    def _start_prefetch(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(
            target=self._produce, args=(self._stop, self._queue), name=f"zephon-prefetch-rank{self.rank}", daemon=True
        )
        self._thread.start()

    def _produce(self, stop: threading.Event, q: queue.Queue) -> None:
        while not stop.is_set():
            item: tuple[str, Any, dict[str, Any] | None]
            try:
                value = self._compute()
                item = ("ok", value, self._snapshot())
            except StopIteration:
                item = ("end", None, None)
            except BaseException as e:  # surfaced in the consumer's next()
                item = ("err", e, None)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] != "ok":
                return

    def _stop_prefetch(self) -> None:
        t, self._thread = self._thread, None
        if t is None:
            return
        self._stop.set()
        q = self._queue
        while t.is_alive():
            try:
                while q is not None:
                    q.get_nowait()
            except queue.Empty:
                pass
            t.join(timeout=0.1)
        self._queue = None

    def lane_metrics(self) -> dict[int, list[dict[str, Any]]]:
        """Per owned lane, the metrics of every node of its pipeline (see ZNode.metrics)."""
        return {l: (n.pipeline_metrics() if isinstance(n, ZNode) else []) for l, n in zip(self.owned, self.lane_nodes)}

    def summary_metrics(self) -> dict[str, dict[str, Any]]:
        """Metrics summed over this rank's lanes, per node class: items, seconds, and each node's
        numeric counters (skips, rows, pad tokens...); each node type recomputes its own ratios
        from the sums (:meth:`ZNode.summarize_metrics`)."""
        out: dict[str, dict[str, Any]] = {}
        classes: dict[str, type[ZNode]] = {}
        for lane in self.lane_nodes:
            stack = [lane]
            while stack:
                n = stack.pop()
                if isinstance(n, ZNode):
                    classes.setdefault(type(n).__name__, type(n))
                stack.extend(upstream_nodes(n))
        for nodes in self.lane_metrics().values():
            for m in nodes:
                agg = out.setdefault(m["node"], {"node_type": m.get("node_type")})
                for k, v in m.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        agg[k] = agg.get(k, 0) + v
                    elif isinstance(v, dict) and all(isinstance(x, int) for x in v.values()):
                        d = agg.setdefault(k, {})
                        for kk, vv in v.items():
                            d[kk] = d.get(kk, 0) + vv
        for name, agg in out.items():
            if agg.get("busy_s"):
                agg["items_per_s"] = agg["items"] / agg["busy_s"]
            cls = classes.get(name)
            if cls is not None:
                out[name] = cls.summarize_metrics(agg)
        return out

    def get_state(self) -> dict[str, Any]:
        if self.prefetch and self._delivered is not None:
            return copy.deepcopy(self._delivered)
        return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        state: dict[str, Any] = self._tagged(
            {
                "format_version": FORMAT_VERSION,
                "lanes": self.lanes,
                "seed": self.seed,
                "fingerprint": self.fingerprint,
                "step": self._produced,
                "shared": self.lane_set.shared_state(),
            }
        )
        for l, n in zip(self.owned, self.lane_nodes):
            state[lane_key(l)] = n.state_dict()
        return state

    def _close_own(self) -> None:
        self._stop_prefetch()
        if self._own_pools:
            # lanes first (they cancel pending tasks), then the pools they shared
            self._close_lanes()
            self.pools.close()

    def _close_lanes(self) -> None:
        lanes, self._lanes = self._lanes or [], None
        for n in lanes:
            close_node(n)


def _par_map(fn: Callable[[Any], Any], items: list[Any], threads: int) -> list[Any]:
    """``[fn(x) for x in items]`` on up to ``threads`` threads, results in order; the first
    error (in item order) is raised after every call has finished."""
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="zephon-lanes") as ex:
        futs = [ex.submit(fn, x) for x in items]
        cf.wait(futs)
    return [f.result() for f in futs]


class GlobalLoader:
    """W routers in one process: global batches and merged states, for tests and ``zephon hashes``."""

    def __init__(self, lanes_from: LaneBuilder | LaneSet, *, lanes: int, world_size: int, **router_kwargs: Any) -> None:
        check_world_size(lanes, world_size)
        self.routers = [
            Router(lanes_from, lanes=lanes, world_size=world_size, rank=r, **router_kwargs) for r in range(world_size)
        ]

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return collate([next(r) for r in self.routers])

    def state_dict(self) -> dict[str, Any]:
        """Lane-keyed JSON state of every rank, merged: load it into a loader of any world size."""
        return merge_states(r.state_dict() for r in self.routers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every rank from a merged (or per-rank) lane-keyed state; replays each lane."""
        for r in self.routers:
            r.reset(state)

    def close(self) -> None:
        """Stop every rank's prefetch thread and worker pools (idempotent)."""
        for r in self.routers:
            r.close()

    def __enter__(self) -> GlobalLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
