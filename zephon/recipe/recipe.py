"""Recipes: a whole text pipeline described in TOML (or built in code), validated up front.

A recipe is a pure description: seed, lanes, sequence length, global batch, tokenizer,
datasets with token-share weights, packing, shuffling and workers. ``Recipe.from_toml(path)``
checks every key before any worker starts (unknown keys and impossible combinations name the
key and the fix); :meth:`Recipe.router` / :meth:`Recipe.global_loader` build the per-lane
pipelines::

    WorkSource(lane) -> OrderedMapper(fetch + tokenize) -> Pack -> WindowShuffle -> Batch

Workers are a performance setting only: they are not part of the recipe's fingerprint.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zephon.data import (
    FORMATS,
    KINDS,
    MM_FORMATS,
    TEXT_MODES,
    DatasetIndex,
    TextTokenizer,
    index_dataset,
    index_multimodal,
    set_tokenizers_parallelism,
)
from zephon.engine import (
    BACKENDS,
    GlobalLoader,
    IndexPermutation,
    LaneContext,
    OrderedMapper,
    Router,
    StateError,
    WorkerConfig,
    check_world_size,
    register_lane_migration,
    stable_u64,
)
from zephon.nodes import (
    POLICIES,
    Batch,
    DatasetPlan,
    FetchTokenize,
    FetchVision,
    LaneWorkSource,
    MMPack,
    Pack,
    SkipCounter,
    VisionConfig,
    WeightSchedule,
    WindowShuffle,
    WorkPlan,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["DatasetSpec", "Recipe", "RecipeError", "TokenEstimate", "estimate_tokens"]


class RecipeError(ValueError):
    """An invalid recipe; the message names the key and the fix."""


ALGORITHMS = ("greedy", "first_fit", "best_fit")
MIX_BY = ("tokens", "samples")


def _fail(msg: str) -> RecipeError:
    return RecipeError(msg)


def _check_keys(section: str, got: Mapping[str, Any], allowed: Sequence[str]) -> None:
    unknown = [k for k in got if k not in allowed]
    if unknown:
        import difflib

        k = unknown[0]
        close = difflib.get_close_matches(k, allowed, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise _fail(f"recipe: unknown key {k!r} in {section}.{hint} Allowed keys: {', '.join(allowed)}.")


def _int(section: str, key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"recipe: {section}{key} must be an integer, got {value!r}")
    if value < minimum:
        raise _fail(f"recipe: {section}{key} must be >= {minimum}, got {value}")
    return value


def _str(section: str, key: str, value: Any, choices: Sequence[str] | None = None) -> str:
    if not isinstance(value, str):
        raise _fail(f"recipe: {section}{key} must be a string, got {value!r}")
    if choices is not None and value not in choices:
        raise _fail(f"recipe: {section}{key} = {value!r} is not valid; use one of {', '.join(map(repr, choices))}")
    return value


def _bool(section: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(f"recipe: {section}{key} must be true or false, got {value!r}")
    return value


def _num(section: str, key: str, value: Any, positive: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        raise _fail(f"recipe: {section}{key} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DatasetSpec:
    """One ``[[datasets]]`` entry."""

    name: str
    path: Any  # str or list of str (globs / fsspec URLs)
    format: str = "auto"
    text_field: str = "text"
    text_mode: str = "line"
    weight: float = 1.0
    policy: str = "repeat"
    epochs: int | None = None
    on_error: str = "raise"
    max_skipped: int | None = None  # with on_error = "skip": run-wide budget (enforced per lane)
    max_skipped_fraction: float | None = None
    kind: str = "text"  # "text", "image_text" (one image + caption) or "interleaved" (OBELICS-style)
    image_field: str | None = None  # image column (parquet image_text / interleaved)


#: keys a text dataset's entry leaves out of the data definition (so text-only fingerprints stay)
_MM_ONLY_KEYS = ("kind", "image_field")

VISION_KEYS = [
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "min_pixels",
    "max_pixels",
    "mean",
    "std",
    "max_image_pixels",
    "max_images_per_batch",
    "max_images_per_row",
    "mrope",
    "image_token",
    "video_token",
    "vision_start_token",
    "vision_end_token",
    "workers",
    "backend",
    "chunk_size",
]
_VISION_TOKEN_DEFAULTS = {
    "image": "<|image_pad|>",
    "video": "<|video_pad|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
}


@dataclass(frozen=True)
class TokenEstimate:
    """Measured tokens per record byte (content) and fixed tokens per record (BOS/EOS)."""

    tokens_per_byte: float
    tokens_per_record: float
    sampled: int


DATASET_KEYS = [f.name for f in dataclasses.fields(DatasetSpec)]
TOP_KEYS = [
    "seed",
    "lanes",
    "seq_len",
    "global_batch_size",
    "cache_dir",
    "tokenizer",
    "datasets",
    "pack",
    "shuffle",
    "workers",
    "mixing",
    "schedule",
    "tokenize",
    "vision",
]


def _estimation_sample(index: Any, *, seed: int, samples: int, ds_number: int):
    """The seeded sample of records token estimation reads: ``(shard, [local record, ...])``
    per shard, in shard order (the same sample on every rank and every run)."""
    n = index.num_records
    k = min(samples, n)
    perm = IndexPermutation(n, stable_u64("token-estimate", seed, ds_number))
    picks = np.sort(perm.take(np.arange(k)))
    offsets = index.shard_offsets()
    shards = np.searchsorted(offsets, picks, side="right") - 1
    for s in np.unique(shards):
        yield int(s), (picks[shards == s] - offsets[s]).tolist()


def estimate_tokens(
    index: DatasetIndex, tokenizer: TextTokenizer, *, seed: int, samples: int, ds_number: int
) -> TokenEstimate:
    """TokenEstimation: tokenize a seeded sample of a dataset and measure tokens per byte."""
    texts: list[str] = []
    nbytes = 0
    for s, local in _estimation_sample(index, seed=seed, samples=samples, ds_number=ds_number):
        rb = index.record_bytes(s)
        for r, t in zip(local, index.read(s, local)):
            if isinstance(t, str):
                texts.append(t)
                nbytes += int(rb[r])
    per_record = (1 if tokenizer.add_bos else 0) + (1 if tokenizer.add_eos else 0)
    if not texts or nbytes == 0:
        return TokenEstimate(tokens_per_byte=1.0, tokens_per_record=float(per_record), sampled=0)
    content = tokenizer.count_tokens(texts) - per_record * len(texts)
    return TokenEstimate(
        tokens_per_byte=max(content, 1) / nbytes, tokens_per_record=float(per_record), sampled=len(texts)
    )


@dataclass
class _Prepared:
    indexes: list[DatasetIndex]
    tokenizer: TextTokenizer
    estimates: dict[str, TokenEstimate]
    plan: WorkPlan
    fetch: Any
    fingerprint: str
    special: dict[str, int] = field(default_factory=dict)  # image placeholder token ids (multimodal)


class Recipe:
    """A validated pipeline description. Build with :meth:`from_toml` or :meth:`from_dict`.

    Why a recipe: the data a run sees is a function of the recipe (and the files) alone, so it
    is validated up front, fingerprinted into every checkpoint, and every rank builds the same
    lanes from it. Nothing is read until :meth:`prepare` (or a loader) needs it.

    >>> from zephon.data import BUNDLED_TOKENIZER
    >>> cfg = {"seed": 1, "lanes": 4, "seq_len": 64, "global_batch_size": 8, "tokenizer": {"path": BUNDLED_TOKENIZER},
    ...        "datasets": [{"name": "web", "path": "web/*.jsonl", "weight": 1.0}]}
    >>> Recipe.from_dict(cfg).rows_per_lane
    2
    >>> Recipe.from_dict(dict(cfg, shufle={"buffer": 8}))
    Traceback (most recent call last):
    ...
    zephon.recipe.recipe.RecipeError: recipe: unknown key 'shufle' in the recipe's top level. Did you mean 'shuffle'? ...
    """

    def __init__(self, config: Mapping[str, Any], base_dir: str = ".") -> None:
        self.raw = copy.deepcopy(dict(config))
        self.base_dir = os.path.abspath(base_dir)
        self._validate(self.raw)
        self._prepared: _Prepared | None = None
        self._adopted: dict[str, TokenEstimate] | None = None
        self._lock = threading.RLock()

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> Recipe:
        """Read and validate a TOML recipe; relative paths are relative to its folder."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise RecipeError(f"recipe file {path!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise RecipeError(f"recipe file {path!r} is not valid TOML: {e}") from None
        return cls(data, base_dir=os.path.dirname(os.path.abspath(path)))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], base_dir: str = ".") -> Recipe:
        """Validate a recipe given as a dict (the TOML's structure); relative paths are
        relative to ``base_dir``."""
        return cls(config, base_dir)

    def replace(self, **changes: Any) -> Recipe:
        """A copy with top-level keys replaced (sections are dicts), re-validated."""
        raw = copy.deepcopy(self.raw)
        raw.update(changes)
        return Recipe(raw, self.base_dir)

    def _path(self, p: str) -> str:
        if "://" in p or os.path.isabs(p):
            return p
        return os.path.join(self.base_dir, p)

    # -- validation -------------------------------------------------------------------------
    def _validate(self, r: dict[str, Any]) -> None:
        _check_keys("the recipe's top level", r, TOP_KEYS)
        for key in ("seed", "lanes", "seq_len", "global_batch_size", "tokenizer", "datasets"):
            if key not in r:
                raise _fail(
                    f"recipe: missing required key {key!r}"
                    + (' (a [tokenizer] section with path = "...")' if key == "tokenizer" else "")
                )
        self.seed = _int("", "seed", r["seed"], 0)
        self.lanes = _int("", "lanes", r["lanes"], 1)
        self.seq_len = _int("", "seq_len", r["seq_len"], 8)
        self.global_batch_size = _int("", "global_batch_size", r["global_batch_size"], 1)
        if self.global_batch_size % self.lanes:
            lo = (self.global_batch_size // self.lanes) * self.lanes
            raise _fail(
                f"recipe: global_batch_size = {self.global_batch_size} is not a multiple of lanes = {self.lanes}; every "
                f"lane contributes the same number of rows per step. Use global_batch_size = {lo or self.lanes} or "
                f"{lo + self.lanes}, or a lane count that divides {self.global_batch_size}."
            )
        self.rows_per_lane = self.global_batch_size // self.lanes
        self.cache_dir = r.get("cache_dir")
        if self.cache_dir is not None:
            self.cache_dir = self._path(_str("", "cache_dir", self.cache_dir))

        tok = r["tokenizer"]
        if not isinstance(tok, dict):
            raise _fail('recipe: [tokenizer] must be a table with path = "..."')
        _check_keys("[tokenizer]", tok, ["path", "add_bos", "add_eos", "bos_token", "eos_token"])
        if "path" not in tok:
            raise _fail('recipe: [tokenizer] needs path = "folder with tokenizer.json, or the file itself"')
        self.tokenizer_path = self._path(_str("[tokenizer].", "path", tok["path"]))
        if "://" not in self.tokenizer_path and not os.path.exists(self.tokenizer_path):
            raise _fail(
                f"recipe: [tokenizer].path {self.tokenizer_path!r} does not exist; point it at a folder with tokenizer.json or at the file"
            )
        self.add_bos = _bool("[tokenizer].", "add_bos", tok.get("add_bos", True))
        self.add_eos = _bool("[tokenizer].", "add_eos", tok.get("add_eos", True))
        self.bos_token = tok.get("bos_token")
        self.eos_token = tok.get("eos_token")

        dss = r["datasets"]
        if not isinstance(dss, list) or not dss:
            raise _fail("recipe: [[datasets]] must list at least one dataset")
        specs: list[DatasetSpec] = []
        for i, d in enumerate(dss):
            where = f"[[datasets]] #{i + 1}"
            if not isinstance(d, dict):
                raise _fail(f"recipe: {where} must be a table")
            _check_keys(where, d, DATASET_KEYS)
            for req in ("name", "path"):
                if req not in d:
                    raise _fail(f"recipe: {where} needs {req} = ...")
            name = _str(f"{where}.", "name", d["name"])
            where = f"[[datasets]] {name!r}"
            path = d["path"]
            if isinstance(path, str):
                path = self._path(path)
            elif isinstance(path, list) and path and all(isinstance(p, str) for p in path):
                path = [self._path(p) for p in path]
            else:
                raise _fail(f"recipe: {where}.path must be a glob/URL string or a list of them, got {path!r}")
            policy = _str(f"{where}.", "policy", d.get("policy", "repeat"), POLICIES)
            epochs = d.get("epochs")
            if epochs is not None:
                epochs = _int(f"{where}.", "epochs", epochs, 1)
                if policy != "stop":
                    raise _fail(
                        f'recipe: {where}.epochs only applies with policy = "stop" ("repeat" cycles forever); set policy = "stop" or remove epochs'
                    )
            on_error = _str(f"{where}.", "on_error", d.get("on_error", "raise"), ("raise", "skip"))
            max_skipped = d.get("max_skipped")
            max_frac = d.get("max_skipped_fraction")
            if (max_skipped is not None or max_frac is not None) and on_error != "skip":
                raise _fail(f'recipe: {where}: max_skipped / max_skipped_fraction only apply with on_error = "skip"')
            if max_skipped is not None:
                max_skipped = _int(f"{where}.", "max_skipped", max_skipped, 0)
            if max_frac is not None:
                max_frac = _num(f"{where}.", "max_skipped_fraction", max_frac)
                if max_frac > 1:
                    raise _fail(f"recipe: {where}.max_skipped_fraction is a fraction in [0, 1], got {max_frac}")
            kind = _str(f"{where}.", "kind", d.get("kind", "text"), KINDS)
            if kind == "text":
                if "image_field" in d:
                    raise _fail(
                        f'recipe: {where}.image_field only applies to image datasets; set kind = "image_text" '
                        'or "interleaved", or remove image_field'
                    )
                fmt_choices = ("auto",) + tuple(FORMATS)
                text_default = "text"
            else:
                fmt_choices = ("auto",) + tuple(MM_FORMATS)
                text_default = "texts" if kind == "interleaved" else "caption"
                if "text_mode" in d:
                    raise _fail(f'recipe: {where}.text_mode only applies to kind = "text"; remove it')
            image_field = d.get("image_field")
            if image_field is not None:
                image_field = _str(f"{where}.", "image_field", image_field)
            elif kind != "text":
                image_field = "images" if kind == "interleaved" else "image"
            specs.append(
                DatasetSpec(
                    name=name,
                    path=path,
                    kind=kind,
                    image_field=image_field,
                    format=_str(f"{where}.", "format", d.get("format", "auto"), fmt_choices),
                    text_field=_str(f"{where}.", "text_field", d.get("text_field", text_default)),
                    text_mode=_str(f"{where}.", "text_mode", d.get("text_mode", "line"), tuple(TEXT_MODES)),
                    weight=_num(f"{where}.", "weight", d.get("weight", 1.0)),
                    policy=policy,
                    epochs=epochs,
                    on_error=on_error,
                    max_skipped=max_skipped,
                    max_skipped_fraction=max_frac,
                )
            )
        names = [s.name for s in specs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise _fail(f"recipe: dataset names must be unique; {dup[0]!r} appears more than once")
        if sum(s.weight for s in specs) <= 0:
            raise _fail("recipe: at least one dataset needs weight > 0")
        self.datasets = specs
        self.multimodal = any(s.kind != "text" for s in specs)

        pack = r.get("pack", {})
        _check_keys("[pack]", pack, ["algorithm", "flush_every", "max_open"])
        self.pack_algorithm = _str("[pack].", "algorithm", pack.get("algorithm", "greedy"), ALGORITHMS)
        self.pack_flush_every = _int("[pack].", "flush_every", pack.get("flush_every", 512), 1)
        self.pack_max_open = _int("[pack].", "max_open", pack.get("max_open", 8), 1)

        shuffle = r.get("shuffle", {})
        _check_keys("[shuffle]", shuffle, ["buffer"])
        self.shuffle_buffer = _int("[shuffle].", "buffer", shuffle.get("buffer", 1024), 1)

        workers = r.get("workers", {})
        _check_keys("[workers]", workers, ["count", "backend", "timeout_s", "start_method", "chunk_size", "prefetch"])
        try:
            self.workers = WorkerConfig(
                count=_int("[workers].", "count", workers.get("count", 0), 0),
                backend=_str("[workers].", "backend", workers.get("backend", "thread"), BACKENDS),
                timeout_s=_num("[workers].", "timeout_s", workers.get("timeout_s", 300.0), positive=True),
                start_method=_str("[workers].", "start_method", workers.get("start_method", "forkserver")),
            )
        except ValueError as e:
            raise _fail(f"recipe: [workers]: {e}") from None
        self.chunk_size = _int("[workers].", "chunk_size", workers.get("chunk_size", 32), 1)
        prefetch = workers.get("prefetch", "auto")
        self.prefetch = prefetch if prefetch == "auto" else _int("[workers].", "prefetch", prefetch, 0)

        tokw = r.get("tokenize", {})
        _check_keys("[tokenize]", tokw, ["workers", "backend"])
        self.tokenize_workers: WorkerConfig | None = None
        if tokw:
            self.tokenize_workers = WorkerConfig(
                count=_int("[tokenize].", "workers", tokw.get("workers", self.workers.count), 0),
                backend=_str("[tokenize].", "backend", tokw.get("backend", self.workers.backend), BACKENDS),
                timeout_s=self.workers.timeout_s,
                start_method=self.workers.start_method,
            )

        self._validate_vision(r.get("vision", {}))

        mixing = r.get("mixing", {})
        _check_keys("[mixing]", mixing, ["by", "estimate_samples", "split_tokens"])
        self.mix_by = _str("[mixing].", "by", mixing.get("by", "tokens"), MIX_BY)
        self.estimate_samples = _int("[mixing].", "estimate_samples", mixing.get("estimate_samples", 256), 1)
        # documents estimated longer than this are planned as several parts, so a single huge
        # document cannot skew a lane's mix for long (0 = never split)
        self.split_tokens = _int("[mixing].", "split_tokens", mixing.get("split_tokens", 4 * (self.seq_len + 1)), 0)

        sched = r.get("schedule", [])
        if not isinstance(sched, list):
            raise _fail(
                "recipe: [[schedule]] entries must be an array of tables with step = N and weights = {name = w}"
            )
        phases: list[tuple[int, list[float]]] = [(0, [s.weight for s in specs])]
        for i, ph in enumerate(sched):
            where = f"[[schedule]] #{i + 1}"
            if not isinstance(ph, dict):
                raise _fail(f"recipe: {where} must be a table")
            _check_keys(where, ph, ["step", "weights"])
            step = _int(f"{where}.", "step", ph.get("step"), 1) if "step" in ph else None
            if step is None or "weights" not in ph or not isinstance(ph["weights"], dict):
                raise _fail(f"recipe: {where} needs step = N and weights = {{ {names[0]} = 0.5, ... }}")
            unknown = [k for k in ph["weights"] if k not in names]
            if unknown:
                raise _fail(f"recipe: {where}.weights names unknown dataset {unknown[0]!r}; datasets are {names}")
            w = [_num(f"{where}.weights.", n, ph["weights"].get(n, 0.0)) for n in names]
            if phases and step <= phases[-1][0]:
                raise _fail(
                    f"recipe: {where}.step = {step} must be larger than the previous phase's step {phases[-1][0]}"
                )
            phases.append((step, w))
        try:
            self.schedule = WeightSchedule(phases)
        except ValueError as e:
            raise _fail(f"recipe: schedule: {e}") from None

    def _validate_vision(self, v: Any) -> None:
        """The ``[vision]`` section: image preprocessing, budgets and placeholder tokens."""
        if not isinstance(v, dict):
            raise _fail("recipe: [vision] must be a table (patch_size = 16, merge_size = 2, ...)")
        _check_keys("[vision]", v, VISION_KEYS)
        d = VisionConfig()
        sec = "[vision]."
        patch = _int(sec, "patch_size", v.get("patch_size", d.patch_size), 1)
        merge = _int(sec, "merge_size", v.get("merge_size", d.merge_size), 1)
        tps = _int(sec, "temporal_patch_size", v.get("temporal_patch_size", d.temporal_patch_size), 1)
        min_px = _int(sec, "min_pixels", v.get("min_pixels", d.min_pixels), 1)
        max_px = _int(sec, "max_pixels", v.get("max_pixels", d.max_pixels), 1)
        factor = patch * merge
        if max_px < factor * factor:
            raise _fail(
                f"recipe: [vision].max_pixels = {max_px} is below one merged patch ({factor}x{factor} = "
                f"{factor * factor} pixels for patch_size {patch} x merge_size {merge}); raise max_pixels"
            )
        if min_px > max_px:
            raise _fail(f"recipe: [vision].min_pixels = {min_px} is above max_pixels = {max_px}; lower min_pixels")

        def triple(key: str, default: tuple[float, ...], positive: bool) -> tuple[float, float, float]:
            val = v.get(key, list(default))
            if not isinstance(val, list) or len(val) != 3:
                raise _fail(f"recipe: [vision].{key} must be a list of 3 numbers (R, G, B), got {val!r}")
            out = []
            for x in val:
                if (
                    isinstance(x, bool)
                    or not isinstance(x, (int, float))
                    or not math.isfinite(x)
                    or (positive and x <= 0)
                ):
                    raise _fail(
                        f"recipe: [vision].{key} must be 3 finite numbers{' > 0' if positive else ''}, got {val!r}"
                    )
                out.append(float(x))
            return (out[0], out[1], out[2])

        mean = triple("mean", d.mean, False)
        std = triple("std", d.std, True)
        max_img_px = _int(sec, "max_image_pixels", v.get("max_image_pixels", d.max_image_pixels), 1)
        mib = _int(sec, "max_images_per_batch", v.get("max_images_per_batch", d.max_images_per_batch), 1)
        mir = _int(sec, "max_images_per_row", v.get("max_images_per_row", d.max_images_per_row), 0)
        mrope = _bool(sec, "mrope", v.get("mrope", d.mrope))
        self.vision = VisionConfig(
            patch_size=patch,
            temporal_patch_size=tps,
            merge_size=merge,
            min_pixels=min_px,
            max_pixels=max_px,
            mean=mean,
            std=std,
            max_image_pixels=max_img_px,
            max_images_per_batch=mib,
            max_images_per_row=mir,
            mrope=mrope,
        )
        self.vision_tokens = {
            name: _str(sec, f"{name}_token", v.get(f"{name}_token", default))
            for name, default in _VISION_TOKEN_DEFAULTS.items()
        }
        self.vision_workers: WorkerConfig | None = None
        if "workers" in v or "backend" in v:
            self.vision_workers = WorkerConfig(
                count=_int(sec, "workers", v.get("workers", self.workers.count), 0),
                backend=_str(sec, "backend", v.get("backend", self.workers.backend), BACKENDS),
                timeout_s=self.workers.timeout_s,
                start_method=self.workers.start_method,
            )
        self.vision_chunk_size = _int(sec, "chunk_size", v.get("chunk_size", 8), 1)

    # -- identity ---------------------------------------------------------------------------
    def data_definition(self) -> dict[str, Any]:
        """Everything that defines the data (not workers, not the cache folder)."""
        datasets = []
        for s in self.datasets:
            d = dataclasses.asdict(s) | {"path": None}
            if s.kind == "text":
                for k in _MM_ONLY_KEYS:
                    d.pop(k)
            datasets.append(d)
        out = {
            "seed": self.seed,
            "lanes": self.lanes,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "tokenizer": {"add_bos": self.add_bos, "add_eos": self.add_eos},
            "datasets": datasets,
            "pack": [self.pack_algorithm, self.pack_flush_every, self.pack_max_open],
            "shuffle": self.shuffle_buffer,
            "mixing": [self.mix_by, self.estimate_samples, self.split_tokens],
            "schedule": self.schedule.phases,
        }
        if self.multimodal:
            out["vision"] = dataclasses.asdict(self.vision) | {"tokens": self.vision_tokens}
        return out

    # -- preparation (I/O: indexing, tokenizer, estimation) ---------------------------------
    def prepare(self, progress: bool | None = None) -> _Prepared:
        """Index the datasets, load the tokenizer and estimate tokens (once per Recipe object)."""
        with self._lock:
            if self._prepared is not None:
                return self._prepared
            try:
                tok = TextTokenizer(self.tokenizer_path, self.add_bos, self.add_eos, self.bos_token, self.eos_token)
            except (OSError, ValueError) as e:
                raise RecipeError(f"recipe: [tokenizer]: {e}") from None
            indexes = [
                index_dataset(
                    s.name,
                    s.path,
                    format=s.format,
                    text_field=s.text_field,
                    text_mode=s.text_mode,
                    cache_dir=self.cache_dir,
                    progress=progress,
                )
                if s.kind == "text"
                else index_multimodal(
                    s.name,
                    s.path,
                    kind=s.kind,
                    format=s.format,
                    text_field=s.text_field,
                    image_field=s.image_field,
                    cache_dir=self.cache_dir,
                )
                for s in self.datasets
            ]
            special = self._special_ids(tok) if self.multimodal else {}
            for s, ix in zip(self.datasets, indexes):
                if ix.num_records == 0:
                    raise RecipeError(
                        f"recipe: dataset {s.name!r} has no records at {s.path!r}; fix the path or remove the dataset"
                    )
            if self._adopted is not None:
                estimates = dict(self._adopted)
            else:
                estimates = {}
                it = list(enumerate(zip(self.datasets, indexes)))
                if progress:
                    from tqdm.auto import tqdm

                    it = tqdm(it, desc="token estimation", unit="dataset")
                for i, (s, ix) in it:
                    est = estimate_tokens if s.kind == "text" else estimate_mm_tokens
                    estimates[s.name] = est(ix, tok, seed=self.seed, samples=self.estimate_samples, ds_number=i)
            h = hashlib.sha256()
            h.update(json.dumps(self.data_definition(), sort_keys=True, default=str).encode())
            for ix in indexes:
                h.update(ix.fingerprint.encode())
            h.update(tok.fingerprint.encode())
            if self.multimodal:
                fetch: Any = FetchVision(
                    indexes,
                    [s.kind for s in self.datasets],
                    tok,
                    self.vision,
                    special,
                    on_error=[s.on_error for s in self.datasets],
                    row_len=self.seq_len + 1,
                )
            else:
                fetch = FetchTokenize(
                    indexes,
                    tok,
                    [s.on_error for s in self.datasets],
                    align=1 if self.pack_algorithm == "greedy" else self.seq_len + 1,
                )
            self._prepared = _Prepared(
                indexes=indexes,
                tokenizer=tok,
                estimates=estimates,
                plan=self._plan(indexes, estimates),
                fetch=fetch,
                fingerprint=h.hexdigest()[:32],
                special=special,
            )
            return self._prepared

    def _special_ids(self, tok: TextTokenizer) -> dict[str, int]:
        """Token ids of the image placeholder tokens (``[vision].*_token``), checked."""
        out = {}
        for name, text in self.vision_tokens.items():
            i = tok.token_to_id(text)
            if i is None:
                raise RecipeError(
                    f"recipe: [vision].{name}_token = {text!r} is not a token of the tokenizer at "
                    f"{self.tokenizer_path!r}; add it to the tokenizer as a special token (as Qwen-VL tokenizers have), "
                    f"or set [vision].{name}_token to a special token it has"
                )
            out[name] = int(i)
        if len(set(out.values())) != len(out):
            raise RecipeError(f"recipe: [vision] placeholder tokens must be distinct tokens, got ids {out}")
        bad = [n for n, i in out.items() if i in (tok.bos_id, tok.eos_id)]
        if bad:
            raise RecipeError(
                f"recipe: [vision].{bad[0]}_token is the tokenizer's BOS/EOS token; use a dedicated token"
            )
        return out

    def _plan(self, indexes: Sequence[DatasetIndex], estimates: Mapping[str, TokenEstimate]) -> WorkPlan:
        plans = []
        for s, ix in zip(self.datasets, indexes):
            sizes = [sh.num_records for sh in ix.shards]
            if self.mix_by == "tokens" and s.kind != "text":
                # plan by estimated tokens per record: text (measured tokens/byte) + exact image
                # placeholder counts from the indexed image sizes; image samples are never split
                est = estimates[s.name]
                plans.append(
                    DatasetPlan(
                        s.name,
                        sizes,
                        _MMTokens(ix, est, self.vision),
                        tokens_per_byte=1.0,
                        tokens_per_record=0.0,
                        policy=s.policy,
                        epochs=s.epochs,
                        split_tokens=None,
                    )
                )
            elif self.mix_by == "tokens":
                est = estimates[s.name]
                plans.append(
                    DatasetPlan(
                        s.name,
                        sizes,
                        ix.record_bytes,
                        tokens_per_byte=est.tokens_per_byte,
                        tokens_per_record=est.tokens_per_record,
                        policy=s.policy,
                        epochs=s.epochs,
                        split_tokens=self.split_tokens or None,
                    )
                )
            else:
                ones = _Ones(sizes)
                plans.append(
                    DatasetPlan(
                        s.name,
                        sizes,
                        ones,
                        tokens_per_byte=1.0,
                        tokens_per_record=0.0,
                        policy=s.policy,
                        epochs=s.epochs,
                    )
                )
        return WorkPlan(
            plans,
            seed=self.seed,
            lanes=self.lanes,
            schedule=self.schedule,
            tokens_per_step=self.rows_per_lane * self.seq_len,
        )

    @property
    def fingerprint(self) -> str:
        """Hash of the data definition (recipe, data files, tokenizer): a checkpoint made under
        another fingerprint is refused."""
        return self.prepare().fingerprint

    @property
    def tokenizer(self) -> TextTokenizer:
        """The run's tokenizer (loaded on first use)."""
        return self.prepare().tokenizer

    @property
    def estimates(self) -> dict[str, TokenEstimate]:
        """Measured tokens per byte per dataset (or the ones adopted from a checkpoint)."""
        return dict(self.prepare().estimates)

    @property
    def indexes(self) -> list[DatasetIndex]:
        """The datasets' shard indexes, in recipe order."""
        return list(self.prepare().indexes)

    def lane_context(self, lane: int, workers: WorkerConfig | None = None) -> LaneContext:
        """The context ``build_lane`` needs for ``lane`` of this recipe (seed and lanes filled in)."""
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane must be in [0, {self.lanes}), got {lane}")
        return LaneContext(seed=self.seed, lane=lane, lanes=self.lanes, workers=workers or self.workers)

    # -- checkpoint-carried derived values ---------------------------------------------------
    def shared_state(self) -> dict[str, Any]:
        """The rank-independent part of a checkpoint: token estimates and the data and
        tokenizer fingerprints (see :meth:`adopt_shared`)."""
        p = self.prepare()
        return {
            "token_estimates": {
                k: [v.tokens_per_byte, v.tokens_per_record, v.sampled] for k, v in sorted(p.estimates.items())
            },
            "data": {s.name: ix.fingerprint[:16] for s, ix in zip(self.datasets, p.indexes)},
            "tokenizer": p.tokenizer.fingerprint[:16],
        }

    def adopt_shared(self, shared: dict[str, Any]) -> bool:
        """Check a checkpoint's data and tokenizer against ours (naming what changed), then use
        its token estimates; True if they differ from ours."""
        p = self.prepare()
        data = shared.get("data", {})
        for s, ix in zip(self.datasets, p.indexes):
            old = data.get(s.name)
            if old is not None and old != ix.fingerprint[:16]:
                raise StateError(
                    f"the files of dataset {s.name!r} changed since the checkpoint was written (a shard was "
                    f"added, removed or modified under {s.path!r}): resuming would feed different data. Restore "
                    "the original files, or start a new run from this data."
                )
        tok = shared.get("tokenizer")
        if tok is not None and tok != p.tokenizer.fingerprint[:16]:
            raise StateError(
                f"the tokenizer at {self.tokenizer_path!r} (or the BOS/EOS policy) changed since the checkpoint "
                "was written; restore it, or start a new run."
            )
        raw = shared.get("token_estimates")
        if raw is None:
            return False
        names = sorted(s.name for s in self.datasets)
        if not isinstance(raw, dict) or sorted(raw) != names:
            raise StateError(
                f"checkpoint token estimates are for datasets {sorted(raw) if isinstance(raw, dict) else raw!r}, the recipe has {names}"
            )
        adopted = {k: TokenEstimate(float(v[0]), float(v[1]), int(v[2])) for k, v in raw.items()}
        with self._lock:
            current = self.prepare().estimates
            if adopted == current:
                return False
            self._adopted = adopted
            p = self._prepared
            p.estimates = adopted
            p.plan = self._plan(p.indexes, adopted)
            return True

    # -- pipelines --------------------------------------------------------------------------
    def build_lane(self, ctx: LaneContext):
        """The pipeline of one lane (a torchdata BaseNode yielding micro-batches)."""
        p = self.prepare()
        if self.multimodal:
            return self._build_mm_lane(ctx, p)
        node, pad = self._lane_front(ctx, p, self.tokenize_workers or ctx.workers, self.chunk_size, "fetch+tokenize")
        node = Pack(
            node,
            seq_len=self.seq_len,
            algorithm=self.pack_algorithm,
            flush_every=self.pack_flush_every,
            pad_id=pad,
            max_open=self.pack_max_open,
        )
        if self.shuffle_buffer > 1:
            node = WindowShuffle(
                node,
                buffer=self.shuffle_buffer,
                seed=self.seed,
                lane=ctx.lane,
                phase=(ctx.lane * self.shuffle_buffer) // self.lanes,
            )
        return Batch(node, batch_size=self.rows_per_lane)

    def _lane_front(
        self, ctx: LaneContext, p: _Prepared, wc: WorkerConfig, chunk: int, name: str, per_worker: int = 16
    ):
        """WorkSource -> OrderedMapper(p.fetch) -> SkipCounter, shared by text and VLM lanes; and the pad id.

        ``per_worker``: chunks a rank's lanes may hold in flight per worker (text chunks are tens of
        KB of token ids; image chunks tens of MB of patches, so the vision path passes less)."""
        if wc.count > 0:
            # with our own workers, the tokenizer's internal thread pool only serialises them
            set_tokenizers_parallelism(False)
        node: Any = LaneWorkSource(p.plan, ctx.lane)
        node = OrderedMapper(
            node,
            batch_fn=p.fetch,
            workers=wc,
            pool=ctx.pool(wc),
            chunk_size=chunk,
            max_in_flight=ctx.max_in_flight(wc, per_worker),
            lane=ctx.lane,
            name=name,
        )
        node = SkipCounter(
            node,
            dataset_names=[s.name for s in self.datasets],
            lanes=self.lanes,
            max_skipped=[s.max_skipped for s in self.datasets],
            max_fraction=[s.max_skipped_fraction for s in self.datasets],
            shard_names=[[sh.path for sh in ix.shards] for ix in p.indexes],
        )
        pad = p.tokenizer.pad_id if p.tokenizer.pad_id is not None else (p.tokenizer.eos_id or 0)
        return node, pad

    def _build_mm_lane(self, ctx: LaneContext, p: _Prepared):
        """WorkSource -> OrderedMapper(FetchVision) -> SkipCounter -> MMPack -> WindowShuffle (of micro-batches)."""
        node, pad = self._lane_front(
            ctx,
            p,
            self.vision_workers or self.tokenize_workers or ctx.workers,
            self.vision_chunk_size,
            "fetch+vision",
            per_worker=8,
        )
        node = MMPack(
            node,
            seq_len=self.seq_len,
            rows=self.rows_per_lane,
            patch_dim=self.vision.patch_dim,
            max_images_per_batch=self.vision.max_images_per_batch,
            max_images_per_row=self.vision.max_images_per_row,
            flush_every=self.pack_flush_every,
            pad_id=pad,
            ignore_ids=list(p.special.values()),
            mrope=self.vision.mrope,
        )
        buffer = -(-self.shuffle_buffer // self.rows_per_lane)  # in micro-batches
        if buffer > 1:
            node = WindowShuffle(
                node, buffer=buffer, seed=self.seed, lane=ctx.lane, phase=(ctx.lane * buffer) // self.lanes
            )
        return node

    def prefetch_depth(self, world_size: int) -> int:
        """Local batches a rank computes ahead. "auto": enough to cover one shuffle-window refill
        (lanes refill at staggered steps, so a refill is ``buffer / (lanes per rank x rows per
        lane)`` steps of the rank's work), at least 2."""
        if self.prefetch != "auto":
            return int(self.prefetch)
        per_step = (self.lanes // world_size) * self.rows_per_lane
        return max(2, -(-self.shuffle_buffer // per_step) + 1) if self.shuffle_buffer > 1 else 2

    def router(self, world_size: int = 1, rank: int = 0, workers: WorkerConfig | None = None, **kw: Any) -> Router:
        """This rank's loader (a torchdata node yielding its local batches)."""
        check_world_size(self.lanes, world_size)
        kw.setdefault("prefetch", self.prefetch_depth(world_size))
        return Router(
            self.build_lane,
            lanes=self.lanes,
            world_size=world_size,
            rank=rank,
            seed=self.seed,
            fingerprint=self.fingerprint,
            workers=workers or self.workers,
            shared_state=self.shared_state,
            adopt_shared=self.adopt_shared,
            **kw,
        )

    def global_loader(self, world_size: int = 1, workers: WorkerConfig | None = None, **kw: Any) -> GlobalLoader:
        """All ``world_size`` ranks in this process: yields global batches (tests, hashes)."""
        kw.setdefault("prefetch", self.prefetch_depth(world_size))
        return GlobalLoader(
            self.build_lane,
            lanes=self.lanes,
            world_size=world_size,
            seed=self.seed,
            fingerprint=self.fingerprint,
            workers=workers or self.workers,
            shared_state=self.shared_state,
            adopt_shared=self.adopt_shared,
            **kw,
        )

    def _repr_html_(self) -> str:
        import html as _html

        rows = "".join(
            f"<tr><td>{_html.escape(s.name)}</td><td>{_html.escape(s.kind if hasattr(s, 'kind') else 'text')}</td>"
            f"<td>{_html.escape(s.format)}</td><td>{s.weight:g}</td><td>{_html.escape(s.policy)}</td>"
            f"<td>{_html.escape(s.on_error)}</td><td><code>{_html.escape(str(s.path))}</code></td></tr>"
            for s in self.datasets
        )
        return (
            f'<div class="zephon-recipe"><b>Recipe</b>: seed {self.seed} &middot; {self.lanes} lanes &middot; '
            f"seq_len {self.seq_len} &middot; global batch {self.global_batch_size} rows "
            f"({self.rows_per_lane} per lane) &middot; pack {self.pack_algorithm} (flush every {self.pack_flush_every}) "
            f"&middot; shuffle {self.shuffle_buffer} &middot; mixing by {self.mix_by} &middot; workers "
            f"{self.workers.count} {self.workers.backend}"
            "<table><tr><th>dataset</th><th>kind</th><th>format</th><th>weight</th><th>policy</th><th>on_error</th>"
            f"<th>path</th></tr>{rows}</table></div>"
        )

    def __repr__(self) -> str:
        ds = ", ".join(f"{s.name}={s.weight:g}" for s in self.datasets)
        return (
            f"Recipe(seed={self.seed}, lanes={self.lanes}, seq_len={self.seq_len}, global_batch_size={self.global_batch_size}, "
            f"datasets=[{ds}], pack={self.pack_algorithm}, shuffle={self.shuffle_buffer}, workers={self.workers.count} {self.workers.backend})"
        )


def _migrate_text_lane_v1(state: dict[str, Any]) -> dict[str, Any]:
    """Format 1 -> 2 for text lanes: insert a skip_counter (counts start at 0) under the pack."""
    node = state
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


register_lane_migration(1, _migrate_text_lane_v1)


def estimate_mm_tokens(
    index: Any, tokenizer: TextTokenizer, *, seed: int, samples: int, ds_number: int
) -> TokenEstimate:
    """Text tokens per text byte of an image-text dataset, from a seeded sample of records."""
    texts: list[str] = []
    nbytes = 0
    records = 0
    for s, local in _estimation_sample(index, seed=seed, samples=samples, ds_number=ds_number):
        for rec in index.read(s, local):
            segs = getattr(rec, "segments", None)
            if segs is None:
                continue
            records += 1
            for seg in segs:
                if isinstance(seg, str) and seg:
                    texts.append(seg)
                    nbytes += len(seg.encode("utf-8"))
    per_record = (1 if tokenizer.add_bos else 0) + (1 if tokenizer.add_eos else 0)
    if not texts or nbytes == 0:
        return TokenEstimate(tokens_per_byte=1.0, tokens_per_record=float(per_record), sampled=records)
    content = sum(len(e) for e in tokenizer._encodings(texts))
    return TokenEstimate(tokens_per_byte=max(content, 1) / nbytes, tokens_per_record=float(per_record), sampled=records)


class _MMTokens:
    """record_bytes stand-in for image-text datasets: estimated tokens per record (text bytes x
    tokens/byte + BOS/EOS + each image's placeholder run, exact from its indexed size)."""

    def __init__(self, index: Any, est: TokenEstimate, vision: Any) -> None:
        self.index, self.est, self.vision = index, est, vision
        self._cache: dict[int, np.ndarray] = {}

    def __call__(self, shard: int) -> np.ndarray:
        a = self._cache.get(shard)
        if a is None:
            text = (
                self.index.record_bytes(shard).astype(np.float64) * self.est.tokens_per_byte
                + self.est.tokens_per_record
            )
            n_img, ws, hs = self.index.image_sizes(shard)
            per_image = np.array([self.vision.image_tokens(int(w), int(h)) + 2 for w, h in zip(ws, hs)], np.float64)
            owner = np.repeat(np.arange(len(n_img)), n_img)
            img = (
                np.bincount(owner, weights=per_image, minlength=len(n_img)) if per_image.size else np.zeros(len(n_img))
            )
            a = self._cache[shard] = np.maximum(1, np.rint(text + img)).astype(np.int64)
        return a


class _Ones:
    """record_bytes stand-in for mixing by samples: every record weighs 1."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = list(sizes)
        self._cache: dict[int, np.ndarray] = {}

    def __call__(self, shard: int) -> np.ndarray:
        a = self._cache.get(shard)
        if a is None:
            a = self._cache[shard] = np.ones(self.sizes[shard], dtype=np.int64)
        return a
