"""The node contract every zephon operator follows.

A :class:`ZNode` is a ``torchdata.nodes.BaseNode`` (``next``, ``get_state``, ``reset``) that is
started lazily, has an explicit idempotent :meth:`ZNode.close`, a readable ``repr`` and a JSON
state tagged with its node type and format version. Composite nodes list their inputs in
``upstreams()`` so closing the last node of a pipeline closes all of it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any, ClassVar, TypeVar

from torchdata.nodes import BaseNode

T = TypeVar("T")

__all__ = ["PipelineError", "StateError", "ZNode", "check_state", "json_roundtrip"]


class StateError(ValueError):
    """A state or checkpoint that cannot be restored (wrong node, version, recipe, corrupt)."""


class PipelineError(RuntimeError):
    """A failure inside a pipeline, with the lane and source position it happened at."""


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


def json_roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """Serialise and parse a state, proving it is plain JSON."""
    return json.loads(json.dumps(state, sort_keys=True, allow_nan=False))


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
            "items": self._n_out,
            "busy_s": round(self._t_busy, 6),
            "self_s": round(max(self._t_busy - upstream_s, 0.0), 6),
        }
        out.update(self.extra_metrics())
        return out

    def extra_metrics(self) -> dict[str, Any]:
        """Node-specific counters added to :meth:`metrics` (override; JSON-able values)."""
        return {}

    def pipeline_metrics(self) -> list[dict[str, Any]]:
        """:meth:`metrics` of this node and every node upstream of it (depth-first)."""
        out = [self.metrics()]
        for up in self.upstreams():
            if isinstance(up, ZNode):
                out.extend(up.pipeline_metrics())
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
        """The nodes this node reads from (closed with it)."""
        return []

    def close(self) -> None:
        """Stop threads/processes owned by this node and its upstreams. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._close_own()
        for up in self.upstreams():
            close = getattr(up, "close", None)
            if close is not None:
                close()

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
            for up in getattr(node, "upstreams", lambda: [])():
                walk(up, depth + 1)

        walk(self, 0)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        return '<pre class="zephon-graph">' + html.escape(self.describe()) + "</pre>"
