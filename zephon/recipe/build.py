"""Lane assembly: a prepared recipe -> each lane's pipeline of operators.

A text lane::

    WorkSource(lane) -> OrderedMapper(RecordPipeline) -> [FilterCounter] -> SkipCounter -> Pack -> WindowShuffle -> Batch

an image-text lane::

    WorkSource(lane) -> OrderedMapper(RecordPipeline) -> [FilterCounter] -> SkipCounter -> MMPack -> WindowShuffle (of micro-batches)

(:class:`~zephon.nodes.RecordPipeline`: read -> ``[[filters]]`` -> each dataset kind's encoder).

:class:`RecipeLanes` is the :class:`zephon.engine.lanes.LaneSet` a router builds its lanes from: it
carries the :class:`~zephon.recipe.prepare.Prepared` recipe (and with it the token estimates a
checkpoint saves and a resume adopts) and the recipe's lane-state migrations.

A finite recipe (every dataset ``policy = "stop"``) is a lane set with an end
(``end = "pad"`` by default, or ``"drop"``): its per-lane micro-batch counts come from a dry run
of every lane, cached on disk (:func:`zephon.recipe.lanesteps.cached_lane_steps`) and carried in
every checkpoint. With ``"pad"`` a lane's last partial micro-batch is completed with padding
rows (no row is lost) and an ended lane delivers a micro-batch of padding rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from torchdata.nodes import BaseNode

from zephon.data import node_cache
from zephon.data.tokenizer import set_tokenizers_parallelism
from zephon.engine import LaneContext, OrderedMapper, WorkerConfig
from zephon.engine.lanes import LaneSet, count_lane_steps
from zephon.engine.workers import PoolSet
from zephon.nodes import (
    Batch,
    Carry,
    ChatPack,
    FilterCounter,
    LaneWorkSource,
    MMPack,
    Pack,
    PhasedLane,
    ScheduledBatch,
    SegmentPack,
    SkipCounter,
    WindowShuffle,
    mm_pad_batch,
    pad_row,
    pad_rows,
)

from .explain import explain_filters, explain_fork
from .lanesteps import cached_lane_steps
from .migrations import LANE_MIGRATIONS
from .prepare import Prepared, fingerprint_of
from .spec import CHAT_KIND, DATA_VERSION, RecipeError, RecipeSpec

__all__ = ["RecipeLanes", "build_lane", "max_doc_tokens", "pad_item", "prefetch_depth"]

#: chunks a rank's lanes may hold in flight per worker: text chunks are tens of KB of token ids,
#: image chunks tens of MB of patches
IN_FLIGHT_PER_WORKER = {"tokenize": 16, "vision": 8}
#: estimated tokens a lane's mapper pulls ahead of what it delivered, in the lane's steps (its
#: tasks end at ``READ_AHEAD_STEPS x tokens per step / max_in_flight``): chunks of 32 documents
#: read ~80,000 tokens ahead of a lane of one 2,048-token row a step, tokenized and never used
#: by a run that stops (a 10-step run tokenized 3.2x what it delivered). Performance only, as
#: the chunk size is: tasks are cut inside chunks, states and batches are unchanged
READ_AHEAD_STEPS = 4
#: ... but a task holds at least this many estimated tokens: a tokenize call costs ~0.1-0.2 ms
#: besides its tokens (measured: 640 documents in tasks of 1 took 15% more CPU than in 32s, of
#: 8 5%), ~5 ms of tokenizing at 8,192 tokens amortizes it
TASK_TOKENS_MIN = 8192


def _download_ahead(p: Prepared) -> Callable[[int, Any], Any] | None:
    """The work source's download-ahead hint: the shards a lane reads next are fetched into the
    node's shard cache in the background (None without a cache: nothing to fetch into)."""
    if node_cache() is None:
        return None
    prefetch = [getattr(ix, "prefetch", None) for ix in p.indexes]
    if not any(prefetch):
        return None

    def hint(d: int, shards: Any) -> None:
        fn = prefetch[d]
        if fn is not None:
            fn(shards)

    return hint


def _front(p: Prepared, ctx: LaneContext, stage: str, workers: WorkerConfig | None) -> BaseNode:
    """WorkSource -> OrderedMapper(fetch) -> SkipCounter: the part text and image-text lanes share."""
    spec = p.spec
    wc = spec.workers.for_stage(stage, workers, default=ctx.workers)
    if wc.count > 0:
        # with our own workers, the tokenizer's internal thread pool only serialises them
        set_tokenizers_parallelism(False)
    chunk = spec.workers.vision_chunk_size if stage == "vision" else spec.workers.chunk_size
    in_flight = ctx.max_in_flight(wc, IN_FLIGHT_PER_WORKER[stage])
    ahead = max(READ_AHEAD_STEPS * p.plan.tokens_per_step, TASK_TOKENS_MIN * in_flight)
    node: BaseNode = LaneWorkSource(p.plan, ctx.lane, ahead=_download_ahead(p))
    node = OrderedMapper(
        node,
        batch_fn=p.pipeline,
        workers=wc,
        pool=ctx.pool(wc),
        chunk_size=chunk,
        max_in_flight=in_flight,
        lane=ctx.lane,
        name=f"fetch+{stage}",
        cost=p.plan.item_tokens,
        cost_ahead=ahead,
    )
    rules = p.pipeline.rules
    if rules:  # [[filters]]: count and drop what they dropped, run the stateful ones
        node = FilterCounter(
            node,
            rules=[r.name for r in rules],
            dataset_names=[s.name for s in spec.datasets],
            stateful=[r for r in rules if r.on_lane],
            locate=p.pipeline.record_name,
        )
    return SkipCounter(
        node,
        dataset_names=[s.name for s in spec.datasets],
        lanes=spec.lanes,
        lane=ctx.lane,
        max_skipped=[s.max_skipped for s in spec.datasets],
        max_fraction=[s.max_skipped_fraction for s in spec.datasets],
        shard_names=[[sh.path for sh in ix.shards] for ix in p.indexes],
        records=[ix.num_records for ix in p.indexes],
    )


#: tokens per byte of text no tokenizer reaches (byte-level BPE: at most 1; normalizers that
#: expand characters and byte fallback stay far below): bounds a document's tokens by its size
TOKENS_PER_BYTE_BOUND = 16


def max_doc_tokens(spec: RecipeSpec) -> int:
    """An upper bound of the tokens one document (or sample) of the recipe can have, from the
    per-record size limits: bounds a packer's restored ``since`` before anything is replayed."""
    most = max(s.max_record_bytes for s in spec.datasets)
    return max(TOKENS_PER_BYTE_BOUND * most + 2, spec.seq_len + 1)


def _shuffle(spec: RecipeSpec, node: BaseNode, lane: int, buffer: int) -> BaseNode:
    if buffer <= 1:
        return node
    # lanes start at different phases so that a rank's lanes refill their windows at different steps
    return WindowShuffle(node, buffer=buffer, seed=spec.seed, lane=lane, phase=(lane * buffer) // spec.lanes)


def build_lane(p: Prepared, ctx: LaneContext, workers: WorkerConfig | None = None) -> BaseNode:
    """The pipeline of lane ``ctx.lane`` (a torchdata node yielding its micro-batches);
    ``workers`` overrides every stage's workers (performance only)."""
    spec = p.spec
    if spec.multimodal:
        v = spec.vision.config
        node = MMPack(
            _front(p, ctx, "vision", workers),
            seq_len=spec.seq_len,
            rows=spec.rows_per_lane,
            patch_dim=v.patch_dim,
            max_images_per_batch=v.max_images_per_batch,
            max_images_per_row=v.max_images_per_row,
            flush_every=spec.pack.flush_every,
            pad_id=p.pad_id,
            ignore_ids=list(p.special.values()),
            mrope=v.mrope,
            max_doc_tokens=max_doc_tokens(spec),
            labels=spec.pack.labels,
            # [pack] algorithm = "best_fit" places samples in the fullest row from data version 6 (first fit before)
            placement="best_fit" if spec.pack.algorithm == "best_fit" and spec.data_version >= 6 else "first_fit",
        )
        return _shuffle(spec, node, ctx.lane, -(-spec.shuffle.buffer // spec.rows_per_lane))  # in micro-batches
    if spec.batch_schedule is not None:
        return _scheduled_lane(p, ctx, workers)
    node = _pack(p, _front(p, ctx, "tokenize", workers), spec.seq_len)
    fill = pad_row(spec.seq_len, p.pad_id) if spec.end == "pad" else None
    return Batch(_shuffle(spec, node, ctx.lane, spec.shuffle.buffer), batch_size=spec.rows_per_lane, fill=fill)


def _pack(p: Prepared, source: BaseNode, seq_len: int, cls: type[Pack] | None = None) -> Pack:
    spec = p.spec
    chat = [s for s in spec.datasets if s.kind == CHAT_KIND]  # labels only on assistant tokens
    extra = {"allow_split": any(s.long == "split" for s in chat)} if chat else {}
    return (cls or (ChatPack if chat else Pack))(
        source,
        seq_len=seq_len,
        algorithm=spec.pack.algorithm,
        flush_every=spec.pack.flush_every,
        pad_id=p.pad_id,
        max_open=spec.pack.max_open,
        max_doc_tokens=max(max_doc_tokens(spec), seq_len + 1),
        labels=spec.pack.labels,
        **extra,
    )


def _segment_shuffle(spec: RecipeSpec, node: BaseNode, lane: int, k: int) -> BaseNode:
    """Segment ``k``'s shuffle: segment 0's is the recipe's own; the others draw from their own streams."""
    buffer = spec.shuffle.buffer
    if buffer <= 1 or k == 0:
        return _shuffle(spec, node, lane, buffer)
    return WindowShuffle(node, buffer=buffer, seed=spec.seed, lane=lane, name=f"shuffle.{k}")


def _held(p: Prepared, ctx: LaneContext, k: int, source: BaseNode) -> BaseNode:
    """Segment ``k``'s pack -> shuffle over ``source``, rows as segments: what a change re-packs."""
    sched = p.spec.batch_schedule
    assert sched is not None
    bottom = source if k == 0 else Carry(source, functools.partial(_held, p, ctx, k - 1))
    node = _pack(p, bottom, sched.segments()[k][1], SegmentPack)
    return _segment_shuffle(p.spec, node, ctx.lane, k)


def _scheduled_lane(p: Prepared, ctx: LaneContext, workers: WorkerConfig | None) -> BaseNode:
    """A lane of a recipe with ``[[batch_schedule]]``: micro-batches of the step's rows; with a
    ``seq_len`` change, one pipeline per segment (:mod:`zephon.nodes.phases`)."""
    spec = p.spec
    sched = spec.batch_schedule
    assert sched is not None
    segments = sched.segments()

    def segment(k: int, old: dict[str, Any] | None) -> ScheduledBatch:
        front = _front(p, ctx, "tokenize", workers)
        bottom = front if k == 0 else Carry(front, functools.partial(_held, p, ctx, k - 1), old)
        node = _segment_shuffle(spec, _pack(p, bottom, segments[k][1]), ctx.lane, k)
        return ScheduledBatch(node, schedule=sched, first_step=segments[k][0])

    return segment(0, None) if len(segments) == 1 else PhasedLane(sched, segment)


def pad_item(p: Prepared, lane: int) -> dict:
    """The micro-batch an ended lane of a finite recipe with ``end = "pad"`` delivers: padding
    rows with the fields and dtypes of the recipe's own micro-batches (labels -100)."""
    spec = p.spec
    if spec.multimodal:
        v = spec.vision.config
        return mm_pad_batch(
            rows=spec.rows_per_lane, seq_len=spec.seq_len, patch_dim=v.patch_dim, pad_id=p.pad_id, mrope=v.mrope
        )
    return pad_rows(spec.rows_per_lane, spec.seq_len, p.pad_id)


class RecipeLanes(LaneSet):
    """A prepared recipe's lanes, and the derived values (token estimates; for a finite recipe
    the per-lane step counts) they are built from.

    :meth:`adopt` returns the lanes a checkpoint's values describe (re-planned with its token
    estimates, ending where it says) without changing this object; the recipe's lane-state
    migrations travel with it.
    """

    lane_migrations = LANE_MIGRATIONS

    def __init__(
        self,
        prepared: Prepared,
        workers: WorkerConfig | None = None,
        respec: Callable[[int], RecipeSpec] | None = None,
    ) -> None:
        end = prepared.spec.end
        super().__init__(
            functools.partial(build_lane, prepared, workers=workers),
            end=end,
            pad=functools.partial(pad_item, prepared) if end == "pad" else None,
        )
        self.prepared, self.workers = prepared, workers
        #: the recipe's spec under another data version (for :meth:`explain_fingerprint`)
        self.respec = respec

    def count_steps(
        self, *, lanes: int, seed: int, workers: WorkerConfig | None = None, pools: PoolSet | None = None
    ) -> list[int]:
        """The recipe's per-lane micro-batch counts: cached on disk, else a dry run of every lane
        with the calling rank's workers and pools."""

        def count() -> list[int]:
            return count_lane_steps(self.build, lanes=lanes, seed=seed, workers=workers, pools=pools)

        return cached_lane_steps(self.prepared, count)

    def shared_state(self) -> dict[str, Any]:
        """Token estimates and the data and tokenizer fingerprints (see :meth:`Prepared.shared_state`),
        and a finite recipe's end once counted."""
        return {**self.prepared.shared_state(), **super().shared_state()}

    def adopt(self, shared: Mapping[str, Any]) -> LaneSet:
        """These lanes, or lanes planned with the checkpoint's token estimates (and its counts)."""
        p = self.prepared.adopt({k: v for k, v in shared.items() if k not in LaneSet.shared_keys})
        lanes = self if p is self.prepared else RecipeLanes(p, self.workers, self.respec)
        return lanes.adopt_end(shared)

    def explain_fingerprint(self, fingerprint: str, shared: Mapping[str, Any] | None = None) -> str:
        """What differs from the checkpoint's recipe where it can tell (its ``[[filters]]``, a
        fork, see :mod:`zephon.recipe.explain`), and the ``data_version`` that resumes a
        checkpoint written by an older zephon (or under another version); "" if none."""
        shared = shared if isinstance(shared, Mapping) else {}
        theirs = shared.get("definition")
        hints = [
            explain_fork(shared.get("fork"), None),
            explain_filters(
                theirs.get("filters") if isinstance(theirs, Mapping) else None,
                self.prepared.definition.get("filters", []),
            ),
        ]
        return " ".join(h for h in [*hints, self._version_hint(fingerprint)] if h)

    def _version_hint(self, fingerprint: str) -> str:
        p = self.prepared
        if self.respec is None:
            return ""
        for v in range(DATA_VERSION, 0, -1):
            if v == p.spec.data_version:
                continue
            try:
                spec = self.respec(v)
            except RecipeError:
                continue
            if fingerprint_of(spec, p.indexes, p.tokenizer) == fingerprint:
                return (
                    f"It was written under data version {v} (this recipe makes version {p.spec.data_version}'s "
                    f"batches): set data_version = {v} at the top of the recipe to resume its own stream, or "
                    "start a new run."
                )
        return ""

    def __repr__(self) -> str:
        return f"RecipeLanes(fingerprint={self.prepared.fingerprint}, workers={self.workers})"


def prefetch_depth(spec: RecipeSpec, world_size: int) -> int:
    """Local batches a rank computes ahead. "auto": enough to cover one shuffle-window refill
    (lanes refill at staggered steps, so a refill is ``buffer / (lanes per rank x rows per
    lane)`` steps of the rank's work), at least 2."""
    if spec.workers.prefetch != "auto":
        return int(spec.workers.prefetch)
    rows = min(r for _, r, _ in spec.batch_schedule.phases) if spec.batch_schedule else spec.rows_per_lane
    per_step = (spec.lanes // world_size) * rows
    return max(2, -(-spec.shuffle.buffer // per_step) + 1) if spec.shuffle.buffer > 1 else 2
