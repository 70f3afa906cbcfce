"""How a recipe's lane states moved between checkpoint format versions.

The checkpoint envelope is the engine's (:func:`zephon.engine.checkpoint.migrate`); what is inside a lane's
state is this layer's, because the recipe decides which nodes a lane has. The recipe's lane set
hands these to the router explicitly (:attr:`zephon.engine.lanes.LaneSet.lane_migrations`): loading
an old checkpoint works whichever module was imported first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LANE_MIGRATIONS", "migrate_lane_v2", "migrate_text_lane_v1"]


def migrate_text_lane_v1(state: dict[str, Any]) -> dict[str, Any]:
    """Format 1 -> 2 for text lanes: insert a skip_counter (counts start at 0) under the pack."""
    node: Any = state
    while isinstance(node, dict) and node.get("type") != "pack":
        node = node.get("anchor")
    if not isinstance(node, dict) or not isinstance(node.get("anchor"), dict):
        return state  # not a text lane
    mapper = node["anchor"]
    if mapper.get("type") != "ordered_map":
        return state
    src = mapper.get("anchor", {})
    n = len(src.get("count", [])) if isinstance(src, dict) else 0
    node["anchor"] = {
        "type": "skip_counter",
        "version": 1,
        "upstream": mapper,
        "seen": [0] * n,
        "skipped": [0] * n,
        "detail": [],
    }
    if isinstance(src, dict) and src.get("type") == "work_source" and "part" not in src:
        src["part"] = [0] * n
    return state


def migrate_lane_v2(state: dict[str, Any]) -> dict[str, Any]:
    """Format 2 -> 3 for every lane: its skip counter (version 1 -> 2) gains a per-dataset
    ``streak`` of bad records in a row, started at 0 (format 2 did not keep one, so the guard
    against a dataset that cannot deliver starts counting at the resume).

    >>> migrate_lane_v2({"type": "batch", "anchor": {"type": "skip_counter", "version": 1, "seen": [4, 2]}})
    {'type': 'batch', 'anchor': {'type': 'skip_counter', 'version': 2, 'seen': [4, 2], 'streak': [0, 0]}}
    """
    node: Any = state
    while isinstance(node, dict):
        if node.get("type") == "skip_counter" and node.get("version") == 1:
            node["version"] = 2
            seen = node.get("seen")
            node["streak"] = [0] * (len(seen) if isinstance(seen, list) else 0)
        node = node.get("anchor", node.get("upstream"))
    return state


#: format version -> how one lane's state moves to the next version
LANE_MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: migrate_text_lane_v1,
    2: migrate_lane_v2,
}
