"""How a recipe's TOML becomes a :class:`~zephon.recipe.spec.RecipeSpec`: one generic section
reader, and the cross-field rules.

:func:`parse_recipe` checks every key of a recipe (a dict with the TOML's structure) before
anything is read or started: unknown keys get a did-you-mean, impossible values and
combinations name the key and the fix. The result is the whole description of a run's data and
nothing else: no file is opened, nothing is measured.

    >>> from zephon.data import BUNDLED_TOKENIZER
    >>> spec = parse_recipe({"seed": 1, "lanes": 4, "seq_len": 64, "global_batch_size": 8,
    ...                      "tokenizer": {"path": BUNDLED_TOKENIZER},
    ...                      "datasets": [{"name": "web", "path": "web/*.jsonl"}]}, base_dir="/data")
    >>> spec.rows_per_lane, spec.datasets[0].path, spec.pack.algorithm, spec.shuffle.buffer
    (2, '/data/web/*.jsonl', 'greedy', 1024)

Each section is read by :func:`read_table` from its dataclass's fields (see
:mod:`zephon.recipe.spec`: a new key is one line there). What one key cannot check alone (batch
÷ lanes, tokens held, ``end`` ↔ ``policy``, kind-dependent defaults, the schedule's dataset
names, ...) is in the cross-field rules below, and nowhere else.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from zephon.data.chat import TEMPLATES
from zephon.data.datasets import FORMATS, MM_FORMATS, TOKEN_FORMATS
from zephon.engine import WorkerConfig
from zephon.nodes import VisionConfig, WeightSchedule

from .budget import VL_WINDOW_BYTES, memory_budget, size
from .chat import CHAT_KEYS, check_chat
from .filterspec import with_sections
from .keys import LIMITS, Key, keys, meta, spelled
from .phases import batch_schedule, batch_tokens_view, check_phases, phase_specs
from .spec import (
    CHAT_KIND,
    DATA_VERSION,
    VERSIONED,
    VISION_TOKENS,
    DatasetSpec,
    MixingSpec,
    PackSpec,
    PhaseTable,
    RecipeError,
    RecipeSpec,
    ShuffleSpec,
    TokenizerSpec,
    TokenizeTable,
    VisionSpec,
    VisionTable,
    WorkersSpec,
    WorkersTable,
    versioned_default,
)

__all__ = ["parse_recipe", "read_table"]


#: the longest string a recipe value may be (a path, a name, a token's text); longer is a mistake
#: or hostile, and would be copied into every fingerprint and message
MAX_STRING_CHARS = 4096
#: keys longer than this get no did-you-mean (difflib is quadratic in the key's length)
MAX_KEY_CHARS = 100


_SHOW = reprlib.Repr()  # keyword arguments need Python 3.12
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxlong = 3, 60, 60, 6, 6, 60


def _show(value: Any, limit: int = 80) -> str:
    """A value as a message shows it: a short repr (a 10 MB string or a 100,000-deep table in a
    recipe must not make a 10 MB error message, or a RecursionError).

    >>> _show("x" * 1000)
    "'xxxxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxxxxx' (1000 characters)"
    >>> _show([[[[1]]]])
    '[[[[...]]]]'
    """
    text = _SHOW.repr(value)
    if isinstance(value, str) and len(value) > 60:
        text += f" ({len(value)} characters)"
    return text if len(text) <= 4 * limit else text[: 4 * limit] + "..."


def _check_length(section: str, key: str, value: str) -> str:
    if len(value) > MAX_STRING_CHARS:
        raise RecipeError(
            f"recipe: {section}{key} is {len(value)} characters long ({_show(value, 40)}); a recipe string is "
            f"at most {MAX_STRING_CHARS} characters: check the value"
        )
    return value


# -- one value ---------------------------------------------------------------------------------
def _int(section: str, key: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecipeError(f"recipe: {section}{key} must be an integer, got {_show(value)}")
    if value < minimum:
        raise RecipeError(f"recipe: {section}{key} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise RecipeError(
            f"recipe: {section}{key} = {value} is above its limit of {maximum}: no run needs more, and it would "
            f"hang or exhaust memory before the first batch. Use a value <= {maximum}"
        )
    return value


def _str(section: str, key: str, value: Any, choices: Sequence[str] | None = None) -> str:
    if not isinstance(value, str):
        raise RecipeError(f"recipe: {section}{key} must be a string, got {_show(value)}")
    if choices is not None and value not in choices:
        raise RecipeError(
            f"recipe: {section}{key} = {_show(value)} is not valid; use one of {', '.join(map(repr, choices))}"
        )
    return _check_length(section, key, value)


def _bool(section: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RecipeError(f"recipe: {section}{key} must be true or false, got {_show(value)}")
    return value


def _num(section: str, key: str, value: Any, positive: bool = False, maximum: float | None = None) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        raise RecipeError(
            f"recipe: {section}{key} must be a finite number {'> 0' if positive else '>= 0'}, got {_show(value)}"
        )
    if maximum is not None and value > maximum:
        raise RecipeError(
            f"recipe: {section}{key} = {_show(value)} is above its limit of {maximum:g}; use a smaller value"
        )
    return float(value)


def _rgb(section: str, key: str, value: Any, positive: bool) -> tuple[float, float, float]:
    if not isinstance(value, list) or len(value) != 3:
        raise RecipeError(f"recipe: {section}{key} must be a list of 3 numbers (R, G, B), got {_show(value)}")
    for x in value:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or (positive and x <= 0):
            raise RecipeError(
                f"recipe: {section}{key} must be 3 finite numbers{' > 0' if positive else ''}, got {_show(value)}"
            )
    return (float(value[0]), float(value[1]), float(value[2]))


def _globs(section: str, key: str, value: Any) -> str | list[str]:
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(p, str) for p in value)):
        for p in [value] if isinstance(value, str) else value:
            _check_length(section, key, p)
        return value
    raise RecipeError(f"recipe: {section}{key} must be a glob/URL string or a list of them, got {_show(value)}")


def _value(cls: Any, name: str, value: Any, section: str) -> Any:
    """One key's value, checked as its field's :class:`~zephon.recipe.spec.Key` and annotation say."""
    k: Key = meta(cls, name)
    if k.auto and value == "auto":
        return _field(cls, name).default
    kind = k.read or _field(cls, name).type.removesuffix(" | None").removesuffix(" | str")
    if kind == "int":
        return _int(section, name, value, k.lo, k.limit())
    if kind == "float":
        return _num(section, name, value, positive=k.positive, maximum=k.limit())
    if kind == "str":
        return _str(section, name, value, k.choices)
    if kind == "bool":
        return _bool(section, name, value)
    if kind == "rgb":
        return _rgb(section, name, value, k.positive)
    if kind == "globs":
        return _globs(section, name, value)
    if kind in ("table", "rule"):
        return value  # a nested section, or a value its section's rule checks
    raise TypeError(f"{cls.__name__}.{name}: no reader for {kind!r}; declare read= in its key()")


def _field(cls: Any, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _path(base_dir: str, p: str) -> str:
    if "://" in p or os.path.isabs(p):
        return p
    return os.path.join(base_dir, p)


# -- one section -------------------------------------------------------------------------------
def _table(where: str, value: Any, hint: str | None = None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RecipeError(f"recipe: {where} must be a table" + (f", got {_show(value)}" if hint is None else hint))
    return value


def _check_keys(where: str, got: Mapping[str, Any], allowed: Sequence[str]) -> None:
    unknown = [k for k in got if k not in allowed]
    if unknown:
        k = str(unknown[0])
        close = difflib.get_close_matches(k, allowed, n=1) if len(k) <= MAX_KEY_CHARS else []
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise RecipeError(f"recipe: unknown key {_show(k)} in {where}.{hint} Allowed keys: {', '.join(allowed)}.")


def _required(cls: Any) -> list[str]:
    """The keys a section must give: fields with neither a default nor a derived one."""
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and meta(cls, f.name).derived is None
    ]


def read_table(
    cls: type,
    value: Any,
    where: str,
    *,
    section: str | None = None,
    hint: str | None = None,
    missing: str | Callable[[str], str] | None = None,
    only: Sequence[str] | None = None,
    version: int | None = None,
) -> dict[str, Any]:
    """The keys a section gives, checked against the fields of ``cls`` (see
    :func:`zephon.recipe.spec.key`): unknown keys (with a did-you-mean), missing required keys,
    each value's type, bounds and choices. Keys not given are left out: ``cls(**result)`` fills
    in the defaults. ``where`` names the section in messages, ``section`` prefixes a key
    (default ``where + "."``); ``hint`` and ``missing`` (a message, or one made from the key)
    word the not-a-table and missing-key errors;
    ``only`` reads just those keys. With ``version`` (the recipe's data version), the keys whose
    default depends on it (:data:`~zephon.recipe.spec.VERSIONED`) and that are not given come
    back with that version's default.

    >>> read_table(PackSpec, {"max_open": 4}, "[pack]")
    {'max_open': 4}
    >>> read_table(PackSpec, {"flush_evry": 4}, "[pack]")
    Traceback (most recent call last):
    ...
    zephon.recipe.spec.RecipeError: recipe: unknown key 'flush_evry' in [pack]. Did you mean 'flush_every'? ...
    """
    table = _table(where, value, hint)
    _check_keys(where, table, keys(cls))
    for name in _required(cls):
        if name not in table:
            default = f"recipe: {where} needs {name} = {meta(cls, name).example}"
            raise RecipeError(missing(name) if callable(missing) else missing or default)
    prefix = f"{where}." if section is None else section
    given = {f.name: table[spelled(f)] for f in dataclasses.fields(cls) if spelled(f) in table}
    names = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name in given
        and (only is None or f.name in only)
        and not (given[f.name] is None and f.default is None)  # None (from Python, not TOML): not given
    ]
    out = {name: _value(cls, name, given[name], prefix) for name in names}
    if version is not None:
        for section, name in VERSIONED:
            if section == cls.__name__ and name not in out and (only is None or name in only):
                out[name] = versioned_default(cls, name, version)
    return out


# -- the recipe --------------------------------------------------------------------------------
def parse_recipe(raw: Mapping[str, Any], base_dir: str = ".") -> RecipeSpec:
    """Validate a recipe given as a dict (the TOML's structure) into a :class:`RecipeSpec`;
    relative paths are made absolute against ``base_dir``. Raises :class:`RecipeError`."""
    r = batch_tokens_view(_table("the recipe", raw))
    base_dir = os.path.abspath(base_dir)
    top = read_table(RecipeSpec, r, "the recipe's top level", section="", missing=_missing_top_key)
    v = top.get("data_version", DATA_VERSION)
    top = read_table(RecipeSpec, r, "the recipe's top level", section="", missing=_missing_top_key, version=v)
    seq_len = top["seq_len"]
    _rule_batch(top["lanes"], seq_len, top["global_batch_size"])
    datasets = _datasets(r["datasets"], base_dir, v)
    vision_table = read_table(
        VisionTable, r.get("vision", {}), "[vision]", hint=" (patch_size = 16, merge_size = 2, ...)", version=v
    )
    vision = _vision(vision_table)
    workers = _workers(r, vision_table)
    shuffle_given = read_table(ShuffleSpec, r.get("shuffle", {}), "[shuffle]", version=v)
    shuffle = ShuffleSpec(**shuffle_given)
    _rule_shuffle_window(shuffle, seq_len)
    spec = RecipeSpec(
        seed=top["seed"],
        lanes=top["lanes"],
        seq_len=seq_len,
        global_batch_size=top["global_batch_size"],
        tokenizer=_tokenizer(r["tokenizer"], base_dir, v),
        datasets=datasets,
        schedule=_schedule(r.get("schedule", []), datasets),
        global_batch_tokens=top.get("global_batch_tokens"),
        batch_schedule=batch_schedule(top, r.get("batch_schedule"), read_table),
        pack=PackSpec(**read_table(PackSpec, r.get("pack", {}), "[pack]", version=v)),
        shuffle=shuffle,
        mixing=MixingSpec(
            **_rule_split_tokens(read_table(MixingSpec, r.get("mixing", {}), "[mixing]", version=v), seq_len)
        ),
        workers=workers,
        vision=vision,
        cache_dir=_path(base_dir, top["cache_dir"]) if "cache_dir" in top else None,
        end=_rule_end(top.get("end"), datasets),
        memory_gb=top.get("memory_gb"),
        data_version=v,
    )
    spec = _rule_vl_buffer(spec, "buffer" in shuffle_given)
    for step, phase in phase_specs(spec):
        try:
            _rule_memory(phase)
        except RecipeError as e:  # name the phase of a [[batch_schedule]]
            raise RecipeError(
                str(e).replace("recipe: ", f"recipe: from step {step} on, ", 1) if step else str(e)
            ) from None
    check_phases(spec)
    check_chat(spec)
    return with_sections(spec, r, base_dir, read_table)  # [[filters]], [fork]: their rules need the spec


def _missing_top_key(name: str) -> str:
    extra = {
        "tokenizer": ' (a [tokenizer] section with path = "...")',
        "global_batch_size": " (rows per step; or global_batch_tokens)",
    }.get(name, "")
    return f"recipe: missing required key {name!r}{extra}"


def _tokenizer(tok: Any, base_dir: str, version: int) -> TokenizerSpec:
    given = read_table(TokenizerSpec, tok, "[tokenizer]", hint=' with path = "..."', version=version)
    path = _path(base_dir, given["path"])
    if "://" not in path and not os.path.exists(path):
        raise RecipeError(
            f"recipe: [tokenizer].path {path!r} does not exist; point it at a folder with tokenizer.json or at the file"
        )
    return TokenizerSpec(**(given | {"path": path}))


def _datasets(dss: Any, base_dir: str, version: int) -> tuple[DatasetSpec, ...]:
    if not isinstance(dss, list) or not dss:
        raise RecipeError("recipe: [[datasets]] must list at least one dataset")
    specs = tuple(_dataset(i, d, base_dir, version) for i, d in enumerate(dss))
    _rule_datasets(specs)
    return specs


def _dataset(i: int, d: Any, base_dir: str, version: int) -> DatasetSpec:
    # unknown and missing keys, and a bad name, are named by position; the other keys by name
    name = read_table(DatasetSpec, d, f"[[datasets]] #{i + 1}", hint="", only=("name",))["name"]
    where = f"[[datasets]] {name!r}"
    _rule_dataset_keys(d, DatasetSpec(name, "", **read_table(DatasetSpec, d, where, only=_GATES)), where)
    given = _rule_dataset(read_table(DatasetSpec, d, where, version=version), where)
    path = given["path"]
    given["path"] = _path(base_dir, path) if isinstance(path, str) else [_path(base_dir, p) for p in path]
    if given.get("chat_template") not in (None, *TEMPLATES):  # a template file, found like the data
        given["chat_template"] = _path(base_dir, given["chat_template"])
    return DatasetSpec(**given)


def _workers(r: Mapping[str, Any], vision: Mapping[str, Any]) -> WorkersSpec:
    """``[workers]``, and the stages' own workers of ``[tokenize]`` and (read) ``[vision]``."""
    table = WorkersTable(**read_table(WorkersTable, r.get("workers", {}), "[workers]"))
    try:
        default = WorkerConfig(**{f.name: getattr(table, f.name) for f in dataclasses.fields(WorkerConfig)})
    except ValueError as e:  # what only the machine can say (a start method it lacks)
        raise RecipeError(f"recipe: [workers]: {e}") from None
    tokenize = read_table(TokenizeTable, r.get("tokenize", {}), "[tokenize]")
    image = {k: vision[k] for k in ("workers", "backend") if k in vision}
    return WorkersSpec(
        default=default,
        chunk_size=table.chunk_size,
        prefetch=table.prefetch,
        tokenize=_rule_stage_workers(default, tokenize) if tokenize else None,
        vision=_rule_stage_workers(default, image) if image else None,
        vision_chunk_size=VisionTable(**vision).chunk_size,
    )


def _vision(given: Mapping[str, Any]) -> VisionSpec:
    """The ``[vision]`` section (read): image preprocessing, budgets and placeholder tokens."""
    table = VisionTable(**given)
    config = VisionConfig(**{f.name: getattr(table, f.name) for f in dataclasses.fields(VisionConfig)})
    try:
        config.check()
    except ValueError as e:
        raise RecipeError(f"recipe: {e}") from None
    return VisionSpec(config=config, tokens={name: getattr(table, f"{name}_token") for name in VISION_TOKENS})


def _schedule(sched: Any, datasets: Sequence[DatasetSpec]) -> WeightSchedule:
    names = [s.name for s in datasets]
    if not isinstance(sched, list):
        raise RecipeError(
            "recipe: [[schedule]] entries must be an array of tables with step = N and weights = {name = w}"
        )
    phases: list[tuple[int, list[float]]] = [(0, [s.weight for s in datasets])]
    for i, ph in enumerate(sched):
        where = f"[[schedule]] #{i + 1}"
        needs = f"recipe: {where} needs step = N and weights = {{ {names[0]} = 0.5, ... }}"
        given = read_table(PhaseTable, ph, where, hint="", missing=needs)
        if not isinstance(given["weights"], dict):
            raise RecipeError(needs)
        phases.append((given["step"], _rule_phase(given, where, names, phases[-1][0])))
    try:
        return WeightSchedule(phases)
    except ValueError as e:
        raise RecipeError(f"recipe: schedule: {e}") from None


# -- cross-field rules: every check and default that reads more than one key -------------------
def _rule_batch(lanes: int, seq_len: int, global_batch_size: int) -> None:
    """Every lane contributes the same rows per step, and one lane's micro-batch fits in memory."""
    if global_batch_size % lanes:
        lo = (global_batch_size // lanes) * lanes
        raise RecipeError(
            f"recipe: global_batch_size = {global_batch_size} is not a multiple of lanes = {lanes}; every "
            f"lane contributes the same number of rows per step. Use global_batch_size = {lo or lanes} or "
            f"{lo + lanes}, or a lane count that divides {global_batch_size}."
        )
    lane_tokens = (global_batch_size // lanes) * (seq_len + 1)
    if lane_tokens > LIMITS["lane_tokens"]:
        raise RecipeError(
            f"recipe: global_batch_size / lanes x (seq_len + 1) = {global_batch_size // lanes} x {seq_len + 1} = "
            f"{lane_tokens} tokens in one lane's micro-batch, above the limit of {LIMITS['lane_tokens']} (about "
            f"{LIMITS['lane_tokens'] * 30 >> 20} MB); use more lanes, a smaller global_batch_size or seq_len"
        )


def _rule_shuffle_window(shuffle: ShuffleSpec, seq_len: int) -> None:
    """One lane's shuffle window (``buffer`` rows of ``seq_len + 1`` tokens) fits in memory."""
    held = shuffle.buffer * (seq_len + 1)
    if held > LIMITS["shuffle_tokens"]:
        raise RecipeError(
            f"recipe: [shuffle].buffer x (seq_len + 1) = {shuffle.buffer} x {seq_len + 1} = {held} tokens held by "
            f"each lane's shuffle window, above the limit of {LIMITS['shuffle_tokens']} (about "
            f"{LIMITS['shuffle_tokens'] * 30 >> 30} GB per lane); use a smaller [shuffle].buffer"
        )


def _rule_vl_buffer(spec: RecipeSpec, given: bool) -> RecipeSpec:
    """From data version 2 a vision-language recipe's default ``[shuffle] buffer`` is the most
    whole micro-batches (at most 1024 rows) whose worst case fits ``VL_WINDOW_BYTES`` (1 GiB):
    version 1's 1024 rows held ~50 GB per lane at seq_len 2048. From the recipe's data keys only."""
    if given or not spec.multimodal or spec.data_version < 2:
        return spec
    micro = memory_budget(spec).micro_batch_bytes
    buffer = min(_default_buffer(), max(1, VL_WINDOW_BYTES // micro) * spec.rows_per_lane)
    return dataclasses.replace(spec, shuffle=dataclasses.replace(spec.shuffle, buffer=buffer))


def _default_buffer() -> int:
    return ShuffleSpec().buffer


def _rule_memory(spec: RecipeSpec) -> None:
    """One lane's worst-case bytes (:func:`~zephon.recipe.budget.memory_budget`: the shuffle window's rows
    with their pixels, the micro-batch being built, samples in flight) fit the memory limit; the
    error names the numbers and the keys to change, with the largest ``[shuffle] buffer`` that fits."""
    b = memory_budget(spec)
    limit = int(b.limit_gb * 1e9)
    if b.lane_bytes <= limit:
        return
    rows = spec.rows_per_lane if spec.multimodal else 1  # an image-text window holds whole micro-batches
    per_unit = b.window_bytes * rows // b.window_rows
    fit = (limit - b.batch_bytes - b.in_flight_bytes) // per_unit * rows if per_unit else 0
    fix = (
        f"set [shuffle] buffer = {fit} (the largest that fits)"
        if fit >= 1
        else "lower seq_len or global_batch_size / lanes" + (" or [vision] max_pixels" if spec.multimodal else "")
    )
    raise RecipeError(
        f"recipe: one lane holds up to {size(b.lane_bytes)}, above the memory limit of {b.limit_gb:g} GB "
        f"([shuffle] buffer = {spec.shuffle.buffer} -> {b.window_rows} rows x {size(b.row_bytes)} per row "
        f"= {size(b.window_bytes)}, plus {size(b.batch_bytes + b.in_flight_bytes)} of micro-batch"
        f"{' and samples in flight; an image token carries its pixel_values' if spec.multimodal else ''}); {fix}, "
        "or raise the limit with memory_gb = N at the recipe's top level or $ZEPHON_MEMORY_GB"
    )


def _rule_split_tokens(given: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """``[mixing].split_tokens`` defaults to 4 rows' worth of tokens: documents estimated longer
    are planned as several parts, so a single huge document cannot skew a lane's mix for long."""
    return {"split_tokens": 4 * (seq_len + 1)} | given


def _rule_end(end: str | None, datasets: Sequence[DatasetSpec]) -> str | None:
    """``end`` applies to finite recipes only (every dataset ``policy = "stop"``), default "pad"."""
    repeating = [s.name for s in datasets if s.policy != "stop"]
    if end is None:
        return None if repeating else "pad"
    if repeating:
        raise RecipeError(
            f'recipe: end = {end!r} applies to a finite recipe (every dataset policy = "stop"), but dataset '
            f'{repeating[0]!r} has policy = "repeat" and never runs out; set policy = "stop" on every dataset '
            "or remove end"
        )
    return end


def _rule_datasets(specs: Sequence[DatasetSpec]) -> None:
    """Dataset names are unique (they key the schedule, metrics and checkpoints); some weight is > 0."""
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RecipeError(f"recipe: dataset names must be unique; {dup[0]!r} appears more than once")
    if sum(s.weight for s in specs) <= 0:
        raise RecipeError("recipe: at least one dataset needs weight > 0")


#: the dataset keys that decide which other keys apply (read first)
_GATES = ("policy", "on_error", "kind")


def _rule_dataset_keys(d: Mapping[str, Any], gates: DatasetSpec, where: str) -> None:
    """Which dataset keys apply: skip budgets with ``on_error = "skip"``, ``image_field`` to image
    kinds, ``text_mode`` to text (checked before the keys' values, which then do not matter)."""
    if (d.get("max_skipped") is not None or d.get("max_skipped_fraction") is not None) and gates.on_error != "skip":
        raise RecipeError(f'recipe: {where}: max_skipped / max_skipped_fraction only apply with on_error = "skip"')
    if gates.kind == "text" and "image_field" in d:
        raise RecipeError(
            f'recipe: {where}.image_field only applies to datasets with images; set kind = "image_text", '
            '"interleaved" or "chat" (conversations with images), or remove image_field'
        )
    if gates.kind != "text" and "text_mode" in d:
        raise RecipeError(f'recipe: {where}.text_mode only applies to kind = "text"; remove it')
    chat_keys = [k for k in CHAT_KEYS if k in d]
    if gates.kind != CHAT_KIND and chat_keys:
        raise RecipeError(
            f'recipe: {where}.{chat_keys[0]} only applies to kind = "chat"; set kind = "chat" or remove it'
        )


def _rule_dataset(given: dict[str, Any], where: str) -> dict[str, Any]:
    """One dataset's values that depend on each other: ``epochs`` needs ``policy = "stop"``;
    ``kind`` decides the formats and the default text and image columns."""
    d = DatasetSpec(**({"name": "", "path": ""} | given))
    if "epochs" in given and d.policy != "stop":
        raise RecipeError(
            f'recipe: {where}.epochs only applies with policy = "stop" ("repeat" cycles forever); '
            'set policy = "stop" or remove epochs'
        )
    if d.max_skipped_fraction is not None and d.max_skipped_fraction > 1:
        raise RecipeError(f"recipe: {where}.max_skipped_fraction is a fraction in [0, 1], got {d.max_skipped_fraction}")
    if d.kind == "text":
        _str(f"{where}.", "format", d.format, ("auto", *FORMATS, *TOKEN_FORMATS))
        return given
    if d.kind == CHAT_KIND:  # conversations: a field's value read as JSON from JSONL, Parquet or Arrow
        _str(f"{where}.", "format", d.format, ("auto", "jsonl", "parquet", "arrow", "wds"))
        out = {"text_field": "conversations" if d.chat_format == "sharegpt" else "messages"} | given
        paths = d.path if isinstance(d.path, (list, tuple)) else [d.path]
        if d.format == "wds" or (d.format == "auto" and any(str(p).endswith(".tar") for p in paths)):
            out.setdefault("image_field", "images")  # a WebDataset sample's images: its image members
        if "image_field" in out and d.format == "arrow":
            raise RecipeError(f"recipe: {where}: conversations with images are read from jsonl, parquet or wds files")
        return out
    _str(f"{where}.", "format", d.format, ("auto", *MM_FORMATS))
    images = d.kind == "interleaved"
    return {"text_field": "texts" if images else "caption", "image_field": "images" if images else "image"} | given


def _rule_stage_workers(default: WorkerConfig, own: Mapping[str, Any]) -> WorkerConfig:
    """A stage's workers (``[tokenize]``, ``[vision]``): its own count and backend, the rest (and
    what it leaves out) from ``[workers]``."""
    return dataclasses.replace(
        default, count=own.get("workers", default.count), backend=own.get("backend", default.backend)
    )


def _rule_phase(given: Mapping[str, Any], where: str, names: Sequence[str], previous: int) -> list[float]:
    """A schedule phase names only known datasets (the others get weight 0), starts after the
    previous one, and its weights are numbers like a dataset's ``weight``."""
    unknown = [k for k in given["weights"] if k not in names]
    if unknown:
        raise RecipeError(f"recipe: {where}.weights names unknown dataset {unknown[0]!r}; datasets are {names}")
    weight = meta(DatasetSpec, "weight")
    w = [_num(f"{where}.weights.", n, given["weights"].get(n, 0.0), maximum=weight.limit()) for n in names]
    if given["step"] <= previous:
        raise RecipeError(
            f"recipe: {where}.step = {given['step']} must be larger than the previous phase's step {previous}"
        )
    return w
