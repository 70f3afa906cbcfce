"""One rank's batches of a recipe, step by step: what a training loop and ``zephon hashes`` share.

A recipe step is one global batch (``global_batch_size`` rows). Rank ``r`` of ``W`` owns the lanes
:func:`zephon.engine.lanes.lanes_of_rank` gives it and gets their rows of each step (in lane order); a
trainer that asks for ``local_batch_size`` rows at a time gets each step in consecutive slices.
:class:`RankBatches` owns those rules, so that adapters (TorchTitan's loader) and tools
(``zephon hashes``) do not restate them:

- the world-size check and the lanes of the rank (the engine's ``lanes_of_rank``);
- the rows per step and the slices of a step;
- "a checkpoint falls between recipe steps" (the rows still owed by a half-used step cannot
  be redistributed to another world size);
- the end of a finite recipe (the same step on every rank): the final state, kept resumable,
  and the workers released.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

from zephon.engine import PipelineError, StateError, WorkerConfig
from zephon.engine.digest import ledger_digest
from zephon.engine.end import LaneEnd
from zephon.engine.lanes import check_world_size, divisors, lanes_of_rank
from zephon.engine.router import GlobalLoader, Router

from .recipe import Recipe

__all__ = ["RankBatches"]


class RankBatches:
    r"""The batches of rank ``rank`` of ``world_size`` (``rank=None``: every rank in this process,
    i.e. the global batches), one recipe step at a time, sliced ``local_batch_size`` rows a time.

    ``hints`` adds a caller's fix to a refusal (keys ``"world_size"``, ``"local_batch_size"``,
    ``"between_steps"``), e.g. the command-line flag of a trainer.

    >>> import json, os, tempfile
    >>> from zephon.data import BUNDLED_TOKENIZER
    >>> root = tempfile.mkdtemp()
    >>> with open(os.path.join(root, "web.jsonl"), "w") as f:
    ...     f.writelines(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(200))
    >>> recipe = Recipe.from_dict({"seed": 1, "lanes": 16, "seq_len": 64, "global_batch_size": 32,
    ...     "tokenizer": {"path": BUNDLED_TOKENIZER}, "shuffle": {"buffer": 1},
    ...     "datasets": [{"name": "web", "path": "web.jsonl", "weight": 1.0}]}, base_dir=root)
    >>> rb = RankBatches(recipe, 2, 1, local_batch_size=4, workers=WorkerConfig(0))
    >>> rb.lanes, rb.rows_per_step, rb.microbatches_per_step
    (range(8, 16), 16, 4)
    >>> batch, lo, hi = rb.next_slice()
    >>> (lo, hi), rb.between_steps
    ((0, 4), False)
    >>> for _ in range(3):
    ...     _ = rb.next_slice()
    >>> rb.between_steps, rb.step   # a checkpoint may be taken now
    (True, 1)
    >>> rb.close()
    """

    def __init__(
        self,
        recipe: Recipe,
        world_size: int = 1,
        rank: int | None = 0,
        *,
        local_batch_size: int | None = None,
        workers: WorkerConfig | None = None,
        digests: bool = False,
        hints: Mapping[str, str] | None = None,
    ) -> None:
        self.recipe, self.world_size, self.rank = recipe, world_size, rank
        self._hints = dict(hints or {})
        try:
            if rank is None:
                check_world_size(recipe.lanes, world_size)
                self.lanes = range(recipe.lanes)
            else:
                self.lanes = lanes_of_rank(recipe.lanes, world_size, rank)
        except ValueError as e:
            raise ValueError(self._hinted(str(e), "world_size")) from None
        n = len(self.lanes)
        phases = [(step, g // recipe.lanes * n) for step, g, _ in recipe.batch_phases]
        rows = math.gcd(*(r for _, r in phases))  # every phase's rows are a multiple of it
        lbs = rows if local_batch_size is None else int(local_batch_size)
        bad = [(step, r) for step, r in phases if lbs < 1 or r % lbs]
        if bad:
            step, r = bad[0]
            who = "the world" if rank is None else f"each of {world_size} ranks"
            when = f" from step {step}" if len(phases) > 1 else ""
            raise ValueError(
                self._hinted(
                    f"the recipe's global batch{when} is {r // n * recipe.lanes} rows, so {who} gets {r} rows per "
                    f"step, which local_batch_size = {lbs} does not divide; use one of {divisors(rows)}, or change "
                    "the recipe's global_batch_size.",
                    "local_batch_size",
                )
            )
        self.local_batch_size = lbs
        self._workers, self._digests = workers, digests
        # next_step / next_slice / state_dict / load_state_dict from any thread: a state taken
        # by a checkpointer thread matches the step last handed out
        self._lock = threading.RLock()
        self._source: Router | GlobalLoader = self._open()
        self._closed = False
        self._batch: dict[str, Any] | None = None
        self._rows = 0  # rows of the current step
        self._offset = 0  # rows of the current step already handed out
        self._end_state: dict[str, Any] | None = None  # the state at the end of a finite recipe
        self._end: LaneEnd | None = None
        #: True after the end of a finite recipe (until a state is loaded)
        self.ended = False

    def rows_at(self, step: int) -> int:
        """Rows of recipe step ``step`` this rank (or, with rank None, the world) gets."""
        return self.recipe.rows_per_lane_at(step) * len(self.lanes)

    def microbatches_at(self, step: int) -> int:
        """Slices of recipe step ``step`` (a trainer's gradient-accumulation steps x pipeline
        microbatches): more for a larger global batch, each ``local_batch_size`` rows."""
        return self.rows_at(step) // self.local_batch_size

    @property
    def rows_per_step(self) -> int:
        """Rows of the step being handed out (between steps: of the next one)."""
        return self.rows_at(self.step - 1 if not self.between_steps else self.step)

    @property
    def microbatches_per_step(self) -> int:
        """Slices of the step being handed out (between steps: of the next one)."""
        return self.rows_per_step // self.local_batch_size

    def _hinted(self, message: str, key: str) -> str:
        hint = self._hints.get(key)
        return f"{message} {hint}" if hint else message

    def _open(self) -> Router | GlobalLoader:
        r, workers, digests = self.recipe, self._workers, self._digests
        if self.rank is None:
            return r.global_loader(self.world_size, workers=workers, digests=digests)
        return r.router(self.world_size, self.rank, workers=workers, digests=digests)

    # -- iteration ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Recipe steps fetched so far (counting from the start of the run, resumes included)."""
        return self._source.step

    @property
    def router(self) -> Router:
        """This rank's router (metrics, digests); not for ``rank=None``."""
        if not isinstance(self._source, Router):
            raise PipelineError("RankBatches(rank=None) has one router per rank; build it with a rank")
        return self._source

    @property
    def routers(self) -> list[Router]:
        """The routers of this rank (every rank's for ``rank=None``), in lane order: their
        ``summary_metrics`` (skips, packing) are :func:`zephon.recipe.loader_metrics.summary_of`'s."""
        return list(self._source.routers) if isinstance(self._source, GlobalLoader) else [self._source]

    @property
    def end(self) -> LaneEnd | None:
        """Where a finite recipe ends (None: it never does)."""
        return self._end if self.ended else self._source.end

    def next_step(self) -> dict[str, Any]:
        """The whole next recipe step (this rank's rows, numpy); StopIteration at the end of the data."""
        with self._lock:
            return self._next_step()

    def _next_step(self) -> dict[str, Any]:
        if self.ended:
            raise StopIteration
        try:
            batch = next(self._source)
        except StopIteration:
            self._finish()
            raise
        self._batch, self._rows = batch, self.rows_at(self.step - 1)
        self._offset = self._rows
        return batch

    def next_slice(self) -> tuple[dict[str, Any], int, int]:
        """``(step batch, lo, hi)``: the next ``local_batch_size`` rows ``lo:hi`` of the current
        recipe step, fetching the next step when this one is used up (``lo == 0``)."""
        with self._lock:
            if self._batch is None or self._offset >= self._rows:
                self._next_step()
                self._offset = 0
            assert self._batch is not None
            lo = self._offset
            self._offset = lo + self.local_batch_size
            return self._batch, lo, self._offset

    @property
    def between_steps(self) -> bool:
        """True when no recipe step is half handed out (a checkpoint may be taken)."""
        return self._batch is None or not 0 < self._offset < self._rows

    def lane_digests(self) -> list[str]:
        """The digests of the last step's lane micro-batches, in lane order (built with ``digests=True``)."""
        routers = self._source.routers if isinstance(self._source, GlobalLoader) else [self._source]
        out: list[str] = []
        for r in routers:
            if r.last_lane_digests is None:
                raise PipelineError("no lane digests: build RankBatches with digests=True and fetch a step first")
            out.extend(r.last_lane_digests)
        return out

    def lane_counts(self) -> list[dict[str, int]]:
        """Each lane's ledger counts after the last step (documents filtered per filter and
        dataset, see :func:`zephon.engine.router.lane_counts`), in lane order; {} where unknown."""
        routers = self._source.routers if isinstance(self._source, GlobalLoader) else [self._source]
        out: list[dict[str, int]] = []
        for r in routers:
            counts = getattr(r, "last_lane_counts", None)
            out.extend(counts if counts is not None else [{} for _ in (r.last_lane_digests or [])])
        return out

    def step_digest(self) -> str:
        """:func:`zephon.engine.digest.ledger_digest` of the last step's lanes (what a batch ledger records)."""
        return ledger_digest(self.lane_digests())

    def _finish(self) -> None:
        """The end of a finite recipe: keep the final state (resumable anywhere), release the workers."""
        self.ended = True
        self._batch = None
        self._end = self._source.end
        self._end_state = self._source.state_dict()
        self.close()

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Lane-keyed state (see :func:`zephon.engine.checkpoint.encode_state`); refused in the middle of a step."""
        with self._lock:
            return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        if not self.between_steps:
            raise StateError(
                self._hinted(
                    f"state_dict() called after {self._offset // self.local_batch_size} of "
                    f"{self.microbatches_per_step} microbatches of recipe step {self.step}. A checkpoint must fall "
                    "between recipe steps (the rows a half-used step still owes cannot go to another world size).",
                    "between_steps",
                )
            )
        if self._end_state is not None:
            return self._end_state
        return self._source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the lanes of this rank (or every rank) from a merged or per-rank lane-keyed state."""
        with self._lock:
            self._load_state_dict(state)

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        if self._closed:  # ended or closed earlier: a fresh source takes the state
            self._source = self._open()
            self._closed = False
        if isinstance(self._source, GlobalLoader):
            self._source.load_state_dict(state)
        else:
            self._source.reset(state)
        self._batch, self._offset = None, 0
        self._end_state, self._end, self.ended = None, None, False

    def close(self) -> None:
        """Stop the workers and prefetch threads (idempotent)."""
        self._closed = True
        self._source.close()

    def __enter__(self) -> RankBatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        who = "all ranks" if self.rank is None else f"rank {self.rank}"
        return (
            f"RankBatches({who} of {self.world_size}, lanes {self.lanes.start}..{self.lanes.stop - 1}, "
            f"step {self.step}, rows_per_step={self.rows_per_step}, local_batch_size={self.local_batch_size})"
        )
