"""``[fork]``: a recipe that continues another recipe's run, changed, from a declared step.

::

    [fork]
    parent = "base.toml"      # the recipe the run was started with (relative to this recipe's folder)
    fingerprint = "9c1e..."   # optional: the parent's fingerprint, refused if the parent changed
    step = 1000               # the first global batch made under this recipe

The fork's global batches ``0 .. step-1`` are the parent's, byte for byte (each lane runs the
parent's pipeline). At ``step`` every lane switches to this recipe's pipeline, started from a
state that is a function of the parent lane's checkpoint state at ``step`` alone (so it is the
same on every W, worker count and after any resume):

* its work source takes over, per dataset *name*, the records the parent lane had read up to
  the oldest flush point its state holds (the anchor its packer and shuffle window replay from):
  a dataset kept continues its stream there, a dataset added starts at its beginning, a dataset
  removed is no longer read. Up to one flush interval (``[pack] flush_every`` documents) and one
  shuffle window of records the parent had read by ``step`` may be read again, and the parts
  left of a long document in progress are not delivered;
* the mixture deficits start from zero, so the new weights hold from ``step`` on;
* packer, shuffle window and batch start empty; filters are this recipe's.

A finite parent or fork (every dataset ``policy = "stop"``) works too: before ``step`` each lane
delivers what the parent's run delivers (its padding after the lane's end under ``end = "pad"``),
a fork ends as its own recipe says, where its own data ends (:class:`ForkLanes`), and a step after
the parent's last step is refused.

What may differ from the parent: dataset weights and the schedule, datasets added or removed, and
``[[filters]]``. Anything else (seed, lanes, seq_len, packing, shuffling, the tokenizer, a kept
dataset's files or settings) is refused, naming the key.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

from torchdata.nodes import BaseNode

from zephon.engine import LaneContext, StateError, WorkerConfig, ZNode
from zephon.engine.checkpoint import is_lane_key, lane_state, seal_state, verify_state
from zephon.engine.end import LaneEnd
from zephon.engine.lanes import LaneSet, count_lane_steps
from zephon.engine.node import check_state_keys, state_int, state_node
from zephon.engine.router import lane_counts
from zephon.engine.workers import PoolSet

from .build import RecipeLanes
from .explain import explain_fork
from .filterspec import ForkSpec, parse_fork
from .lanesteps import cached_lane_steps
from .migrations import LANE_MIGRATIONS
from .spec import RecipeError

__all__ = ["ForkLane", "ForkLanes", "ForkSpec", "check_fork", "continued_source", "fork_checkpoint", "parse_fork"]

#: keys of the data definition a fork may change (datasets are compared one by one, weights aside)
FORKABLE = ("datasets", "schedule", "filters", "fork", "batch_schedule", "global_batch_size")
#: top-level keys of the data definition, checked before the sections (some derived from them)
_GIVEN = ("data_version", "seed", "lanes", "seq_len", "global_batch_size", "tokenizer")


def check_fork(parent: Mapping[str, Any], child: Mapping[str, Any]) -> None:
    """Refuse a fork whose data definition differs from its parent's other than by weights,
    datasets added or removed, the schedule and filters; the message names the key."""
    # the keys a user sets first: a change of seq_len also changes settings derived from it
    # ([mixing]'s), and the message names the key the user changed
    keys = sorted(set(parent) | set(child), key=lambda k: (k not in _GIVEN, _GIVEN.index(k) if k in _GIVEN else 0, k))
    for k in keys:
        if k not in FORKABLE and parent.get(k) != child.get(k):
            raise RecipeError(
                f"recipe: [fork]: {k!r} differs from the parent recipe ({parent.get(k)!r} -> {child.get(k)!r}); a fork "
                "may change dataset weights, the schedule, datasets added or removed and [[filters]] only. Start a "
                "new run for other changes"
            )
    theirs = {d.get("name"): d for d in parent.get("datasets", [])}
    for d in child.get("datasets", []):
        old = theirs.get(d.get("name"))
        if old is None:
            continue
        for k in sorted(set(old) | set(d)):
            if k != "weight" and old.get(k) != d.get(k):
                raise RecipeError(
                    f"recipe: [fork]: dataset {d.get('name')!r}: {k!r} differs from the parent recipe "
                    f"({old.get(k)!r} -> {d.get(k)!r}); a kept dataset may change its weight only (add it under "
                    "another name to read it differently)"
                )


def _check_batch_phases(parent: Any, child: Any, step: int) -> None:
    """A fork may change the batch size from its step on (``[[batch_schedule]]``, or the global
    batch): the steps before it are the parent's, so their batches must keep their size; and
    its row length stays the parent's (a fork's packer starts empty: no rule re-packs)."""
    points = sorted({s for s, _, _ in parent.batch_phases + child.batch_phases if s < step})
    for t in points:
        if (parent.rows_per_lane_at(t), parent.seq_len_at(t)) != (child.rows_per_lane_at(t), child.seq_len_at(t)):
            raise RecipeError(
                f"recipe: [fork]: at step {t}, before the fork step {step}, the batch is {child.rows_per_lane_at(t) * child.lanes} "
                f"rows of {child.seq_len_at(t)} here and {parent.rows_per_lane_at(t) * parent.lanes} rows of "
                f"{parent.seq_len_at(t)} in the parent; a fork changes the batch from its step on: keep the parent's "
                "phases before it in [[batch_schedule]]"
            )
    if {n for _, _, n in child.batch_phases} != {parent.seq_len_at(step)}:
        raise RecipeError(
            f"recipe: [fork]: seq_len must stay {parent.seq_len_at(step)} (the parent's at the fork step) in every phase; "
            "a fork may change the batch size, not the row length. Start a new run for a sequence-length change"
        )


def _find(state: Any, node_type: str) -> dict[str, Any] | None:
    """The innermost (last found, depth first) sub-state of ``node_type`` in a lane state."""
    found = None
    if isinstance(state, dict):
        if state.get("type") == node_type:
            found = state
        for v in state.values():
            found = _find(v, node_type) or found
    return found


def continued_source(
    parent_ws: Mapping[str, Any], parent_names: list[str], child_ws: dict[str, Any], child_names: list[str]
) -> dict[str, Any]:
    """The child work source's state at the fork: per dataset name, the parent's records read."""
    count = [0] * len(child_names)
    nbytes = [0] * len(child_names)
    for i, name in enumerate(child_names):
        if name in parent_names:
            j = parent_names.index(name)
            count[i], nbytes[i] = int(parent_ws["count"][j]), int(parent_ws["bytes"][j])
    zeros = [0] * len(child_names)
    return dict(
        child_ws,
        draws=sum(count),
        count=count,
        bytes=nbytes,
        phase=0,
        phase_bytes=list(zeros),
        phase_count=list(zeros),
        part=list(zeros),
    )


def _replace(state: Any, old: Any, new: Any) -> Any:
    if state is old:
        return new
    if isinstance(state, dict):
        return {k: _replace(v, old, new) for k, v in state.items()}
    return state


class ForkLane(ZNode[Any]):
    """One lane of a fork: the parent's pipeline before ``step``, this recipe's from it on
    (started from the parent lane's state at ``step``, see the module doc). State: the lane's
    step and the state of the pipeline in charge, as JSON text (the two pipelines' states have
    different keys; a node's state keys stay the same at every step)."""

    node_type = "fork_lane"

    def __init__(
        self,
        parent: BaseNode,
        make_child: Callable[[], BaseNode],
        *,
        step: int,
        parent_names: list[str],
        child_names: list[str],
        parent_steps: int | None = None,
        parent_pad: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__()
        self.parent, self.make_child, self.fork_step = parent, make_child, step
        self.parent_names, self.child_names = parent_names, child_names
        #: a finite parent's micro-batches in this lane, and its padding item after them (its end = "pad")
        self.parent_steps, self.parent_pad = parent_steps, parent_pad
        self.child: BaseNode | None = None
        self.t = 0

    def _repr_args(self):
        yield f"step={self.t}, fork at {self.fork_step}"

    def upstreams(self) -> list[BaseNode]:
        return [n for n in (self.parent, self.child) if n is not None]

    def ledger_counts(self) -> dict[str, int]:
        """The counts of the pipeline in charge (the parent's before the fork step, the child's from it)."""
        return lane_counts(self.parent if self.t < self.fork_step else self._child())

    def _child(self) -> BaseNode:
        if self.child is None:
            self.child = self.make_child()
        return self.child

    def _start_child(self) -> None:
        """Switch to the child pipeline, its work source continued from the parent's state."""
        child = self._child()
        fresh = child.state_dict()
        ws = _find(fresh, "work_source")
        pws = _find(self.parent.state_dict(), "work_source") if self.fork_step > 0 else None
        if ws is not None and pws is not None:
            fresh = _replace(fresh, ws, continued_source(pws, self.parent_names, ws, self.child_names))
        batch = _find(fresh, "batch")
        if batch is not None and "step" in batch.get("extra", {}):  # a [[batch_schedule]]: rows of step `step` on
            fresh = _replace(fresh, batch, dict(batch, extra={"step": self.fork_step}))
        child.reset(fresh)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.t = 0
            if self.fork_step == 0:
                self._start_child()
            else:
                self.parent.reset(None)
            return
        check_state_keys(self, initial_state, ("step", "on", "lane"))
        t = state_int(self, "step", initial_state["step"])
        on = initial_state["on"]
        if not ((on == "parent" and t <= self.fork_step) or (on == "child" and t >= self.fork_step)):
            raise StateError(f"{self!r}: state field 'on' is {on!r} at step {t}, fork step {self.fork_step}")
        try:
            inner = state_node(self, "lane", json.loads(initial_state["lane"]))
        except (TypeError, ValueError):
            raise StateError(f"{self!r}: state field 'lane' must be a lane state as JSON text") from None
        if on == "parent":  # a parent checkpoint at the fork step: the child starts from it
            self.parent.reset(inner)
            self.t = t
            if t == self.fork_step:
                self._start_child()
            return
        self._child().reset(inner)
        self.t = t

    def get_state(self) -> dict[str, Any]:
        node = self.parent if self.t < self.fork_step else self._child()
        on = "parent" if self.t < self.fork_step else "child"
        return self._tagged({"step": self.t, "on": on, "lane": json.dumps(node.state_dict(), sort_keys=True)})

    def _next_of_parent(self) -> Any:
        """The parent lane's micro-batch, as the parent's own run delivers it: a finite parent's
        lane past its end gives its padding item, and at its last micro-batch its stream is read
        to the end (what the router does in the parent's run, so the state at the fork is the same)."""
        n = self.parent_steps
        if n is None:
            return next(self.parent)
        if self.t >= n:
            if self.parent_pad is None:  # refused by ForkLanes: a "drop" parent ends after the fork step
                raise StateError(f"{self!r}: the parent lane ended after {n} micro-batches, before the fork step")
            return self.parent_pad()
        out = next(self.parent)
        if self.t + 1 == n:
            for _ in self.parent:  # records after the last row that produce nothing
                raise StateError(f"{self!r}: the parent lane holds more than the {n} micro-batches it was counted to")
        return out

    def next(self) -> Any:
        if self.t < self.fork_step:
            out = self._next_of_parent()
            self.t += 1
            if self.t == self.fork_step:
                self._start_child()
            return out
        out = next(self._child())
        self.t += 1
        return out


def _parent_end(parent: LaneSet, step: int, ctx: LaneContext) -> LaneEnd | None:
    """A finite parent's end (its cached counts, else a count), refusing a fork step after it."""
    end = parent.lane_end(lanes=ctx.lanes, seed=ctx.seed, workers=ctx.workers, pools=ctx.pools)
    if end is not None and step > end.steps:
        raise RecipeError(
            f"recipe: [fork] step {step} is after the parent run's last step (its data ends after {end.steps} steps, "
            f"end = {end.mode!r}): fork at a step <= {end.steps}"
        )
    return end


def _fork_lane(
    parent: LaneSet, child: LaneSet, step: int, names: tuple[list[str], list[str]], ctx: LaneContext
) -> BaseNode:
    end = _parent_end(parent, step, ctx)
    pad = functools.partial(parent.pad_item, ctx.lane) if parent.end_mode == "pad" else None
    return ForkLane(
        parent(ctx),
        functools.partial(child, ctx),
        step=step,
        parent_names=names[0],
        child_names=names[1],
        parent_steps=None if end is None else end.lane_steps[ctx.lane],
        parent_pad=pad,
    )


class ForkLanes(LaneSet):
    """The lanes of a fork (:class:`ForkLane`); checkpoints carry the child's shared values.

    A fork ends as its own recipe says (``end`` of the child; a fork that reads only datasets with
    ``policy = "stop"`` ends where its own data ends): its per-lane counts are those of the fork's
    lanes (the parent's micro-batches before the step, the child's after it), a dry run cached under
    the fork's fingerprint. A finite parent's lanes before the fork step are delivered as the
    parent's run delivers them (padding after a lane's end), and a fork step after the parent's
    last step is refused."""

    lane_migrations = LANE_MIGRATIONS

    def __init__(self, parent: RecipeLanes, child: RecipeLanes, step: int) -> None:
        _check_batch_phases(parent.prepared.spec, child.prepared.spec, step)
        names = ([s.name for s in parent.prepared.spec.datasets], [s.name for s in child.prepared.spec.datasets])
        end = child.end_mode
        super().__init__(
            functools.partial(_fork_lane, parent, child, step, names),
            end=end,
            pad=child.pad_item if end == "pad" else None,
        )
        self.parent, self.child, self.step = parent, child, step

    def count_steps(
        self, *, lanes: int, seed: int, workers: WorkerConfig | None = None, pools: PoolSet | None = None
    ) -> list[int]:
        """The fork's per-lane micro-batch counts: cached under the fork's fingerprint (with the
        parent's token estimates), else a dry run of every fork lane."""

        def count() -> list[int]:
            return count_lane_steps(self.build, lanes=lanes, seed=seed, workers=workers, pools=pools)

        also = json.dumps(self.parent.prepared.shared_state().get("token_estimates"), sort_keys=True)
        return cached_lane_steps(self.child.prepared, count, also)

    def _fork(self) -> dict[str, Any]:
        return {"parent": self.parent.prepared.fingerprint[:16], "step": self.step}

    def shared_state(self) -> dict[str, Any]:
        """The child's values, the fork's own end (its lanes' counts) and the fork."""
        return {**self.child.shared_state(), **LaneSet.shared_state(self), "fork": self._fork()}

    def explain_fingerprint(self, fingerprint: str, shared: Mapping[str, Any] | None = None) -> str:
        """The parent run's checkpoint (convert it), another fork step or parent, or what the
        child recipe can tell (its filters, its data version)."""
        if fingerprint == self.parent.prepared.fingerprint:
            return (
                f"It is the parent run's checkpoint: convert it with recipe.continue_state(state) (one written at or "
                f"before the fork step {self.step}; `zephon hashes --resume` converts it itself) to resume it as this fork."
            )
        shared = shared if isinstance(shared, Mapping) else {}
        fork = explain_fork(shared.get("fork"), self._fork())
        rest = self.child.explain_fingerprint(fingerprint, {k: v for k, v in shared.items() if k != "fork"})
        return " ".join(h for h in (fork, rest) if h)

    def adopt(self, shared: Mapping[str, Any]) -> LaneSet:
        """The child lanes the checkpoint's values describe, and the fork's end it carries; a
        refused checkpoint of a run that is not a fork (the parent's) names the conversion."""
        try:
            child = self.child.adopt({k: v for k, v in shared.items() if k not in LaneSet.shared_keys})
        except StateError as e:
            if "fork" in shared:
                raise
            raise StateError(
                f"{e}. The checkpoint is not a fork's: if it is the parent run's, convert it with "
                f"recipe.continue_state(state) (one written at or before the fork step {self.step}; `zephon hashes "
                "--resume` converts it itself)"
            ) from None
        if child is self.child:
            return self.adopt_end(shared)
        if not isinstance(child, RecipeLanes):
            raise StateError("a fork's checkpoint must describe a recipe's lanes")
        return ForkLanes(self.parent, child, self.step).adopt_end(shared)

    def __repr__(self) -> str:
        return f"ForkLanes(step={self.step}, parent={self.parent!r}, child={self.child!r})"


def fork_checkpoint(
    state: Mapping[str, Any], *, parent: str, fork: str, step: int, shared: Mapping[str, Any]
) -> dict[str, Any]:
    """A checkpoint of the parent run (fingerprint ``parent``) taken at or before the fork
    ``step``, as the fork's (fingerprint ``fork``, its ``shared`` values): each lane's state
    wrapped as a :class:`ForkLane`'s, the whole resealed. Anything else is refused, naming it."""
    verify_state(state)
    if state.get("fingerprint") != parent:
        raise StateError(
            f"the checkpoint's fingerprint is {state.get('fingerprint')!r}, not the fork's parent recipe's {parent!r}: "
            "it belongs to another run (or the parent recipe or its data changed)"
        )
    t = state.get("step")
    if not isinstance(t, int) or t > step:
        raise StateError(
            f"the checkpoint was written at step {t}, after the fork step {step}: the parent's batches from {step} on "
            "were already consumed. Resume from a checkpoint at or before the fork step, or fork at a later step"
        )
    out: dict[str, Any] = {k: v for k, v in state.items() if not is_lane_key(k) and k != "digest"}
    out.update(fingerprint=fork, shared=dict(shared))
    for k in state:
        if is_lane_key(k):
            inner = lane_state(state, int(k[5:]))
            out[k] = {
                "type": ForkLane.node_type,
                "version": ForkLane.state_version,
                "step": t,
                "on": "parent",
                "lane": json.dumps(inner, sort_keys=True),
            }
    return seal_state(out)
