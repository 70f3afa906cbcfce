"""zephon's batches as a ``torch.utils.data.IterableDataset``: plain loops, ``StatefulDataLoader``,
HF Trainer and Lightning get a rank's rows, and resume exactly, on any world size.

:class:`ZephonIterableDataset` yields the rows of one data-parallel rank one at a time, in the
native loader's order (``Recipe.router(world_size, rank)``'s local batches, row by row). A
``DataLoader(ds, batch_size=local_batch_size)`` then yields exactly the native batches sliced
``local_batch_size`` rows at a time, as tensors (``tests/integrations/test_torch_data.py``
compares the bytes).

State: the dataset (it is its own iterator) has ``state_dict()`` / ``load_state_dict()``, the
protocol ``torchdata.stateful_dataloader.StatefulDataLoader`` uses. Its state is a small dict:
the lane-keyed zephon state of the last recipe step boundary and how many rows of the next step
were handed out since (``rows``). A ``StatefulDataLoader`` state loads into a loader of the same
world size and worker count; for another world size or worker count, merge the states of every
rank with :func:`zephon_state` and give that to the new datasets (``load_state_dict`` before the
loader is built): a state taken between recipe steps (every ``rows_per_step / local_batch_size``
batches) resumes anywhere, one taken in the middle of a step only on the same layout.

Loader workers (``num_workers = n > 0``): zephon already parallelizes inside (its own thread or
process pool, ``workers=``), so loader workers are optional. With them, each loader worker runs
its own, disjoint lanes: batch ``k`` of a rank comes from worker ``k % n`` (the loader's
in-order round robin), so worker ``w`` builds the batches ``w, w + n, ...`` of every step, that
is always the same slices of each step, hence the same lanes. This needs ``local_batch_size`` a
multiple of the recipe's rows per lane and ``n`` dividing the batches per step; other settings
are refused with a message naming the values that work (any other split would make two workers
compute one lane, or change which rows form a batch).

    >>> import json, os, tempfile
    >>> from torchdata.stateful_dataloader import StatefulDataLoader
    >>> from zephon.recipe import Recipe
    >>> from zephon.data import BUNDLED_TOKENIZER
    >>> root = tempfile.mkdtemp()
    >>> with open(os.path.join(root, "web.jsonl"), "w") as f:
    ...     f.writelines(json.dumps({"text": f"document {i} " * 30}) + "\\n" for i in range(100))
    >>> recipe = Recipe.from_dict({"seed": 1, "lanes": 4, "seq_len": 32, "global_batch_size": 8,
    ...     "tokenizer": {"path": BUNDLED_TOKENIZER}, "shuffle": {"buffer": 4}, "workers": {"count": 0},
    ...     "datasets": [{"name": "web", "path": "web.jsonl", "weight": 1.0}]}, base_dir=root)
    >>> ds = ZephonIterableDataset(recipe, world_size=2, rank=0, local_batch_size=2)
    >>> loader = StatefulDataLoader(ds, batch_size=2)
    >>> it = iter(loader)
    >>> batch = next(it); batch["input"].shape, batch["input"].dtype
    (torch.Size([2, 32]), torch.int64)
    >>> state = loader.state_dict()          # after 1 of 2 batches of the rank's first step
    >>> after = next(it)
    >>> again = StatefulDataLoader(ZephonIterableDataset(recipe, world_size=2, rank=0, local_batch_size=2), batch_size=2)
    >>> again.load_state_dict(state)
    >>> bool((next(iter(again))["input"] == after["input"]).all())
    True
    >>> ds.close()
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from zephon.engine import StateError, WorkerConfig
from zephon.engine.checkpoint import is_lane_key, merge_states
from zephon.engine.lanes import divisors, lanes_of_rank
from zephon.engine.router import Router
from zephon.engine.workers import PoolSet
from zephon.recipe import Recipe

__all__ = ["FIELDS", "STYLES", "ZephonIterableDataset", "zephon_state"]

#: the per-row fields a row carries by default (``provenance`` varies in length: not collatable)
FIELDS = ("input", "labels", "positions", "document_ids", "dataset")
#: "zephon": the fields as named in zephon's batches; "hf": Hugging Face causal-LM names
#: (``input_ids``, ``labels`` and ``shift_labels`` = zephon's already shifted labels, so the
#: model's loss does not shift them again, ``position_ids``)
STYLES = ("zephon", "hf")


def _dist_layout() -> tuple[int, int]:
    """(world size, rank) from torch.distributed when it is initialized, else (1, 0)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


class ZephonIterableDataset(IterableDataset):
    """The rows of rank ``rank`` of ``world_size`` of a recipe (module doc), one at a time.

    ``recipe``: a :class:`~zephon.Recipe` or the path of its TOML. ``world_size`` / ``rank``:
    given, else from ``torch.distributed``, else 1 / 0. ``local_batch_size``: the loader's
    ``batch_size`` (default: the rank's rows per step); it decides the lanes of each loader
    worker. ``workers`` overrides the recipe's ``[workers]`` (zephon's own pool, per loader
    worker). ``fields`` / ``style``: what a row holds and how its keys are named.
    """

    def __init__(
        self,
        recipe: Recipe | str | os.PathLike,
        *,
        world_size: int | None = None,
        rank: int | None = None,
        local_batch_size: int | None = None,
        workers: WorkerConfig | None = None,
        fields: Sequence[str] = FIELDS,
        style: str = "zephon",
    ) -> None:
        super().__init__()
        self.recipe = recipe if isinstance(recipe, Recipe) else Recipe.from_toml(recipe)
        if (world_size is None) != (rank is None):
            raise ValueError("give both world_size and rank, or neither (then torch.distributed's are used)")
        if world_size is None or rank is None:
            world_size, rank = _dist_layout()
        self.world_size, self.rank = int(world_size), int(rank)
        lanes = lanes_of_rank(self.recipe.lanes, self.world_size, self.rank)
        self._lanes = len(lanes)
        #: rows of recipe step 0 this rank gets (:meth:`rows_at` for a ``[[batch_schedule]]``)
        self.rows_per_step = self.recipe.rows_per_lane * len(lanes)
        lbs = self.rows_per_step if local_batch_size is None else int(local_batch_size)
        for step, g, _ in self.recipe.batch_phases:
            rows = g // self.recipe.lanes * len(lanes)
            if lbs < 1 or rows % lbs:
                raise ValueError(
                    f"rank {self.rank} of {self.world_size} gets {rows} rows per recipe step (from step {step}), "
                    f"which local_batch_size = {lbs} does not divide; use one of {divisors(rows)}"
                )
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        self.local_batch_size, self.workers, self.style = lbs, workers, style
        self.fields = tuple(fields)
        self._routers: list[Router] | None = None
        self._pools: PoolSet | None = None
        self._pending: dict[str, Any] | None = None  # a loaded state, applied on the next row
        self._layout: dict[str, int] | None = None
        self._anchor: dict[str, Any] | None = None  # the zephon state before the current step
        self._prev_anchor: dict[str, Any] | None = None  # ... and before the step before it
        self._step: dict[str, np.ndarray] | None = None
        self._row = 0  # rows of the current step handed out

    def rows_at(self, step: int) -> int:
        """Rows of recipe step ``step`` this rank gets: a ``DataLoader(batch_size=local_batch_size)``
        yields ``rows_at(step) / local_batch_size`` batches for it (more for a larger global batch)."""
        return self.recipe.rows_per_lane_at(step) * self._lanes

    def rows_before(self, step: int) -> int:
        """Rows this rank gets in steps ``0 .. step - 1``."""
        phases = self.recipe.batch_phases
        ends = [s for s, _, _ in phases[1:]] + [step]
        L = self.recipe.lanes
        return sum(max(0, min(e, step) - s) * (g // L) * self._lanes for (s, g, _), e in zip(phases, ends))

    # -- layout: which lanes this process runs ----------------------------------------------
    def layout(self) -> dict[str, int]:
        """World size, rank, local batch size, loader workers and this worker's id (0 in the main process)."""
        info = get_worker_info()
        n, w = (info.num_workers, info.id) if info is not None else (0, 0)
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "local_batch_size": self.local_batch_size,
            "num_workers": n,
            "worker": w,
        }

    def _slices(self, lay: Mapping[str, int]) -> list[tuple[int, int]]:
        """The (world size, rank) of each router this process runs: the rank's one router, or
        with n loader workers this worker's slices of each step (refused unless exact)."""
        n, w = lay["num_workers"], lay["worker"]
        if n <= 1:
            return [(self.world_size, self.rank)]
        if len(self.recipe.batch_phases) > 1:
            raise ValueError(
                f"ZephonIterableDataset with {n} loader workers: the recipe's [[batch_schedule]] changes the rows per "
                "step, so a loader worker's slices would change lanes at each phase; use num_workers=0 and zephon's "
                "own workers (the recipe's [workers], or workers=) for parallelism"
            )
        lbs, rpl, L = self.local_batch_size, self.recipe.rows_per_lane, self.recipe.lanes
        per_step = self.rows_per_step // lbs
        if lbs % rpl or per_step % n:
            ok_n = [d for d in divisors(per_step) if d > 1] if lbs % rpl == 0 else []
            raise ValueError(
                f"ZephonIterableDataset with {n} loader workers: rank {self.rank} of {self.world_size} hands out "
                f"{per_step} batches of {lbs} rows per recipe step, each lane {rpl} rows. Loader workers must run "
                f"disjoint lanes, so local_batch_size must be a multiple of {rpl} and num_workers must divide "
                f"the batches per step ({'num_workers in ' + str(ok_n) if ok_n else 'no num_workers > 1 works here'}); "
                "or use num_workers=0 and zephon's own workers (the recipe's [workers], or workers=) for parallelism"
            )
        k = lbs // rpl  # lanes per slice (= per batch)
        first = self.rank * per_step
        return [(L // k, first + s) for s in range(w, per_step, n)]

    def _open(self) -> None:
        lay = self.layout()
        slices = self._slices(lay)
        self._pools = PoolSet()
        self._routers = [self.recipe.router(ws, r, workers=self.workers, pools=self._pools) for ws, r in slices]
        self._layout = lay
        self._step, self._row = None, 0
        pending, self._pending = self._pending, None
        rows = 0
        if pending is not None and pending.get("zephon") is not None:
            rows = self._check_pending(pending, lay)
            for r in self._routers:
                r.reset(pending["zephon"])
        self._anchor = self._merged()
        if rows:
            self._fetch()
            self._row = rows

    def _check_pending(self, pending: Mapping[str, Any], lay: Mapping[str, int]) -> int:
        rows = pending.get("rows", 0)
        if type(rows) is not int or rows < 0:
            raise StateError(f"ZephonIterableDataset state 'rows' must be an integer >= 0, got {rows!r}")
        if rows:
            was = pending.get("layout")
            if was != dict(lay):
                raise StateError(
                    f"this state was taken {rows} rows into a recipe step with the layout {was}; such a state resumes "
                    f"only on that layout, not on {dict(lay)}. Take checkpoints between recipe steps (every "
                    f"{self.rows_per_step // self.local_batch_size} batches of {self.local_batch_size} rows here) to "
                    "resume on another world size or worker count"
                )
        return rows

    def _merged(self) -> dict[str, Any]:
        assert self._routers is not None
        states = [r.state_dict() for r in self._routers]
        return states[0] if len(states) == 1 else merge_states(states)

    def _fetch(self) -> None:
        assert self._routers is not None
        parts = [next(r) for r in self._routers]
        self._step = {k: np.concatenate([p[k] for p in parts]) for k in self.fields}
        self._row = 0

    # -- the iterator protocol --------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._routers is None:
            self._open()
        if self._step is None or self._row >= len(self._step[self.fields[0]]):
            if self._step is not None:
                self._prev_anchor, self._anchor = self._anchor, self._merged()
            self._fetch()
        assert self._step is not None
        i = self._row
        self._row += 1
        row = {k: v[i] for k, v in self._step.items()}
        return self._styled(row)

    def _styled(self, row: dict[str, Any]) -> dict[str, Any]:
        if self.style == "zephon":
            return row
        out = {"input_ids": row["input"], "labels": row["labels"], "shift_labels": row["labels"]}
        if "positions" in row:
            out["position_ids"] = row["positions"]
        return out

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"zephon": lane-keyed state of the last step boundary, "rows": rows of the next step
        handed out, "layout": ...}``; ``zephon`` is None before the first row (nothing loaded)."""
        if self._routers is None:
            if self._pending is not None:
                return dict(self._pending)
            return {"zephon": None, "rows": 0, "layout": self.layout()}
        assert self._layout is not None
        if self._step is not None and self._row >= len(self._step[self.fields[0]]):
            return {"zephon": self._merged(), "rows": 0, "layout": dict(self._layout)}
        rows = self._row if self._step is not None else 0
        return {"zephon": self._anchor, "rows": rows, "layout": dict(self._layout)}

    def state_dict_at(self, rows: int) -> dict[str, Any]:
        """The state after ``rows`` rows of the run (counted from its start, resumes included) were
        consumed, for a consumer that fetches ahead of what it consumed (accelerate's loader
        holds one batch): at most the current and the previous recipe step back."""
        st = self.state_dict()
        if st["zephon"] is None:
            return st
        for anchor in (self._anchor if st["rows"] else st["zephon"], self._anchor, self._prev_anchor):
            if anchor is None:
                continue
            done = self.rows_before(anchor["step"])
            if 0 <= rows - done < self.rows_at(anchor["step"]):
                return {"zephon": anchor, "rows": rows - done, "layout": st["layout"]}
        raise StateError(
            f"no state for {rows} rows consumed: the dataset has handed out rows up to step "
            f"{st['zephon']['step']} (+{st['rows']} rows) and keeps the states of its last two recipe steps"
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (same layout), or from :func:`zephon_state`'s merged
        lane-keyed state (any world size and worker count); applied on the next row."""
        if not isinstance(state, Mapping):
            raise StateError(f"ZephonIterableDataset state must be a dict, got {type(state).__name__}")
        if "zephon" not in state and any(is_lane_key(k) for k in state):
            state = {"zephon": dict(state), "rows": 0, "layout": None}
        self.close()
        self._pending = dict(state)

    def close(self) -> None:
        """Stop zephon's workers (a later row reopens from the current state)."""
        if self._routers is not None:
            keep = self.state_dict()
            for r in self._routers:
                r.close()
            self._routers = None
            self._pending = keep
        if self._pools is not None:
            self._pools.close()
            self._pools = None

    def __getstate__(self) -> dict[str, Any]:  # loader workers get a fresh copy, without live routers
        d = self.__dict__.copy()
        d.update(_routers=None, _pools=None, _step=None)
        return d

    def __repr__(self) -> str:
        return (
            f"ZephonIterableDataset(rank {self.rank} of {self.world_size}, rows_per_step={self.rows_per_step}, "
            f"local_batch_size={self.local_batch_size}, style={self.style!r}, {self.recipe!r})"
        )


def _dataset_states(state: Any) -> Iterator[Mapping[str, Any]]:
    """Every ZephonIterableDataset state inside a (StatefulDataLoader) state, however nested."""
    if isinstance(state, Mapping):
        if "zephon" in state and "rows" in state:
            yield state
            return
        for v in state.values():
            yield from _dataset_states(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _dataset_states(v)


def zephon_state(states: Sequence[Any]) -> dict[str, Any]:
    """One lane-keyed zephon state from the ``StatefulDataLoader.state_dict()`` (or dataset
    states) of every rank of a run, any worker count: load it into new datasets of any world
    size with ``load_state_dict``. Refused when a state was taken in the middle of a recipe step."""
    found = [s for st in states for s in _dataset_states(st)]
    if not found:
        raise StateError("no ZephonIterableDataset state found in the given states")
    for s in found:
        if s.get("rows"):
            raise StateError(
                f"a state was taken {s['rows']} rows into a recipe step (layout {s.get('layout')}); only states "
                "taken between recipe steps can be merged for another world size or worker count"
            )
    zs = [s["zephon"] for s in found if s.get("zephon") is not None]
    if not zs:
        raise StateError("the states hold no zephon state yet (taken before the first batch)")
    steps = {z.get("step") for z in zs}
    if len(steps) != 1:
        raise StateError(f"the states were taken at different recipe steps {sorted(map(str, steps))}; give one step's")
    return merge_states(zs)
