"""How a recipe key is declared: a dataclass field whose :class:`Key` metadata says its default,
bounds (a name in :data:`LIMITS`), choices and doc, so the parser and the schema's docs read one
place. The sections themselves live in :mod:`zephon.recipe.spec`.

    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True)
    ... class Pack:
    ...     flush_every: int = key(512, lo=1, hi="flush_every", doc="rows between flushes")
    >>> keys(Pack), meta(Pack, "flush_every").limit()
    (['flush_every'], 1000000)
"""

# key() is dataclasses.field() with metadata; ruff cannot tell, and sees a call in every default

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from zephon.engine.mapper import MAX_CHUNK_SIZE

__all__ = [
    "LIMITS",
    "Key",
    "as_list",
    "field_default",
    "key",
    "keys",
    "max_workers",
    "meta",
    "off_default",
    "spelled",
]


#: The largest value each recipe key may take. A larger one is a typo or hostile: it would hang or
#: exhaust memory before the first batch (10**9 lanes, a 10**9-token row, a shuffle window of
#: 10**9 rows). The error names the key and the bound. Products are bounded too (see parse_recipe):
#: one lane's micro-batch holds at most ``lane_tokens`` tokens, one lane's shuffle window at
#: most ``shuffle_tokens`` (about 30 bytes each).
LIMITS: Mapping[str, int] = {
    "seed": 2**64 - 1,
    "lanes": 65536,
    "seq_len": 1 << 20,
    "global_batch_size": 1 << 20,
    "global_batch_tokens": 1 << 40,
    "lane_tokens": 1 << 24,
    "shuffle_tokens": 1 << 27,
    "buffer": 1 << 20,
    "block": 1 << 24,
    "flush_every": 1_000_000,
    "max_open": 1024,
    "estimate_samples": 100_000,
    "split_tokens": 1 << 31,
    "chunk_size": MAX_CHUNK_SIZE,
    "vision_chunk_size": 1024,
    "timeout_s": 86400,
    "prefetch": 1024,
    "epochs": 1_000_000,
    "max_skipped": 2**53,
    "max_record_bytes": 1 << 30,
    "step": 2**53,
    "weight": 10**9,
    "patch_size": 1024,
    "merge_size": 64,
    "temporal_patch_size": 64,
    "pixels": 1 << 32,
    "image_side": 1 << 16,
    "images": 65536,
    "memory_gb": 1 << 20,
}


def max_workers() -> int:
    """The most workers a pool may have: ``max(64, 4 x CPUs)`` (more only contend for the CPUs
    and memory; 100,000 would never start)."""
    return max(64, 4 * (os.cpu_count() or 1))


@dataclass(frozen=True)
class Key:
    """How one recipe key is read and checked; kept in its dataclass field's metadata by :func:`key`.

    The value's type is the field's annotation (``int``, ``float``, ``str``, ``bool``, each
    optionally ``| None``); ``read`` names a reader of :mod:`zephon.recipe.parse` where the
    annotation does not say it. TOML has no null: ``None`` only ever means "not given".
    """

    doc: str  #: one line: what the key is for
    lo: int = 0  #: integers: the smallest value
    hi: str | Callable[[], int] | None = None  #: the largest value: a name in LIMITS, or a function
    choices: tuple[str, ...] | None = None  #: strings: the allowed values
    positive: bool = False  #: numbers: > 0 rather than >= 0
    auto: bool = False  #: the string "auto" stands for the default
    read: str | None = None  #: a reader other than the type's ("globs", "rgb", "table": parsed as a section,
    #: "rule": passed through, checked by the section's own rule)
    derived: str | None = None  #: a default that depends on other keys, set by a rule: which one
    example: str = "..."  #: what "needs KEY = EXAMPLE" shows when a required key is missing
    also: tuple[str, ...] = ()  #: further top-level tables that fill this field (``[tokenize]`` -> workers)
    new: bool = False  #: added after fingerprints were first recorded: in the data definition only off its default
    toml: str | None = None  #: the key's spelling in TOML where it cannot be the field's name (``in``)

    def limit(self) -> int | None:
        """The largest value, resolved (:data:`LIMITS`, or ``hi()`` for a bound that depends on
        the machine, like :func:`max_workers`)."""
        if self.hi is None:
            return None
        return LIMITS[self.hi] if isinstance(self.hi, str) else self.hi()


def key(default: Any = dataclasses.MISSING, *, doc: str, factory: Any = dataclasses.MISSING, **how: Any) -> Any:
    """A dataclass field that is a recipe key: its default (none: the key is required, unless
    ``derived``), and the :class:`Key` settings ``how`` (``lo``, ``hi``, ``choices``, ...)."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"key": Key(doc=doc, **how)})


def meta(cls: type, name: str) -> Key:
    """The :class:`Key` of field ``name`` of ``cls``."""
    return _fields(cls)[name].metadata["key"]


def keys(cls: type) -> list[str]:
    """The keys a section of shape ``cls`` allows, in order: its fields (and the tables they name
    in ``also``)."""
    out: list[str] = []
    for f in dataclasses.fields(cls):
        out += [spelled(f), *f.metadata["key"].also]
    return out


def spelled(f: dataclasses.Field) -> str:
    """How field ``f``'s key is spelled in a recipe (its name, unless its :class:`Key` says ``toml``)."""
    return f.metadata["key"].toml or f.name


def _fields(cls: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def field_default(cls: Any, name: str) -> Any:
    """The default of field ``name`` of a dataclass (to take another layer's defaults, not restate them)."""
    f = _fields(cls)[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    factory: Any = f.default_factory
    return factory()


def off_default(cls: Any, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (fields of a section of shape ``cls``) less its ``new`` keys at their default:
    recipes written before a key existed keep their fingerprint, and their checkpoints resume."""
    own = _fields(cls)
    return {k: v for k, v in values.items() if not (k in own and meta(cls, k).new and v == field_default(cls, k))}


def as_list(spec: Any) -> list[Any]:
    """A section as the data definition lists it: its first keys' values in order, then a table of
    its ``new`` keys off their default (none: the list is what it always was)."""
    cls = type(spec)
    first = [getattr(spec, k) for k in keys(cls) if not meta(cls, k).new]
    later = off_default(cls, {k: getattr(spec, k) for k in keys(cls) if meta(cls, k).new})
    return [*first, later] if later else first
