"""Why a checkpoint's fingerprint is not the recipe's, where the checkpoint can tell: its
``shared.definition`` names the ``[[filters]]`` of the recipe that wrote it (name, kind and a
hash of each rule's definition) and its ``shared.fork`` the fork (the parent's fingerprint and
the fork step), so a refused resume names the filter or fork that differs instead of only the
two fingerprints.

    >>> explain_filters([["short", "length", "aa"]], [["short", "length", "bb"], ["caps", "transform", "cc"]])[:109]
    "The [[filters]] differ from the checkpoint's: added 'caps' (transform); changed 'short' (its settings, or its"
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["explain_filters", "explain_fork", "filters_summary"]


def filters_summary(definitions: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """``[name, kind, hash]`` of each rule (its :meth:`FilterSpec.definition`), in order."""
    out = []
    for d in definitions:
        h = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]
        out.append([str(d["name"]), str(d["kind"]), h])
    return out


def explain_filters(theirs: Any, mine: Sequence[Sequence[str]]) -> str:
    """A sentence naming the filters added, removed or changed since the checkpoint; "" when
    they are the same (or the checkpoint does not say)."""
    if not isinstance(theirs, list):
        theirs = []
    try:
        a = {str(n): (str(k), str(h)) for n, k, h in theirs}
    except (TypeError, ValueError):
        return ""
    b = {str(n): (str(k), str(h)) for n, k, h in mine}
    if a == b:
        return ""
    parts = [f"added {n!r} ({b[n][0]})" for n in b if n not in a]
    parts += [f"removed {n!r} ({a[n][0]})" for n in a if n not in b]
    parts += [f"changed {n!r} (its settings, or its function's code)" for n in b if n in a and a[n] != b[n]]
    if not parts:
        parts = ["the same rules in another order"]
    return (
        f"The [[filters]] differ from the checkpoint's: {'; '.join(parts)}. To continue the run under the new "
        "filters, declare it a fork: [fork] parent = the recipe the run was started with, step = the first batch "
        "to change."
    )


def explain_fork(theirs: Any, mine: Mapping[str, Any] | None) -> str:
    """A sentence naming how the checkpoint's fork (``shared.fork``) and the recipe's differ; ""
    when they agree."""
    if not isinstance(theirs, dict):
        theirs = None
    if theirs == (dict(mine) if mine else None):
        return ""
    if theirs is None:
        return (
            f"This recipe is a fork (of the run with fingerprint {mine['parent']}... at step {mine['step']}), the "
            "checkpoint is not a fork's: resume it with the recipe it was written with."
            if mine
            else ""
        )
    if mine is None:
        return (
            f"The checkpoint was written by a fork (of the run with fingerprint {theirs.get('parent')}... at step "
            f"{theirs.get('step')}): resume it with that fork's recipe (its [fork] section), not the parent's."
        )
    if theirs.get("parent") != mine["parent"]:
        return (
            f"The checkpoint was written by a fork of another run (parent fingerprint {theirs.get('parent')}..., "
            f"this recipe's parent is {mine['parent']}...): check [fork] parent."
        )
    return (
        f"The checkpoint was written by a fork at step {theirs.get('step')}; this recipe's [fork] step is "
        f"{mine['step']}: set step = {theirs.get('step')} to resume it."
    )
