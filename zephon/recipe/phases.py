"""Batch-size and sequence-length schedules in a recipe: ``[[batch_schedule]]`` and ``global_batch_tokens``.

The top-level ``global_batch_size`` (or ``global_batch_tokens``) and ``seq_len`` are phase 0;
each ``[[batch_schedule]]`` entry starts a phase at its ``step``, like a ``[[schedule]]`` entry
starts a weight phase::

    global_batch_size = 64
    seq_len = 1024

    [[batch_schedule]]        # a batch-size ramp
    step = 1000
    global_batch_size = 128

    [[batch_schedule]]        # a long-context phase at the same tokens per step
    step = 5000
    seq_len = 4096
    global_batch_tokens = 131072

A key a phase leaves out keeps the previous phase's value, as it was stated: a batch given in
tokens stays that many tokens when only ``seq_len`` changes (the rows follow), one given in rows
stays that many rows. Every phase's rows are a multiple of ``lanes`` (each lane gives the same
rows to a step: :class:`zephon.nodes.BatchSchedule` holds rows per lane). How the rows of a lane
change length at a ``seq_len`` change (the carry-over rule) is in :mod:`zephon.nodes.phases`.

A recipe without ``[[batch_schedule]]`` has no schedule (``RecipeSpec.batch_schedule`` is None):
its fingerprint, lane states and batches are those it always had.

    >>> top = {"lanes": 4, "seq_len": 64, "global_batch_size": 8}
    >>> s = batch_schedule(top, [{"step": 10, "global_batch_size": 16}, {"step": 20, "seq_len": 128}], _read)
    >>> s.phases
    [(0, 2, 64), (10, 4, 64), (20, 4, 128)]
    >>> batch_tokens_view({"seq_len": 64, "lanes": 4, "global_batch_tokens": 512})["global_batch_size"]
    8
"""

# key() is dataclasses.field() with metadata; ruff cannot tell, and sees a call in every default

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from zephon.nodes import BatchSchedule

from .budget import memory_budget, size
from .keys import LIMITS, key
from .spec import RecipeError

__all__ = [
    "BatchPhaseTable",
    "batch_schedule",
    "batch_tokens_view",
    "check_phases",
    "describe_phases",
    "phase_specs",
    "rows_from_tokens",
]


@dataclass(frozen=True)
class BatchPhaseTable:
    """One ``[[batch_schedule]]`` entry: from ``step`` on, the global batch and the row length
    (a key not given keeps the previous phase's value)."""

    step: int = key(lo=1, hi="step", doc="the first step of the phase")
    global_batch_size: int | None = key(None, lo=1, hi="global_batch_size", doc="rows per step (a multiple of lanes)")
    global_batch_tokens: int | None = key(
        None, lo=1, hi="global_batch_tokens", doc="tokens per step instead (rows = tokens / seq_len)"
    )
    seq_len: int | None = key(None, lo=8, hi="seq_len", doc="tokens per row from this step on (packed anew)")


def rows_from_tokens(tokens: int, seq_len: int, lanes: int, where: str) -> int:
    """Rows per step for ``tokens`` tokens per step at ``seq_len`` (a multiple of ``lanes``).

    >>> rows_from_tokens(4096, 256, 4, "x")
    16
    """
    per = seq_len * lanes
    if tokens % per:
        lo = tokens // per * per
        raise RecipeError(
            f"recipe: {where}global_batch_tokens = {tokens} is not a multiple of seq_len x lanes = {seq_len} x "
            f"{lanes} = {per} (every row holds seq_len inputs, every lane the same rows); use "
            f"{lo or per} or {lo + per}"
        )
    return tokens // seq_len


def batch_tokens_view(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's top level with ``global_batch_size`` computed from ``global_batch_tokens``
    (when only that is given; both given is refused)."""
    out = dict(raw)
    if "global_batch_tokens" not in out:
        return out  # neither given: the schema's reader names the missing key, after any unknown one
    if "global_batch_size" in out:
        raise RecipeError("recipe: give global_batch_size (rows per step) or global_batch_tokens (tokens), not both")
    tokens, seq_len, lanes = out["global_batch_tokens"], out.get("seq_len"), out.get("lanes")
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (tokens, seq_len, lanes)):
        out["global_batch_size"] = rows_from_tokens(int(tokens), int(seq_len or 0), int(lanes or 0), "")
    return out


def batch_schedule(top: Mapping[str, Any], entries: Any, read: Callable[..., dict[str, Any]]) -> BatchSchedule | None:
    """The recipe's :class:`~zephon.nodes.BatchSchedule` (None without ``[[batch_schedule]]``).
    ``read`` is the parser's table reader (:func:`zephon.recipe.parse.read_table`)."""
    if entries is None or entries == []:
        return None
    if not isinstance(entries, list):
        raise RecipeError(
            "recipe: [[batch_schedule]] entries must be an array of tables with step = N and "
            "global_batch_size, global_batch_tokens or seq_len"
        )
    lanes, seq_len = top["lanes"], top["seq_len"]
    stated: tuple[str, int] = (
        ("global_batch_tokens", top["global_batch_tokens"])
        if top.get("global_batch_tokens")
        else ("global_batch_size", top["global_batch_size"])
    )
    phases = [(0, top["global_batch_size"] // lanes, seq_len)]
    for i, entry in enumerate(entries):
        where = f"[[batch_schedule]] #{i + 1}."
        given = read(BatchPhaseTable, entry, where[:-1], hint="", missing=f"recipe: {where[:-1]} needs step = N")
        if given["step"] <= phases[-1][0]:
            raise RecipeError(
                f"recipe: {where}step = {given['step']} must be larger than the previous phase's step {phases[-1][0]}"
            )
        if "global_batch_size" in given and "global_batch_tokens" in given:
            raise RecipeError(f"recipe: {where[:-1]} gives global_batch_size and global_batch_tokens; give one")
        seq_len = given.get("seq_len", seq_len)
        for name in ("global_batch_size", "global_batch_tokens"):
            if name in given:
                stated = (name, given[name])
        if not ({"global_batch_size", "global_batch_tokens", "seq_len"} & set(given)):
            raise RecipeError(
                f"recipe: {where[:-1]} changes nothing; give global_batch_size, global_batch_tokens or seq_len"
            )
        name, value = stated
        rows = rows_from_tokens(value, seq_len, lanes, where) if name == "global_batch_tokens" else value
        if rows % lanes:
            raise RecipeError(
                f"recipe: {where}global_batch_size = {rows} is not a multiple of lanes = {lanes}; every lane "
                f"contributes the same number of rows per step. Use {rows // lanes * lanes or lanes} or "
                f"{rows // lanes * lanes + lanes}"
            )
        if rows // lanes * (seq_len + 1) > LIMITS["lane_tokens"]:
            raise RecipeError(
                f"recipe: {where[:-1]}: global_batch_size / lanes x (seq_len + 1) = {rows // lanes} x {seq_len + 1} "
                f"tokens in one lane's micro-batch, above the limit of {LIMITS['lane_tokens']}"
            )
        phases.append((given["step"], rows // lanes, seq_len))
    return BatchSchedule(phases)


def check_phases(spec: Any) -> None:
    """What a schedule needs of the rest of the recipe: text lanes (an image-text lane's
    micro-batches are packed whole), a recipe that never ends, no ``seq_len`` change for chat
    datasets (a conversation is never split); and at a ``seq_len`` change, the new phase's
    lane memory plus the previous window it re-packs fit the limit (each phase alone is checked
    by the parser's memory rule)."""
    sched = spec.batch_schedule
    if sched is None:
        return
    if spec.multimodal:
        raise RecipeError(
            "recipe: [[batch_schedule]] is not supported with image-text datasets yet (their micro-batches are "
            "packed whole); remove [[batch_schedule]] or the image datasets"
        )
    if spec.finite:
        raise RecipeError(
            'recipe: [[batch_schedule]] needs a recipe that never ends (a dataset with policy = "repeat"); a '
            "finite recipe's end is counted in micro-batches of one size"
        )
    if len(sched.segments()) > 1 and any(s.kind == "chat" for s in spec.datasets):
        raise RecipeError(
            "recipe: [[batch_schedule]] changes seq_len, which chat datasets do not support yet (conversations "
            "are packed whole); keep seq_len fixed or use text datasets"
        )
    phases = phase_specs(spec)
    for (_, before), (step, after) in itertools.pairwise(phases):
        if before.seq_len == after.seq_len:
            continue
        need = memory_budget(after).lane_bytes + memory_budget(before).window_bytes
        limit = memory_budget(after).limit_gb * 1e9
        if need > limit:
            raise RecipeError(
                f"recipe: at step {step} seq_len changes to {after.seq_len}: a lane holds the new phase "
                f"({size(memory_budget(after).lane_bytes)}) and the previous shuffle window it re-packs "
                f"({size(memory_budget(before).window_bytes)}), {size(need)} in all, above the memory limit of "
                f"{limit / 1e9:g} GB; lower [shuffle] buffer or raise memory_gb"
            )


def phase_specs(spec: Any) -> list[tuple[int, Any]]:
    """``(first step, spec)`` per phase of a recipe: the spec with that phase's ``seq_len`` and
    ``global_batch_size`` (one entry, the spec itself, without a schedule). What the memory
    budget and ``zephon inspect`` read per phase."""
    sched = spec.batch_schedule
    if sched is None:
        return [(0, spec)]
    return [
        (s, dataclasses.replace(spec, seq_len=n, global_batch_size=r * spec.lanes, batch_schedule=None))
        for s, r, n in sched.phases
    ]


def describe_phases(spec: Any) -> list[str]:
    """``zephon inspect``'s lines for a ``[[batch_schedule]]``: per phase its steps, rows (global
    and per lane), row length, tokens per step and worst-case memory per lane; [] without one."""
    if spec.batch_schedule is None:
        return []
    phases = phase_specs(spec)
    lines = [f"{'batch phase':<16} {'rows':>7} {'per lane':>8} {'seq_len':>7} {'tokens/step':>12} {'memory/lane':>12}"]
    for i, (step, p) in enumerate(phases):
        end = f"{phases[i + 1][0] - 1}" if i + 1 < len(phases) else ""
        lines.append(
            f"{f'steps {step}..{end}':<16} {p.global_batch_size:>7} {p.rows_per_lane:>8} {p.seq_len:>7} "
            f"{p.global_batch_size * p.seq_len:>12} {size(memory_budget(p).lane_bytes):>12}"
        )
    return lines


def _read(cls: type, value: Any, where: str, **_: Any) -> dict[str, Any]:
    """A stand-in table reader for the doctest (the parser's checks types and bounds too)."""
    return {k: v for k, v in value.items() if k in {f.name for f in dataclasses.fields(cls)}}
