"""Editing checkpoints the way a careless or hostile user would, for the restore-check tests."""

from __future__ import annotations

import copy
from typing import Any

from zephon.engine.checkpoint import is_lane_key, seal_state


def unsealed(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a (format 3) state with each lane entry replaced by its pipeline state and
    no digests: edit it, then :func:`seal_state` it, as a deliberate forgery would."""
    out = {k: copy.deepcopy(v["state"] if is_lane_key(k) else v) for k, v in state.items() if k != "digest"}
    return out


def resealed(state: dict[str, Any], edit) -> dict[str, Any]:
    """``state`` after ``edit(raw)`` on its unsealed form, with valid digests again."""
    raw = unsealed(state)
    edit(raw)
    return seal_state(raw)


def node_of(lane_state: dict[str, Any], node_type: str) -> dict[str, Any]:
    """The state of the first node of ``node_type`` in a lane's pipeline state (through
    ``anchor`` / ``upstream``), a reference into it."""
    node: Any = lane_state
    while isinstance(node, dict) and node.get("type") != node_type:
        node = node.get("anchor", node.get("upstream"))
    if not isinstance(node, dict):
        raise KeyError(f"no {node_type!r} node in this lane state")
    return node
