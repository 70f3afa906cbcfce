"""Test helpers for zephon nodes, including your own.

:func:`check_node` is the one helper every node test uses: it runs a node to the end, then
restores a fresh instance from the state at every step (after a JSON round trip) and checks
that the restored node reports the state it was given, that the rest of the output *and of the
states* is identical to the uninterrupted run's, that the state keys never change, and that
``close()`` leaves no threads or processes behind. :class:`RangeSource` and :class:`ToyPacker`
are the synthetic source and accumulator the engine's own tests use.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from .accumulator import Accumulator
from .digest import batch_sha256
from .lanes import LaneContext
from .mapper import OrderedMapper
from .node import ZNode, check_state_keys, json_roundtrip, state_int
from .seeding import lane_rng
from .workers import ProcessLocal

__all__ = [
    "AddOffset",
    "ListSource",
    "NodeCheck",
    "RangeSource",
    "ToyBatch",
    "ToyPacker",
    "ToyShuffle",
    "assert_no_leaks",
    "check_node",
    "key_shape",
    "toy_lane",
]


class RangeSource(ZNode[int]):
    """Lane ``lane`` of ``lanes`` reads the integers ``lane, lane+L, lane+2L, ...`` below ``n``.

    ``n=None`` is infinite. State is one cursor; ``reads`` counts items produced since
    construction, so tests can count replayed records.
    """

    node_type = "range_source"

    def __init__(self, n: int | None, lane: int = 0, lanes: int = 1) -> None:
        super().__init__()
        self.n, self.lane, self.lanes = n, lane, lanes
        self.cursor = 0
        self.reads = 0

    def _repr_args(self):
        yield f"n={self.n}"
        yield f"lane={self.lane}/{self.lanes}"

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.cursor = 0
        if initial_state is not None:  # a state comes from a file: check every value
            check_state_keys(self, initial_state, ["cursor"])
            self.cursor = state_int(self, "cursor", initial_state["cursor"])

    def next(self) -> int:
        value = self.lane + self.cursor * self.lanes
        if self.n is not None and value >= self.n:
            raise StopIteration
        self.cursor += 1
        self.reads += 1
        return value

    def get_state(self) -> dict[str, Any]:
        return self._tagged({"cursor": self.cursor})


class ListSource(ZNode[Any]):
    """The items of a list, in order: the smallest checkpointable source, for examples and tests
    of your own operators (its state is one cursor).

    >>> src = ListSource(["a", "b", "c"])
    >>> next(src), src.state_dict()["cursor"]
    ('a', 1)
    >>> src.reset({"type": "list_source", "version": 1, "cursor": 2}); next(src)
    'c'
    """

    node_type = "list_source"

    def __init__(self, items: Any) -> None:
        super().__init__()
        self.items = list(items)
        self.cursor = 0

    def _repr_args(self):
        yield f"{len(self.items)} items"

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.cursor = 0
        if initial_state is not None:
            check_state_keys(self, initial_state, ["cursor"])
            self.cursor = state_int(self, "cursor", initial_state["cursor"], 0, len(self.items))

    def next(self) -> Any:
        if self.cursor >= len(self.items):
            raise StopIteration
        self.cursor += 1
        return self.items[self.cursor - 1]

    def get_state(self) -> dict[str, Any]:
        return self._tagged({"cursor": self.cursor})


class ToyPacker(Accumulator):
    """Greedy packer over integer "documents": record k is ``1 + k*7919 % doc_mod`` copies of k.

    Rows of ``row_len`` tokens; documents are split across rows; every ``flush_every`` documents
    the partial row is emitted padded with -1 (a flush point).
    """

    node_type = "toy_packer"

    def __init__(self, source: BaseNode, *, row_len: int = 8, flush_every: int | None = 16, doc_mod: int = 11) -> None:
        super().__init__(source, flush_every=flush_every)
        self.row_len, self.doc_mod = row_len, doc_mod
        self._buf: list[int] = []
        self.rows_out = 0

    def _repr_args(self):
        yield f"row_len={self.row_len}"
        yield f"flush_every={self.flush_every}"

    def clear(self) -> None:
        self._buf = []

    def buffer_empty(self) -> bool:
        return not self._buf

    def accept(self, item: int) -> None:
        self._buf.extend([item] * (1 + (item * 7919) % self.doc_mod))
        while len(self._buf) >= self.row_len:
            self.emit({"tokens": np.asarray(self._buf[: self.row_len], dtype=np.int64)})
            self._buf = self._buf[self.row_len :]

    def flush(self) -> None:
        if self._buf:
            row = self._buf + [-1] * (self.row_len - len(self._buf))
            self.emit({"tokens": np.asarray(row, dtype=np.int64)})
            self._buf = []


class ToyShuffle(Accumulator):
    """Emit each window of ``buffer`` items in a seeded order: the smallest accumulator with extra
    state (the window counter keys the lane's random stream, so a replayed window is the same)."""

    node_type = "toy_shuffle"

    def __init__(self, source: BaseNode, *, buffer: int, seed: int, lane: int) -> None:
        super().__init__(source)
        self.buffer, self.seed, self.lane = buffer, seed, lane
        self._held: list[Any] = []
        self._window = 0

    def clear(self) -> None:
        self._held, self._window = [], 0

    def buffer_empty(self) -> bool:
        return not self._held

    def extra_state(self) -> dict[str, Any]:
        return {"window": self._window}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        check_state_keys(self, extra, ["window"], tagged=False)
        self._window = state_int(self, "extra.window", extra["window"])

    def max_since(self) -> int:
        # a window delivers at most `buffer` items before the next anchor
        return self.buffer - 1

    def accept(self, item: Any) -> None:
        self._held.append(item)
        if len(self._held) == self.buffer:
            self.flush()

    def flush(self) -> None:
        held, self._held = self._held, []
        for i in lane_rng(self.seed, self.lane, "toy_shuffle", 0, self._window).permutation(len(held)):
            self.emit(held[i])

    def on_flush(self) -> None:
        self._window += 1


class ToyBatch(Accumulator):
    """``rows`` row dicts -> one dict of stacked arrays (a full batch is a flush point; a partial
    last batch is dropped, so every step has the same shape)."""

    node_type = "toy_batch"

    def __init__(self, source: BaseNode, *, rows: int) -> None:
        super().__init__(source)
        self.rows = rows
        self._held: list[dict[str, np.ndarray]] = []

    def clear(self) -> None:
        self._held = []

    def buffer_empty(self) -> bool:
        return not self._held

    def accept(self, item: dict[str, np.ndarray]) -> None:
        self._held.append(item)
        if len(self._held) == self.rows:
            self.emit({k: np.stack([r[k] for r in self._held]) for k in item})
            self._held = []

    def flush(self) -> None:
        self._held = []


def toy_lane(
    ctx: LaneContext,
    *,
    n: int | None = None,
    row_len: int = 8,
    flush_every: int = 16,
    buffer: int = 5,
    rows_per_step: int = 2,
    map_fn: Callable[[int], int] | None = None,
    chunk_size: int = 4,
) -> BaseNode:
    """A synthetic lane made of engine parts only: range source -> ordered mapper -> toy packer ->
    toy shuffle -> toy batch (the shape of a real text lane, for tests of the engine)."""
    src: BaseNode = RangeSource(n, ctx.lane, ctx.lanes)
    src = OrderedMapper(
        src,
        map_fn or _square_plus_one,
        pool=ctx.pool(),
        chunk_size=chunk_size,
        max_in_flight=ctx.max_in_flight(),
        lane=ctx.lane,
        name="toy_map",
    )
    src = ToyPacker(src, row_len=row_len, flush_every=flush_every)
    src = ToyShuffle(src, buffer=buffer, seed=ctx.seed, lane=ctx.lane)
    return ToyBatch(src, rows=rows_per_step)


class AddOffset(ProcessLocal):
    """A worker function that adds ``offset``: a :class:`~zephon.engine.workers.ProcessLocal`
    (unpickled once per worker process), for tests of process workers."""

    def __init__(self, offset: int) -> None:
        super().__init__()
        self.offset = offset

    def __call__(self, x: int) -> int:
        return x + self.offset


def _square_plus_one(x: int) -> int:
    return x * x + 1


def key_shape(state: Any) -> Any:
    """The nested key structure of a state (values stripped), to check keys never change."""
    if isinstance(state, dict):
        return {k: key_shape(v) for k, v in sorted(state.items())}
    if isinstance(state, list):
        return ["list"]
    return type(state).__name__ if not isinstance(state, (int, float)) or isinstance(state, bool) else "number"


def _threads() -> set:
    return {t for t in threading.enumerate() if t.is_alive()}


def assert_no_leaks(before_threads: set, timeout: float = 10.0) -> None:
    """Wait for threads and child processes started since ``before_threads`` to be gone."""
    deadline = time.monotonic() + timeout
    while True:
        extra = [t for t in _threads() - before_threads if not t.daemon or t.name.startswith("zephon")]
        children = multiprocessing.active_children()
        if not extra and not children:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"close() left threads {[t.name for t in extra]} and processes {children} behind")
        time.sleep(0.05)


@dataclass
class NodeCheck:
    """What :func:`check_node` measured: outputs, states and restore replay counts."""

    steps: int
    hashes: list[str] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)
    max_state_bytes: int = 0


def _first_difference(got: Any, want: Any, path: str = "") -> str:
    """Where two states first differ, as ``path: got != want``."""
    if isinstance(got, dict) and isinstance(want, dict):
        for key in sorted(set(got) | set(want), key=str):
            if key not in got or key not in want:
                return f"{path}/{key}: present in only one of them"
            if got[key] != want[key]:
                return _first_difference(got[key], want[key], f"{path}/{key}")
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b:
                return _first_difference(a, b, f"{path}[{i}]")
    return f"{path or '/'}: {got!r} != {want!r}"


def _same_state(node: BaseNode, want: dict[str, Any], when: str) -> None:
    got = json_roundtrip(node.state_dict())
    if got != want:
        raise AssertionError(
            f"{when}: the state differs from the uninterrupted run's at {_first_difference(got, want)}"
        )


def check_node(
    make: Callable[[], BaseNode],
    *,
    max_steps: int = 200,
    every: int = 1,
    compare_steps: int | None = None,
) -> NodeCheck:
    """Check a node's checkpoint contract; raise AssertionError with the first failing step.

    ``make`` builds a fresh, independent node. The reference run is iterated to exhaustion or
    ``max_steps``; then for every ``every``-th step k a fresh node is reset with the state taken
    after k outputs (JSON round-tripped). The restored node must report exactly that state before
    its first output, then produce the same next outputs (all of them, or ``compare_steps``) and
    report the same state as the reference after each of them: a resumed run writes the
    checkpoints an uninterrupted one writes. State keys must be the same at every step, and
    ``close()`` must leave no threads or child processes.

    >>> check_node(lambda: ToyPacker(RangeSource(10), row_len=4)).steps
    16
    """
    import json

    before = _threads()
    ref = make()
    states = [json_roundtrip(ref.state_dict())]
    hashes: list[str] = []
    for _ in range(max_steps):
        try:
            out = next(ref)
        except StopIteration:
            break
        hashes.append(batch_sha256(out))
        states.append(json_roundtrip(ref.state_dict()))
    close = getattr(ref, "close", None)
    if close is not None:
        close()
        close()  # idempotent
    shape0 = key_shape(states[0])
    result = NodeCheck(steps=len(hashes), hashes=hashes, states=states)
    for k, st in enumerate(states):
        if key_shape(st) != shape0:
            raise AssertionError(f"state keys changed at step {k}: {key_shape(st)} != {shape0}")
        result.max_state_bytes = max(result.max_state_bytes, len(json.dumps(st)))
    for k in range(0, len(states), every):
        node = make()
        node.reset(states[k])
        # a restored node *is* at the state it was given: it reports that state before it yields
        # (a checkpoint taken right after a resume is the one that was resumed from)
        _same_state(node, states[k], f"restored from step {k}, before its first output")
        stop = len(hashes) if compare_steps is None else min(len(hashes), k + compare_steps)
        for t in range(k, stop):
            try:
                out = next(node)
            except StopIteration:
                raise AssertionError(
                    f"restored from step {k}: ended at step {t}, the reference went on to {len(hashes)}"
                ) from None
            if batch_sha256(out) != hashes[t]:
                raise AssertionError(f"restored from step {k}: output {t} differs from the uninterrupted run")
            # and writes the checkpoints the uninterrupted run writes, at every later step
            _same_state(node, states[t + 1], f"restored from step {k}, after output {t + 1}")
        if compare_steps is None:
            try:
                next(node)
            except StopIteration:
                pass
            else:
                if len(hashes) < max_steps:
                    raise AssertionError(f"restored from step {k}: produced more outputs than the reference")
        close = getattr(node, "close", None)
        if close is not None:
            close()
    assert_no_leaks(before)
    return result
