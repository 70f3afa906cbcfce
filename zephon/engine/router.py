"""The router: one rank's lanes, merged in lane order into its local batch.

A finite run (every lane ends, see :mod:`.end`) stops every rank before the same global step.
The router also hashes each lane's micro-batch on request, so a rank can record what it consumed
without seeing the other ranks' data (:func:`~zephon.engine.digest.ledger_digest`). With
``prefetch``, its steps run ahead on a :class:`~zephon.engine.prefetch.Prefetcher`.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

from torchdata.nodes import BaseNode

from .checkpoint import FORMAT_VERSION, lane_key, lane_state, merge_states, migrate, seal_state, verify_state
from .collate import collate
from .digest import batch_sha256, ledger_digest
from .end import LaneEnd
from .lanes import LaneBuilder, LaneContext, LaneSet, check_world_size, lanes_of_rank
from .node import PipelineError, StateError, ZNode, close_node, upstream_nodes
from .prefetch import Prefetcher
from .workers import PoolSet, WorkerConfig

_LOG = logging.getLogger("zephon")

__all__ = ["GlobalLoader", "Router", "lane_counts"]

#: per step: the owned lanes' digests and their :func:`lane_counts` (``digests=True``)
_Record = tuple[list[str], list[dict[str, int]]]


def lane_counts(node: Any) -> dict[str, int]:
    """The counts a lane's nodes report for the batch ledger (each node with a
    ``ledger_counts()`` method, e.g. documents filtered per filter and dataset), summed; read
    right after the lane made a micro-batch, they are a function of the lane's data alone. A
    node with the method answers for the nodes above it (they are not visited)."""
    out: dict[str, int] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        counts = getattr(n, "ledger_counts", None)
        if callable(counts):
            for k, v in counts().items():
                out[k] = out.get(k, 0) + int(v)
            continue
        stack.extend(upstream_nodes(n))
    return out


class Router(ZNode[Any]):
    """One rank's view of the run: its lanes, merged in lane order into its local batch.

    ``lanes_from`` builds one lane's pipeline from its :class:`LaneContext` (a function, or a
    :class:`LaneSet` carrying derived values); it is called lazily for each owned lane. The
    state is lane-keyed (see :mod:`zephon.engine.checkpoint`), so the states of any W ranks can
    be merged and loaded by any other W.

    A finite lane set (one with an end, see :class:`LaneSet`) ends on the same global step on
    every rank and every W: ``next()`` raises StopIteration before touching any lane once the
    run's last step was delivered, and keeps raising it; ``state_dict()`` works before, at and
    after the end (a state saved at the end restores ended). A lane that ends without the lane
    set declaring an end raises :class:`PipelineError` naming it.

    ``digests=True``: the router hashes each owned lane's micro-batch (:func:`batch_sha256`)
    before merging them; after ``next()``, :attr:`last_lane_digests` holds them in lane order
    (what a batch ledger records, see :func:`ledger_digest`), and :attr:`last_lane_counts` each
    lane's :func:`lane_counts`.

    ``prefetch=N``: the router's steps run up to N local batches ahead on a :class:`Prefetcher`
    (a wrapper node); ``state_dict()`` is still the state after the last delivered batch. A
    finite run's lanes are counted (:meth:`count_end`) when it starts from the beginning, before
    its first batch (on the reset that the first ``next()`` or ``state_dict()`` makes), so its
    state carries the counts in ``shared.end`` from step 0 and has one shape at every step.

    Thread-safe between ``next()``, ``state_dict()`` and ``reset()`` (one lock): a state taken
    from another thread (a checkpointer, before the first batch or during iteration) is the
    state after the last batch delivered, never a half-computed step; ``close()`` does not
    wait for the lock (it cancels a step in progress).
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
        digests: bool = False,
    ) -> None:
        super().__init__()
        self._lock = threading.RLock()  # next / state_dict / reset, from any thread
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0 (local batches computed ahead), got {prefetch!r}")
        # prefetch > 0: a Prefetcher computes up to `prefetch` local batches ahead, each with the
        # state after it, so a training step never waits on a burst of work (e.g. a shuffle window
        # refill) and state_dict() still describes exactly what was delivered
        self.prefetch = prefetch
        self.digests = digests
        #: SHA-256 of each owned lane's micro-batch of the last delivered step (``digests=True``)
        self.last_lane_digests: list[str] | None = None
        #: each owned lane's :func:`lane_counts` after the last delivered step (``digests=True``)
        self.last_lane_counts: list[dict[str, int]] | None = None
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
        steps = _RankSteps(self)
        self._source: _RankSteps | Prefetcher[tuple[Any, _Record | None, int]] = (
            Prefetcher(steps, prefetch, name=f"zephon-prefetch-rank{rank}") if prefetch else steps
        )

    def _repr_args(self):
        yield f"lanes={self.lanes}"
        yield f"rank={self.rank}/{self.world_size} owns {self.owned.start}..{self.owned.stop - 1}"
        yield f"workers={self.workers.count} {self.workers.backend}"

    def upstreams(self) -> list[BaseNode]:
        return list(self._lanes or [])

    @property
    def end(self) -> LaneEnd | None:
        """Where the run ends (None: it never ends). For a finite lane set this may count the
        lanes' micro-batches on first use (with this rank's workers), unless a checkpoint or a
        cache already gave the counts."""
        return self.lane_set.lane_end(lanes=self.lanes, seed=self.seed, workers=self.workers, pools=self.pools)

    def count_end(self) -> LaneEnd | None:
        """Count a finite run's micro-batches per lane now (a dry run of every lane with this
        rank's workers, unless a checkpoint or the cache already gave the counts), with a
        progress line on the ``zephon`` logger: the explicit step before the first batch that
        gives the state its final shape from step 0. None for a run that never ends."""
        if self.lane_set.end_mode is None or self.lane_set.known_end is not None:
            return self.lane_set.known_end
        _LOG.info("zephon: counting the micro-batches of each of the %d lanes (a finite run's end) ...", self.lanes)
        t0 = time.perf_counter()
        end = self.end
        if end is not None:
            _LOG.info("zephon: the run ends after %d steps (counted in %.1f s)", end.steps, time.perf_counter() - t0)
        return end

    @property
    def ended(self) -> bool:
        """Whether every step of a finite run has been delivered (never starts a count)."""
        end = self.lane_set.known_end
        return end is not None and self.step >= end.steps

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
        changes nothing). The state's own consistency (digests, lane identities, no unknown
        entries) is :func:`zephon.engine.verify_state`'s."""
        fv = state.get("format_version")
        if fv != FORMAT_VERSION:
            raise StateError(
                f"checkpoint format_version is {fv!r}, this zephon reads {FORMAT_VERSION}; "
                "load it through zephon.engine.checkpoint.decode_state and a pipeline that knows its migrations"
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
            hint = self.lane_set.explain_fingerprint(str(state.get("fingerprint")), state.get("shared"))
            raise StateError(
                f"the recipe changed since the checkpoint was written (fingerprint {state.get('fingerprint')!r} "
                f"vs {self.fingerprint!r}): resuming would feed different data. "
                + (hint or "Restore the original recipe, or start a new run.")
            )

    def __next__(self) -> Any:
        with self._lock:
            return super().__next__()

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return super().state_dict()

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        with self._lock:
            self._reset(initial_state)

    def _reset(self, initial_state: dict[str, Any] | None) -> None:
        if initial_state is None:  # a start from the beginning: a finite run's end first
            self.count_end()
        super().reset(initial_state)
        # resets the lanes (_reset_lanes), through the Prefetcher when prefetching: it stops its
        # thread first and starts it on the first next(), so a reset only followed by a restore
        # (DCP asks for a template state first) never computes (or counts) ahead
        self._source.reset(initial_state)
        self.last_lane_digests = self.last_lane_counts = None

    def _reset_lanes(self, initial_state: dict[str, Any] | None) -> None:
        if initial_state is None:
            for n in self.lane_nodes:
                n.reset(None)
            self.step = self._produced = 0
            self._prime_lanes()
            return
        # everything that can be checked without touching a node is checked first: the format
        # (older ones migrated and sealed), every entry's digest and identity, the run's settings
        initial_state = migrate(initial_state, self.lane_set.lane_migrations)
        verify_state(initial_state)
        self.check_run(initial_state)
        # the derived values the checkpoint was made with (data and tokenizer checked, naming
        # what changed); a lane set built from other values replaces ours before any lane resets
        lane_set = self.lane_set.adopt(initial_state["shared"])
        self._check_fingerprint(initial_state)
        missing = [lane_key(l) for l in self.owned if lane_key(l) not in initial_state]
        if missing:
            raise StateError(
                f"rank {self.rank}/{self.world_size} needs {len(missing)} lane entries that the checkpoint lacks "
                f"(first: {missing[0]}); merge the states of all ranks that wrote it (zephon.engine.checkpoint.merge_states)"
            )
        if lane_set is not self.lane_set:
            self._close_lanes()
            self.lane_set = lane_set
        nodes = self.lane_nodes
        step = initial_state["step"]
        known = self.lane_set.known_end
        if known is not None and known.lanes != self.lanes:
            raise StateError(f"checkpoint 'shared.end' counts {known.lanes} lanes, the pipeline has {self.lanes}")
        if known is not None and step > known.steps:
            raise StateError(
                f"checkpoint 'step' is {step} but the data ends after {known.steps} steps (end = {known.mode!r}); "
                "the checkpoint does not belong to this data"
            )
        self._restore_lanes(list(zip(self.owned, nodes)), initial_state)
        self.step = self._produced = step

    def _compute(self) -> tuple[Any, _Record | None, int]:
        """The next local batch, its lanes' digests and the step count after it (run ahead by
        the Prefetcher when prefetching)."""
        t = self._produced
        end = self.end
        if end is not None and t >= end.steps:
            if t > end.steps:
                raise StateError(
                    f"{self!r}: restored at step {t} but the data ends after {end.steps} steps; "
                    "the checkpoint does not belong to this data"
                )
            raise StopIteration  # the same step on every rank: no lane is touched
        outs = self._next_of_lanes(t, end)
        record = None
        if self.digests:
            record = ([batch_sha256(o) for o in outs], [lane_counts(n) for n in self.lane_nodes])
        self._produced += 1
        return self.collate_fn(outs), record, self._produced

    def next(self) -> Any:
        value, record, self.step = next(self._source)
        self.last_lane_digests, self.last_lane_counts = record if record is not None else (None, None)
        return value

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

    def _next_of_lanes(self, t: int, end: LaneEnd | None) -> list[Any]:
        """Each lane's output for step ``t``, in lane order; the first pull after a reset on a few threads."""
        pairs = list(zip(self.owned, self.lane_nodes))
        pull = functools.partial(self._pull_lane, t, end)
        if self._cold:
            self._cold = False
            return _par_map(pull, pairs, self._lane_threads())
        return [pull(pair) for pair in pairs]

    def _pull_lane(self, t: int, end: LaneEnd | None, pair: tuple[int, BaseNode]) -> Any:
        """Lane ``pair[0]``'s micro-batch of step ``t``: its node's next output, or its padding item
        once it has ended (``end = "pad"``); a lane that ends where it was not counted to is an error."""
        l, n = pair
        if end is not None and not end.holds(l, t):
            return self.lane_set.pad_item(l)  # "pad": this lane ended before the longest
        try:
            item = next(n)
        except StopIteration:
            self._lane_ended_early(l, t, end)
        if end is not None and t + 1 == end.lane_steps[l]:
            self._drain_lane(l, n, end)
        return item

    def _drain_lane(self, l: int, n: BaseNode, end: LaneEnd) -> None:
        """At a lane's last micro-batch, read its stream to the end: records after the last row that
        produce nothing (bad ones under ``on_error = "skip"``, filtered ones) are still read and
        counted, on every world size, before the step is delivered."""
        try:
            next(n)
        except StopIteration:
            return
        raise PipelineError(
            f"lane {l} holds more than the {end.lane_steps[l]} micro-batches it was counted to hold; "
            "the data or the pipeline changed since the count (clear the cached counts)"
        )

    def _lane_ended_early(self, l: int, t: int, end: LaneEnd | None) -> NoReturn:
        """A lane whose stream ended before the step the count said it holds."""
        if end is None:
            raise PipelineError(
                f"lane {l} ended after {t} micro-batches, but its lane set declares no end, so the "
                "ranks would stop at different steps. Make the pipeline infinite, or give the lane set "
                'an end (LaneSet(build, end="drop") or end="pad" with pad=...; in a recipe: every '
                'dataset policy = "stop" and end = "drop" | "pad")'
            ) from None
        raise PipelineError(
            f"lane {l} ended after {t} micro-batches, but it was counted to hold {end.lane_steps[l]}; "
            "the data or the pipeline changed since the count (clear the cached counts)"
        ) from None

    def _restore_lanes(self, pairs: list[tuple[int, BaseNode]], state: Mapping[str, Any]) -> None:
        """Reset each lane to its state (a replay of up to one flush interval), on a few threads."""
        bar = None
        if len(pairs) >= 8 and sys.stderr.isatty():
            # a restore replays up to one flush interval per lane: show it when it can take a while
            from tqdm.std import tqdm

            bar = tqdm(total=len(pairs), desc=f"rank {self.rank}: restoring lanes (replay)", unit="lane", leave=False)

        def restore(pair: tuple[int, BaseNode]) -> None:
            try:
                pair[1].reset(lane_state(state, pair[0]))
            except StateError as e:
                raise StateError(f"checkpoint entry {lane_key(pair[0])}: {e}") from None
            if bar is not None:
                bar.update(1)

        try:
            _par_map(restore, pairs, self._lane_threads())
        finally:
            if bar is not None:
                bar.close()
        self._prime_lanes()

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
        # sealed here, not per computed step: a digest per lane costs a canonical JSON dump
        return seal_state(self._source.get_state())

    def _snapshot(self) -> dict[str, Any]:
        """The state after the last computed step, lane entries unsealed (their pipelines' states)."""
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
        if isinstance(self._source, Prefetcher):
            self._source.close()  # its thread (the steps node it wraps holds nothing to close)
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
    error (in item order) is raised after every call has finished. Interrupted while waiting
    (Ctrl-C, SIGTERM in the main thread), it returns at once: the calls not started are
    cancelled and the running ones end when their pipelines are closed (cancelled)."""
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    ex = cf.ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="zephon-lanes")
    try:
        futs = [ex.submit(fn, x) for x in items]
        cf.wait(futs)
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    ex.shutdown(wait=True)
    return [f.result() for f in futs]


class _RankSteps(BaseNode[tuple[Any, "_Record | None", int]]):
    """A router's steps as a node, for the :class:`Prefetcher` to run ahead: each item is
    (local batch, lane digests, step count after it); the state is the router's unsealed
    snapshot after that step; a reset resets (or restores) the router's lanes."""

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.router._reset_lanes(initial_state)

    def next(self) -> tuple[Any, _Record | None, int]:
        return self.router._compute()

    def get_state(self) -> dict[str, Any]:
        return self.router._snapshot()


class GlobalLoader:
    """W routers in one process: global batches and merged states, for tests and ``zephon hashes``.

    The routers share one lane set, so a finite run's lane counts are computed once; at the end
    of a finite run the first router raises StopIteration before any router advances, so every
    rank ends on the same step, exactly as W separate processes do.
    """

    def __init__(self, lanes_from: LaneBuilder | LaneSet, *, lanes: int, world_size: int, **router_kwargs: Any) -> None:
        check_world_size(lanes, world_size)
        lane_set = lanes_from if isinstance(lanes_from, LaneSet) else LaneSet(lanes_from)
        self.routers = [
            Router(lane_set, lanes=lanes, world_size=world_size, rank=r, **router_kwargs) for r in range(world_size)
        ]
        # a global step and a merged state cover every router: a state never mixes steps
        self._lock = threading.RLock()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        with self._lock:
            return collate([next(r) for r in self.routers])

    @property
    def end(self) -> LaneEnd | None:
        """Where the run ends (None: never); see :attr:`Router.end`."""
        return self.routers[0].end

    @property
    def step(self) -> int:
        """Global batches delivered."""
        return self.routers[0].step

    def step_digest(self) -> str:
        """:func:`ledger_digest` of the last delivered global batch (routers built with
        ``digests=True``): the digest a batch ledger records for that step."""
        lanes: list[str] = []
        for r in self.routers:
            if r.last_lane_digests is None:
                raise PipelineError("no lane digests: build the loader with digests=True and call next() first")
            lanes.extend(r.last_lane_digests)
        return ledger_digest(lanes)

    def state_dict(self) -> dict[str, Any]:
        """Lane-keyed JSON state of every rank, merged: load it into a loader of any world size."""
        with self._lock:
            return merge_states([r.state_dict() for r in self.routers])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every rank from a merged (or per-rank) lane-keyed state; replays each lane."""
        with self._lock:
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
