"""Write a recipe dict (the TOML's structure) as TOML, for tests that drive the ``zephon``
command with recipes built in code."""

from __future__ import annotations

import json
from typing import Any


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def to_toml(cfg: dict[str, Any]) -> str:
    """Top-level scalars, then ``[tables]``, then ``[[arrays of tables]]``."""
    tables = {k: v for k, v in cfg.items() if isinstance(v, dict)}
    arrays = {k: v for k, v in cfg.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)}
    out = [f"{k} = {_value(v)}" for k, v in cfg.items() if k not in tables and k not in arrays]
    for k, t in tables.items():
        out += [f"[{k}]"] + [f"{a} = {_value(b)}" for a, b in t.items()]
    for k, rows in arrays.items():
        for row in rows:
            out += [f"[[{k}]]"] + [f"{a} = {_value(b)}" for a, b in row.items()]
    return "\n".join(out) + "\n"
