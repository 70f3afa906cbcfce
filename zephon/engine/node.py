"""The node contract every zephon operator follows.

A :class:`ZNode` is a ``torchdata.nodes.BaseNode`` (``next``, ``get_state``, ``reset``) that is
started lazily, has an explicit idempotent :meth:`ZNode.close`, a readable ``repr`` and a JSON
state tagged with its node type and format version. Composite nodes list their inputs in
``upstreams()`` so closing the last node of a pipeline closes all of it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

from torchdata.nodes import BaseNode

T = TypeVar("T")

# State keys shared by the nodes that checkpoint by anchor and replay (one vocabulary):
#: the upstream's state at the point replay starts from
ANCHOR = "anchor"
#: outputs (or items) delivered since the anchor, regenerated and dropped on restore
SINCE = "since"
#: an accumulator's small counters at the anchor (window numbers...)
EXTRA = "extra"
#: the upstream's current state, for a node that holds nothing itself
UPSTREAM = "upstream"

#: the largest integer a state may hold: JSON readers other than Python's lose precision above
#: 2**53, and no counter of a real run comes near it (a value above it is corrupt or hostile)
MAX_STATE_INT = 2**53

__all__ = [
    "ANCHOR",
    "EXTRA",
    "MAX_STATE_INT",
    "SINCE",
    "UPSTREAM",
    "CancelledError",
    "PipelineError",
    "StateError",
    "ZNode",
    "cancel_node",
    "check_state",
    "check_state_keys",
    "close_node",
    "json_roundtrip",
    "state_int",
    "state_ints",
    "state_node",
    "upstream_nodes",
]


class StateError(ValueError):
    """A state or checkpoint that cannot be restored (wrong node, version, recipe, corrupt)."""


class PipelineError(RuntimeError):
    """A failure inside a pipeline, with the lane and source position it happened at."""


class CancelledError(PipelineError):
    """Raised inside a computation (a shuffle window's first fill, a wait for a worker) whose
    pipeline was closed meanwhile, from another thread or a signal handler: the computation
    stops at its next check instead of running to its end."""


def check_state(node: ZNode, state: dict[str, Any]) -> None:
    """Refuse a state written by another node type or an unknown format version."""
    if not isinstance(state, dict):
        raise StateError(f"{node!r}: expected a state dict, got {type(state).__name__}")
    tag = state.get("type")
    if tag != node.node_type:
        raise StateError(
            f"{node!r}: this state belongs to a node of type {tag!r}, not {node.node_type!r}. "
            "The pipeline was built differently from the one that wrote the checkpoint; "
            "rebuild it from the same recipe."
        )
    version = state.get("version")
    if version != node.state_version:
        raise StateError(
            f"{node!r}: state format version {version!r} is not supported "
            f"(this zephon writes version {node.state_version}). Use the zephon release that "
            "wrote the checkpoint, or migrate it with zephon.checkpoint.migrate()."
        )


def check_state_keys(node: Any, state: Mapping[str, Any], keys: Iterable[str], *, tagged: bool = True) -> None:
    """Refuse a state whose keys are not exactly ``type``, ``version`` (when ``tagged``) and
    ``keys``, naming the first missing or unknown one (a truncated state, or one edited or
    written by another node).

    >>> check_state_keys("Pack()", {"type": "pack", "version": 1, "since": 0, "extra": {}}, ["since"])
    Traceback (most recent call last):
    ...
    zephon.engine.node.StateError: Pack(): state has an unknown entry 'extra' (expected: since)
    """
    want = list(keys)
    missing = [k for k in want if k not in state]
    if missing:
        raise StateError(f"{node}: state has no {missing[0]!r} entry; it is truncated or not this node's state")
    allowed = {"type", "version", *want} if tagged else set(want)
    unknown = sorted(k for k in state if k not in allowed)
    if unknown:
        raise StateError(f"{node}: state has an unknown entry {unknown[0]!r} (expected: {', '.join(want)})")


def state_int(node: Any, field: str, value: Any, lo: int = 0, hi: int = MAX_STATE_INT) -> int:
    """``value`` if it is an integer in ``[lo, hi]`` (a JSON ``true`` is not an integer here),
    else a :class:`StateError` naming the node and the field.

    >>> state_int("Shuffle()", "since", 3, hi=7)
    3
    >>> state_int("Shuffle()", "since", True)
    Traceback (most recent call last):
    ...
    zephon.engine.node.StateError: Shuffle(): state field 'since' must be an integer in [0, 9007199254740992], got True
    """
    if type(value) is not int or not lo <= value <= hi:
        raise StateError(f"{node}: state field {field!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def state_ints(node: Any, field: str, value: Any, n: int, lo: int = 0, hi: int = MAX_STATE_INT) -> list[int]:
    """A list of exactly ``n`` integers in ``[lo, hi]`` (one per dataset, say), else a
    :class:`StateError` naming the node, the field and the first bad entry."""
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} entries" if isinstance(value, list) else repr(value)
        raise StateError(f"{node}: state field {field!r} must list {n} integers, got {got}")
    return [state_int(node, f"{field}[{i}]", x, lo, hi) for i, x in enumerate(value)]


def state_node(node: Any, field: str, value: Any) -> dict[str, Any]:
    """An upstream node's state inside this node's state: a JSON object, never null (a null
    would silently restart the upstream from the beginning)."""
    if not isinstance(value, dict):
        raise StateError(
            f"{node}: state field {field!r} must be the upstream node's state (a JSON object), "
            f"got {type(value).__name__}"
        )
    return value


def json_roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """Serialise and parse a state, proving it is plain JSON."""
    return json.loads(json.dumps(state, sort_keys=True, allow_nan=False))


def upstream_nodes(node: Any) -> list[Any]:
    """The nodes ``node`` reads from: a zephon node's :meth:`ZNode.upstreams`; for a node of
    another library (torchdata's own), its ``source`` / ``root`` / ``source_nodes``.

    >>> from torchdata.nodes import Batcher, IterableWrapper
    >>> src = IterableWrapper(range(4))
    >>> upstream_nodes(Batcher(src, batch_size=2)) == [src]
    True
    """
    if isinstance(node, ZNode):
        return list(node.upstreams())
    out = [v for v in (getattr(node, "source", None), getattr(node, "root", None)) if isinstance(v, BaseNode)]
    sources = getattr(node, "source_nodes", None)
    if isinstance(sources, Mapping):
        out.extend(v for v in sources.values() if isinstance(v, BaseNode))
    return out


def cancel_node(node: Any) -> None:
    """Ask every zephon node of ``node``'s graph to stop what it is computing, at its next
    check (:meth:`ZNode.check_cancelled`), releasing nothing. Thread-safe (it sets flags):
    closing a pipeline calls it first, so a close from another thread (or a signal handler)
    does not wait for a long fill to end before it can stop the fill's threads."""
    seen: set[int] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, ZNode):
            n._cancelled = True
        todo.extend(upstream_nodes(n))


def close_node(node: Any) -> None:
    """Close ``node`` and everything upstream of it, whichever library each node comes from.

    Why: a pipeline may mix zephon nodes (explicit :meth:`ZNode.close`) with torchdata's own
    (which stop their threads only when garbage-collected): closing the last node must still
    stop every thread and worker pool underneath. A node with ``shutdown()`` or ``close()`` is
    asked to stop; torchdata 0.11's threaded nodes (``Prefetcher``, ``ParallelMapper``,
    ``PinMemory``) keep their threads in an iterator whose ``_shutdown()`` stops them (they have
    no public way yet); then the walk goes on upstream.
    """
    seen: set[int] = set()

    def walk(n: Any) -> None:
        if id(n) in seen:
            return
        seen.add(id(n))
        if isinstance(n, ZNode):
            n.close()  # closes its own upstreams (through this function)
            return
        stop = getattr(n, "shutdown", None) or getattr(n, "close", None)
        if callable(stop):
            stop()
        it = getattr(n, "_it", None)
        if it is not None and callable(getattr(it, "_shutdown", None)):
            it._shutdown()
        for up in upstream_nodes(n):
            walk(up)

    walk(node)


class ZNode(BaseNode[T]):
    """Base for zephon nodes: lazy start, explicit ``close()``, tagged JSON state.

    Subclasses implement ``reset`` (calling ``super().reset``), ``next`` and ``get_state``
    (returning ``self._tagged({...})``), and list their inputs in ``upstreams``.
    """

    node_type: ClassVar[str] = "znode"
    state_version: ClassVar[int] = 1

    def __init__(self) -> None:
        super().__init__()
        self._closed = False
        self._cancelled = False  # set by cancel_node (any thread); checked by long loops
        self._n_out = 0
        self._t_busy = 0.0  # seconds inside next(), upstream included

    def __next__(self) -> T:
        t = time.perf_counter()
        try:
            out = super().__next__()
        finally:
            self._t_busy += time.perf_counter() - t
        self._n_out += 1
        return out

    def metrics(self) -> dict[str, Any]:
        """Counters of this node: items produced, seconds in ``next()`` (with and without its
        upstreams' share), and node-specific figures from :meth:`extra_metrics`."""
        ups = [u for u in self.upstreams() if isinstance(u, ZNode)]
        upstream_s = sum(u._t_busy for u in ups)
        out: dict[str, Any] = {
            "node": type(self).__name__,
            "node_type": self.node_type,
            "items": self._n_out,
            "busy_s": round(self._t_busy, 6),
            "self_s": round(max(self._t_busy - upstream_s, 0.0), 6),
        }
        out.update(self.extra_metrics())
        return out

    @classmethod
    def summarize_metrics(cls, summed: dict[str, Any]) -> dict[str, Any]:
        """Ratios recomputed from this node type's counters summed over many lanes (a sum of
        ratios means nothing): override to add them, e.g. a packer's padding share."""
        return summed

    def extra_metrics(self) -> dict[str, Any]:
        """Node-specific counters added to :meth:`metrics` (override; JSON-able values)."""
        return {}

    def pipeline_metrics(self) -> list[dict[str, Any]]:
        """:meth:`metrics` of this node and every node upstream of it (depth-first)."""
        out = [self.metrics()]
        for up in self.upstreams():
            out.extend(_metrics_of(up))
        return out

    # -- contract helpers -------------------------------------------------------------------
    def _tagged(self, body: dict[str, Any]) -> dict[str, Any]:
        out = {"type": self.node_type, "version": self.state_version}
        out.update(body)
        return out

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        if self._closed:
            raise PipelineError(f"{self!r} was closed; build a new pipeline instead of reusing it")
        if initial_state is not None:
            check_state(self, initial_state)
        super().reset(initial_state)

    def upstreams(self) -> list[BaseNode]:
        """The nodes this node reads from (closed with it): by default its ``source``; a node
        with several inputs, or none called ``source``, overrides this."""
        source = getattr(self, "source", None)
        return [source] if isinstance(source, BaseNode) else []

    def close(self) -> None:
        """Stop threads/processes owned by this node and its upstreams. Safe to call twice."""
        if self._closed:
            return
        cancel_node(self)  # a computation in progress (another thread) stops at its next check
        self._closed = True
        self._close_own()
        for up in self.upstreams():
            close_node(up)

    def check_cancelled(self) -> None:
        """Raise :class:`CancelledError` if the pipeline was closed (or cancelled) meanwhile: long
        loops (a window's fill, a wait for a worker) call it at every step."""
        if self._cancelled:
            raise CancelledError(f"{self!r} was closed while it was computing; the pipeline is shutting down")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a closed node cannot be reset or iterated again)."""
        return self._closed

    def shutdown(self) -> None:
        """The same as :meth:`close` (the name newer torchdata releases use)."""
        self.close()

    def _close_own(self) -> None:
        """Release this node's own resources (override)."""

    def __enter__(self) -> ZNode[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _repr_args(self) -> Iterable[str]:
        return ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self._repr_args())})"

    def describe(self) -> str:
        """The node graph from this node up to its sources, one node per line."""
        lines: list[str] = []

        def walk(node: Any, depth: int) -> None:
            lines.append("  " * depth + ("└─ " if depth else "") + repr(node))
            for up in upstream_nodes(node):
                walk(up, depth + 1)

        walk(self, 0)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        return '<pre class="zephon-graph">' + html.escape(self.describe()) + "</pre>"


def _metrics_of(node: Any) -> list[dict[str, Any]]:
    """Pipeline metrics of ``node`` and below, passing through nodes that keep none."""
    if isinstance(node, ZNode):
        return node.pipeline_metrics()
    return [m for up in upstream_nodes(node) for m in _metrics_of(up)]
