"""What a recipe is: frozen dataclasses you can read, and the parser that fills them from TOML.

:func:`parse_recipe` checks every key of a recipe (a dict with the TOML's structure) before
anything is read or started: unknown keys get a did-you-mean, impossible values and
combinations name the key and the fix. The result, a :class:`RecipeSpec`, is the whole
description of a run's data and nothing else: no file is opened, nothing is measured.

    >>> from zephon.data import BUNDLED_TOKENIZER
    >>> spec = parse_recipe({"seed": 1, "lanes": 4, "seq_len": 64, "global_batch_size": 8,
    ...                      "tokenizer": {"path": BUNDLED_TOKENIZER},
    ...                      "datasets": [{"name": "web", "path": "web/*.jsonl"}]}, base_dir="/data")
    >>> spec.rows_per_lane, spec.datasets[0].path, spec.pack.algorithm, spec.shuffle.buffer
    (2, '/data/web/*.jsonl', 'greedy', 1024)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zephon.data import DEFAULT_MAX_RECORD_BYTES, FORMATS, KINDS, MM_FORMATS, TEXT_MODES
from zephon.engine import BACKENDS, END_MODES, MAX_CHUNK_SIZE, WorkerConfig
from zephon.nodes import ALGORITHMS, ON_ERROR, POLICIES, VisionConfig, WeightSchedule

__all__ = [
    "DATASET_KEYS",
    "LIMITS",
    "MIX_BY",
    "TOP_KEYS",
    "VISION_KEYS",
    "DatasetSpec",
    "MixingSpec",
    "PackSpec",
    "RecipeError",
    "RecipeSpec",
    "ShuffleSpec",
    "TokenizerSpec",
    "VisionSpec",
    "WorkersSpec",
    "max_workers",
    "parse_recipe",
]

MIX_BY = ("tokens", "samples")

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
    "lane_tokens": 1 << 24,
    "shuffle_tokens": 1 << 27,
    "buffer": 1 << 20,
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
    "images": 65536,
}


def max_workers() -> int:
    """The most workers a pool may have: ``max(64, 4 x CPUs)`` (more only contend for the CPUs
    and memory; 100,000 would never start)."""
    return max(64, 4 * (os.cpu_count() or 1))


class RecipeError(ValueError):
    """An invalid recipe; the message names the key and the fix."""


@dataclass(frozen=True)
class DatasetSpec:
    """One ``[[datasets]]`` entry."""

    name: str
    path: Any  # str or list of str (globs / fsspec URLs), made absolute against the recipe's folder
    format: str = "auto"
    text_field: str = "text"
    text_mode: str = "line"
    weight: float = 1.0
    policy: str = "repeat"
    epochs: int | None = None
    on_error: str = "raise"
    max_skipped: int | None = None  # with on_error = "skip": run-wide budget, split exactly over the lanes
    max_skipped_fraction: float | None = None
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES  # the per-record size limit: larger records are bad records
    kind: str = "text"  # "text", "image_text" (one image + caption) or "interleaved" (OBELICS-style)
    image_field: str | None = None  # image column (parquet image_text / interleaved)


@dataclass(frozen=True)
class TokenizerSpec:
    """``[tokenizer]``: where the tokenizer is and the loader's BOS/EOS policy."""

    path: str
    add_bos: bool = True
    add_eos: bool = True
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens_in_text: bool = False  # opt-in: text like "<|eos|>" in a document becomes the special token


@dataclass(frozen=True)
class PackSpec:
    """``[pack]``: how documents become rows (``flush_every`` is part of the data definition)."""

    algorithm: str = "greedy"
    flush_every: int = 512
    max_open: int = 8


@dataclass(frozen=True)
class ShuffleSpec:
    """``[shuffle]``: rows per shuffle window (1 = no shuffle)."""

    buffer: int = 1024


@dataclass(frozen=True)
class MixingSpec:
    """``[mixing]``: token- or sample-weighted mixing, how tokens per byte are measured, and
    from which estimated length a document is planned as several parts (0 = never)."""

    by: str = "tokens"
    estimate_samples: int = 256
    split_tokens: int = 0


@dataclass(frozen=True)
class WorkersSpec:
    """``[workers]`` and the per-stage overrides of ``[tokenize]`` / ``[vision]``.

    Which setting wins, in one place (:meth:`for_stage`): an override given when the loader is
    built (``zephon hashes --workers/--backend``, ``ZephonDataLoader.Config.workers/backend``,
    ``recipe.global_loader(workers=...)``) applies to every pool; otherwise a stage's own
    section (``[tokenize]`` for text, ``[vision]`` for image-text lanes) wins over
    ``[workers]``. None of these changes a byte of the data.
    """

    default: WorkerConfig = dataclasses.field(default_factory=WorkerConfig)
    chunk_size: int = 32
    prefetch: int | str = "auto"
    tokenize: WorkerConfig | None = None
    vision: WorkerConfig | None = None
    vision_chunk_size: int = 8

    def for_stage(
        self, stage: str, override: WorkerConfig | None = None, default: WorkerConfig | None = None
    ) -> WorkerConfig:
        """The workers of ``stage`` ("tokenize" or "vision"): ``override`` wins over all; then the
        stage's own section; then ``default`` (a lane context's workers), else ``[workers]``.

        >>> w = WorkersSpec(WorkerConfig(2), vision=WorkerConfig(4, "process"))
        >>> w.for_stage("vision").count, w.for_stage("tokenize").count, w.for_stage("vision", WorkerConfig(0)).count
        (4, 2, 0)
        """
        if override is not None:
            return override
        if stage == "vision":
            own = self.vision or self.tokenize
        elif stage == "tokenize":
            own = self.tokenize
        else:
            raise ValueError(f"unknown stage {stage!r}; expected 'tokenize' or 'vision'")
        return own or default or self.default

    def override(self, multimodal: bool, count: int | None = None, backend: str | None = None) -> WorkerConfig | None:
        """The override a loader's own settings make (``--workers`` / ``--backend``, the TorchTitan
        loader's ``workers`` / ``backend``): the recipe's workers for its main stage with ``count``
        and ``backend`` replaced; None when neither is given, so the recipe's own settings apply.

        >>> WorkersSpec(WorkerConfig(4, "process")).override(False, count=0)
        WorkerConfig(count=0, backend='process', timeout_s=300.0, start_method='forkserver', shm_mb=None)
        """
        if count is None and backend is None:
            return None
        base = self.for_stage("vision" if multimodal else "tokenize")
        return dataclasses.replace(
            base, count=base.count if count is None else count, backend=base.backend if backend is None else backend
        )


@dataclass(frozen=True)
class VisionSpec:
    """``[vision]``: image preprocessing and budgets, and the placeholder tokens' text."""

    config: VisionConfig = dataclasses.field(default_factory=VisionConfig)
    tokens: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: {
            "image": "<|image_pad|>",
            "video": "<|video_pad|>",
            "vision_start": "<|vision_start|>",
            "vision_end": "<|vision_end|>",
        }
    )


@dataclass(frozen=True)
class RecipeSpec:
    """A whole recipe, validated: everything that defines the data, plus performance settings
    (``workers``) that never change it."""

    seed: int
    lanes: int
    seq_len: int
    global_batch_size: int
    tokenizer: TokenizerSpec
    datasets: tuple[DatasetSpec, ...]
    schedule: WeightSchedule
    pack: PackSpec = PackSpec()
    shuffle: ShuffleSpec = ShuffleSpec()
    mixing: MixingSpec = MixingSpec()
    workers: WorkersSpec = WorkersSpec()
    vision: VisionSpec = VisionSpec()
    cache_dir: str | None = None
    #: how a finite recipe ends (every dataset ``policy = "stop"``): "pad" or "drop"; None for a
    #: recipe that never ends (it has a "repeat" dataset)
    end: str | None = None

    @property
    def finite(self) -> bool:
        """Whether the data ends: every dataset has ``policy = "stop"`` (a "repeat" dataset
        never runs out, and the lanes fall back to it)."""
        return all(s.policy == "stop" for s in self.datasets)

    @property
    def rows_per_lane(self) -> int:
        """Packed rows each lane contributes to a step (``global_batch_size / lanes``)."""
        return self.global_batch_size // self.lanes

    @property
    def multimodal(self) -> bool:
        """Whether any dataset has images (image-text lanes, :class:`zephon.nodes.MMPack`)."""
        return any(s.kind != "text" for s in self.datasets)

    def data_definition(self) -> dict[str, Any]:
        """Everything that defines the data (not workers, not the cache folder, not paths: the
        files enter the fingerprint through their own metadata)."""
        datasets = []
        for s in self.datasets:
            d = dataclasses.asdict(s) | {"path": None}
            if s.kind == "text":
                for k in _MM_ONLY_KEYS:
                    d.pop(k)
            for k, default in _OMITTED_AT_DEFAULT.items():
                if d.get(k) == default:
                    d.pop(k)  # keys added later: a recipe that leaves them alone keeps its fingerprint
            datasets.append(d)
        out = {
            "seed": self.seed,
            "lanes": self.lanes,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "tokenizer": {"add_bos": self.tokenizer.add_bos, "add_eos": self.tokenizer.add_eos},
            "datasets": datasets,
            "pack": [self.pack.algorithm, self.pack.flush_every, self.pack.max_open],
            "shuffle": self.shuffle.buffer,
            "mixing": [self.mixing.by, self.mixing.estimate_samples, self.mixing.split_tokens],
            "schedule": self.schedule.phases,
        }
        if self.multimodal:
            out["vision"] = dataclasses.asdict(self.vision.config) | {"tokens": dict(self.vision.tokens)}
        if self.end is not None:  # finite recipes only: the fingerprints of the others stay
            out["end"] = self.end
        return out


#: keys a text dataset's entry leaves out of the data definition (so text-only fingerprints stay)
_MM_ONLY_KEYS = ("kind", "image_field")
#: dataset keys left out of the data definition when they have their default value (so recipes
#: written before the key existed keep their fingerprint, and their checkpoints resume)
_OMITTED_AT_DEFAULT: Mapping[str, Any] = {"max_record_bytes": DEFAULT_MAX_RECORD_BYTES}

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
    "end",
]
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


# -- value checks ------------------------------------------------------------------------------
def _check_keys(section: str, got: Mapping[str, Any], allowed: Sequence[str]) -> None:
    unknown = [k for k in got if k not in allowed]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, allowed, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise RecipeError(f"recipe: unknown key {k!r} in {section}.{hint} Allowed keys: {', '.join(allowed)}.")


def _table(section: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise RecipeError(f"recipe: {section} must be a table, got {value!r}")
    return value


def _int(section: str, key: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecipeError(f"recipe: {section}{key} must be an integer, got {value!r}")
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
        raise RecipeError(f"recipe: {section}{key} must be a string, got {value!r}")
    if choices is not None and value not in choices:
        raise RecipeError(
            f"recipe: {section}{key} = {value!r} is not valid; use one of {', '.join(map(repr, choices))}"
        )
    return value


def _bool(section: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RecipeError(f"recipe: {section}{key} must be true or false, got {value!r}")
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
            f"recipe: {section}{key} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}"
        )
    if maximum is not None and value > maximum:
        raise RecipeError(f"recipe: {section}{key} = {value!r} is above its limit of {maximum:g}; use a smaller value")
    return float(value)


def _path(base_dir: str, p: str) -> str:
    if "://" in p or os.path.isabs(p):
        return p
    return os.path.join(base_dir, p)


# -- sections ----------------------------------------------------------------------------------
def parse_recipe(raw: Mapping[str, Any], base_dir: str = ".") -> RecipeSpec:
    """Validate a recipe given as a dict (the TOML's structure) into a :class:`RecipeSpec`;
    relative paths are made absolute against ``base_dir``. Raises :class:`RecipeError`."""
    r = _table("the recipe", raw)
    base_dir = os.path.abspath(base_dir)
    _check_keys("the recipe's top level", r, TOP_KEYS)
    for key in ("seed", "lanes", "seq_len", "global_batch_size", "tokenizer", "datasets"):
        if key not in r:
            raise RecipeError(
                f"recipe: missing required key {key!r}"
                + (' (a [tokenizer] section with path = "...")' if key == "tokenizer" else "")
            )
    seed = _int("", "seed", r["seed"], 0, LIMITS["seed"])
    lanes = _int("", "lanes", r["lanes"], 1, LIMITS["lanes"])
    seq_len = _int("", "seq_len", r["seq_len"], 8, LIMITS["seq_len"])
    global_batch_size = _int("", "global_batch_size", r["global_batch_size"], 1, LIMITS["global_batch_size"])
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
    cache_dir = r.get("cache_dir")
    if cache_dir is not None:
        cache_dir = _path(base_dir, _str("", "cache_dir", cache_dir))
    datasets = _datasets(r["datasets"], base_dir)
    end = _end(r.get("end"), datasets)
    vision = _vision(r.get("vision", {}))
    workers = _vision_workers(r.get("vision", {}), _workers(r))
    shuffle = _shuffle(r.get("shuffle", {}))
    held = shuffle.buffer * (seq_len + 1)
    if held > LIMITS["shuffle_tokens"]:
        raise RecipeError(
            f"recipe: [shuffle].buffer x (seq_len + 1) = {shuffle.buffer} x {seq_len + 1} = {held} tokens held by "
            f"each lane's shuffle window, above the limit of {LIMITS['shuffle_tokens']} (about "
            f"{LIMITS['shuffle_tokens'] * 30 >> 30} GB per lane); use a smaller [shuffle].buffer"
        )
    return RecipeSpec(
        seed=seed,
        lanes=lanes,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        tokenizer=_tokenizer(r["tokenizer"], base_dir),
        datasets=datasets,
        schedule=_schedule(r.get("schedule", []), datasets),
        pack=_pack(r.get("pack", {})),
        shuffle=shuffle,
        mixing=_mixing(r.get("mixing", {}), seq_len),
        workers=workers,
        vision=vision,
        cache_dir=cache_dir,
        end=end,
    )


def _end(end: Any, datasets: Sequence[DatasetSpec]) -> str | None:
    """The ``end`` key: how a finite recipe's last step is made (default "pad")."""
    repeating = [s.name for s in datasets if s.policy != "stop"]
    if end is None:
        return None if repeating else "pad"
    end = _str("", "end", end, END_MODES)
    if repeating:
        raise RecipeError(
            f'recipe: end = {end!r} applies to a finite recipe (every dataset policy = "stop"), but dataset '
            f'{repeating[0]!r} has policy = "repeat" and never runs out; set policy = "stop" on every dataset '
            "or remove end"
        )
    return end


def _tokenizer(tok: Any, base_dir: str) -> TokenizerSpec:
    if not isinstance(tok, dict):
        raise RecipeError('recipe: [tokenizer] must be a table with path = "..."')
    _check_keys("[tokenizer]", tok, ["path", "add_bos", "add_eos", "bos_token", "eos_token", "special_tokens_in_text"])
    if "path" not in tok:
        raise RecipeError('recipe: [tokenizer] needs path = "folder with tokenizer.json, or the file itself"')
    path = _path(base_dir, _str("[tokenizer].", "path", tok["path"]))
    if "://" not in path and not os.path.exists(path):
        raise RecipeError(
            f"recipe: [tokenizer].path {path!r} does not exist; point it at a folder with tokenizer.json or at the file"
        )
    return TokenizerSpec(
        path=path,
        add_bos=_bool("[tokenizer].", "add_bos", tok.get("add_bos", True)),
        add_eos=_bool("[tokenizer].", "add_eos", tok.get("add_eos", True)),
        bos_token=tok.get("bos_token"),
        eos_token=tok.get("eos_token"),
        special_tokens_in_text=_bool(
            "[tokenizer].", "special_tokens_in_text", tok.get("special_tokens_in_text", False)
        ),
    )


def _datasets(dss: Any, base_dir: str) -> tuple[DatasetSpec, ...]:
    if not isinstance(dss, list) or not dss:
        raise RecipeError("recipe: [[datasets]] must list at least one dataset")
    specs = tuple(_dataset(i, d, base_dir) for i, d in enumerate(dss))
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RecipeError(f"recipe: dataset names must be unique; {dup[0]!r} appears more than once")
    if sum(s.weight for s in specs) <= 0:
        raise RecipeError("recipe: at least one dataset needs weight > 0")
    return specs


def _dataset(i: int, d: Any, base_dir: str) -> DatasetSpec:
    where = f"[[datasets]] #{i + 1}"
    if not isinstance(d, dict):
        raise RecipeError(f"recipe: {where} must be a table")
    _check_keys(where, d, DATASET_KEYS)
    for req in ("name", "path"):
        if req not in d:
            raise RecipeError(f"recipe: {where} needs {req} = ...")
    name = _str(f"{where}.", "name", d["name"])
    where = f"[[datasets]] {name!r}"
    path = d["path"]
    if isinstance(path, str):
        path = _path(base_dir, path)
    elif isinstance(path, list) and path and all(isinstance(p, str) for p in path):
        path = [_path(base_dir, p) for p in path]
    else:
        raise RecipeError(f"recipe: {where}.path must be a glob/URL string or a list of them, got {path!r}")
    policy = _str(f"{where}.", "policy", d.get("policy", "repeat"), POLICIES)
    epochs = d.get("epochs")
    if epochs is not None:
        epochs = _int(f"{where}.", "epochs", epochs, 1, LIMITS["epochs"])
        if policy != "stop":
            raise RecipeError(
                f'recipe: {where}.epochs only applies with policy = "stop" ("repeat" cycles forever); '
                'set policy = "stop" or remove epochs'
            )
    on_error = _str(f"{where}.", "on_error", d.get("on_error", "raise"), ON_ERROR)
    max_skipped = d.get("max_skipped")
    max_frac = d.get("max_skipped_fraction")
    if (max_skipped is not None or max_frac is not None) and on_error != "skip":
        raise RecipeError(f'recipe: {where}: max_skipped / max_skipped_fraction only apply with on_error = "skip"')
    if max_skipped is not None:
        max_skipped = _int(f"{where}.", "max_skipped", max_skipped, 0, LIMITS["max_skipped"])
    if max_frac is not None:
        max_frac = _num(f"{where}.", "max_skipped_fraction", max_frac)
        if max_frac > 1:
            raise RecipeError(f"recipe: {where}.max_skipped_fraction is a fraction in [0, 1], got {max_frac}")
    kind = _str(f"{where}.", "kind", d.get("kind", "text"), KINDS)
    if kind == "text":
        if "image_field" in d:
            raise RecipeError(
                f'recipe: {where}.image_field only applies to image datasets; set kind = "image_text" '
                'or "interleaved", or remove image_field'
            )
        fmt_choices: tuple[str, ...] = ("auto", *FORMATS)
        text_default = "text"
    else:
        fmt_choices = ("auto", *MM_FORMATS)
        text_default = "texts" if kind == "interleaved" else "caption"
        if "text_mode" in d:
            raise RecipeError(f'recipe: {where}.text_mode only applies to kind = "text"; remove it')
    image_field = d.get("image_field")
    if image_field is not None:
        image_field = _str(f"{where}.", "image_field", image_field)
    elif kind != "text":
        image_field = "images" if kind == "interleaved" else "image"
    return DatasetSpec(
        name=name,
        path=path,
        kind=kind,
        image_field=image_field,
        format=_str(f"{where}.", "format", d.get("format", "auto"), fmt_choices),
        text_field=_str(f"{where}.", "text_field", d.get("text_field", text_default)),
        text_mode=_str(f"{where}.", "text_mode", d.get("text_mode", "line"), tuple(TEXT_MODES)),
        weight=_num(f"{where}.", "weight", d.get("weight", 1.0), maximum=LIMITS["weight"]),
        policy=policy,
        epochs=epochs,
        on_error=on_error,
        max_skipped=max_skipped,
        max_skipped_fraction=max_frac,
        max_record_bytes=_int(
            f"{where}.",
            "max_record_bytes",
            d.get("max_record_bytes", DEFAULT_MAX_RECORD_BYTES),
            1,
            LIMITS["max_record_bytes"],
        ),
    )


def _pack(pack: Any) -> PackSpec:
    pack = _table("[pack]", pack)
    _check_keys("[pack]", pack, ["algorithm", "flush_every", "max_open"])
    return PackSpec(
        algorithm=_str("[pack].", "algorithm", pack.get("algorithm", "greedy"), ALGORITHMS),
        flush_every=_int("[pack].", "flush_every", pack.get("flush_every", 512), 1, LIMITS["flush_every"]),
        max_open=_int("[pack].", "max_open", pack.get("max_open", 8), 1, LIMITS["max_open"]),
    )


def _shuffle(shuffle: Any) -> ShuffleSpec:
    shuffle = _table("[shuffle]", shuffle)
    _check_keys("[shuffle]", shuffle, ["buffer"])
    return ShuffleSpec(buffer=_int("[shuffle].", "buffer", shuffle.get("buffer", 1024), 1, LIMITS["buffer"]))


def _mixing(mixing: Any, seq_len: int) -> MixingSpec:
    mixing = _table("[mixing]", mixing)
    _check_keys("[mixing]", mixing, ["by", "estimate_samples", "split_tokens"])
    return MixingSpec(
        by=_str("[mixing].", "by", mixing.get("by", "tokens"), MIX_BY),
        estimate_samples=_int(
            "[mixing].", "estimate_samples", mixing.get("estimate_samples", 256), 1, LIMITS["estimate_samples"]
        ),
        # documents estimated longer than this are planned as several parts, so a single huge
        # document cannot skew a lane's mix for long (0 = never split)
        split_tokens=_int(
            "[mixing].", "split_tokens", mixing.get("split_tokens", 4 * (seq_len + 1)), 0, LIMITS["split_tokens"]
        ),
    )


def _workers(r: Mapping[str, Any]) -> WorkersSpec:
    workers = _table("[workers]", r.get("workers", {}))
    _check_keys(
        "[workers]", workers, ["count", "backend", "timeout_s", "start_method", "chunk_size", "prefetch", "shm_mb"]
    )
    shm = workers.get("shm_mb", "auto")
    try:
        default = WorkerConfig(
            count=_int("[workers].", "count", workers.get("count", 0), 0, max_workers()),
            backend=_str("[workers].", "backend", workers.get("backend", "thread"), BACKENDS),
            timeout_s=_num(
                "[workers].", "timeout_s", workers.get("timeout_s", 300.0), positive=True, maximum=LIMITS["timeout_s"]
            ),
            start_method=_str("[workers].", "start_method", workers.get("start_method", "forkserver")),
            shm_mb=None if shm == "auto" else _int("[workers].", "shm_mb", shm, 0),
        )
    except ValueError as e:
        if isinstance(e, RecipeError):
            raise
        raise RecipeError(f"recipe: [workers]: {e}") from None
    prefetch = workers.get("prefetch", "auto")
    tokw = _table("[tokenize]", r.get("tokenize", {}))
    _check_keys("[tokenize]", tokw, ["workers", "backend"])
    tokenize = None
    if tokw:
        tokenize = dataclasses.replace(
            default,
            count=_int("[tokenize].", "workers", tokw.get("workers", default.count), 0, max_workers()),
            backend=_str("[tokenize].", "backend", tokw.get("backend", default.backend), BACKENDS),
        )
    return WorkersSpec(
        default=default,
        chunk_size=_int("[workers].", "chunk_size", workers.get("chunk_size", 32), 1, LIMITS["chunk_size"]),
        prefetch=prefetch if prefetch == "auto" else _int("[workers].", "prefetch", prefetch, 0, LIMITS["prefetch"]),
        tokenize=tokenize,
    )


def _vision_workers(v: Mapping[str, Any], workers: WorkersSpec) -> WorkersSpec:
    sec = "[vision]."
    vision = None
    if "workers" in v or "backend" in v:
        vision = dataclasses.replace(
            workers.default,
            count=_int(sec, "workers", v.get("workers", workers.default.count), 0, max_workers()),
            backend=_str(sec, "backend", v.get("backend", workers.default.backend), BACKENDS),
        )
    return dataclasses.replace(
        workers,
        vision=vision,
        vision_chunk_size=_int(sec, "chunk_size", v.get("chunk_size", 8), 1, LIMITS["vision_chunk_size"]),
    )


def _vision(v: Any) -> VisionSpec:
    """The ``[vision]`` section: image preprocessing, budgets and placeholder tokens."""
    if not isinstance(v, dict):
        raise RecipeError("recipe: [vision] must be a table (patch_size = 16, merge_size = 2, ...)")
    _check_keys("[vision]", v, VISION_KEYS)
    d = VisionConfig()
    sec = "[vision]."
    patch = _int(sec, "patch_size", v.get("patch_size", d.patch_size), 1, LIMITS["patch_size"])
    merge = _int(sec, "merge_size", v.get("merge_size", d.merge_size), 1, LIMITS["merge_size"])
    tps = _int(
        sec,
        "temporal_patch_size",
        v.get("temporal_patch_size", d.temporal_patch_size),
        1,
        LIMITS["temporal_patch_size"],
    )
    min_px = _int(sec, "min_pixels", v.get("min_pixels", d.min_pixels), 1, LIMITS["pixels"])
    max_px = _int(sec, "max_pixels", v.get("max_pixels", d.max_pixels), 1, LIMITS["pixels"])
    factor = patch * merge
    if max_px < factor * factor:
        raise RecipeError(
            f"recipe: [vision].max_pixels = {max_px} is below one merged patch ({factor}x{factor} = "
            f"{factor * factor} pixels for patch_size {patch} x merge_size {merge}); raise max_pixels"
        )
    if min_px > max_px:
        raise RecipeError(f"recipe: [vision].min_pixels = {min_px} is above max_pixels = {max_px}; lower min_pixels")

    def triple(key: str, default: tuple[float, ...], positive: bool) -> tuple[float, float, float]:
        val = v.get(key, list(default))
        if not isinstance(val, list) or len(val) != 3:
            raise RecipeError(f"recipe: [vision].{key} must be a list of 3 numbers (R, G, B), got {val!r}")
        out = []
        for x in val:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or (positive and x <= 0):
                raise RecipeError(
                    f"recipe: [vision].{key} must be 3 finite numbers{' > 0' if positive else ''}, got {val!r}"
                )
            out.append(float(x))
        return (out[0], out[1], out[2])

    config = VisionConfig(
        patch_size=patch,
        temporal_patch_size=tps,
        merge_size=merge,
        min_pixels=min_px,
        max_pixels=max_px,
        mean=triple("mean", d.mean, False),
        std=triple("std", d.std, True),
        max_image_pixels=_int(
            sec, "max_image_pixels", v.get("max_image_pixels", d.max_image_pixels), 1, LIMITS["pixels"]
        ),
        max_images_per_batch=_int(
            sec, "max_images_per_batch", v.get("max_images_per_batch", d.max_images_per_batch), 1, LIMITS["images"]
        ),
        max_images_per_row=_int(
            sec, "max_images_per_row", v.get("max_images_per_row", d.max_images_per_row), 0, LIMITS["images"]
        ),
        mrope=_bool(sec, "mrope", v.get("mrope", d.mrope)),
    )
    tokens = {
        name: _str(sec, f"{name}_token", v.get(f"{name}_token", default))
        for name, default in VisionSpec().tokens.items()
    }
    return VisionSpec(config=config, tokens=tokens)


def _schedule(sched: Any, datasets: Sequence[DatasetSpec]) -> WeightSchedule:
    names = [s.name for s in datasets]
    if not isinstance(sched, list):
        raise RecipeError(
            "recipe: [[schedule]] entries must be an array of tables with step = N and weights = {name = w}"
        )
    phases: list[tuple[int, list[float]]] = [(0, [s.weight for s in datasets])]
    for i, ph in enumerate(sched):
        where = f"[[schedule]] #{i + 1}"
        if not isinstance(ph, dict):
            raise RecipeError(f"recipe: {where} must be a table")
        _check_keys(where, ph, ["step", "weights"])
        step = _int(f"{where}.", "step", ph.get("step"), 1, LIMITS["step"]) if "step" in ph else None
        if step is None or "weights" not in ph or not isinstance(ph["weights"], dict):
            raise RecipeError(f"recipe: {where} needs step = N and weights = {{ {names[0]} = 0.5, ... }}")
        unknown = [k for k in ph["weights"] if k not in names]
        if unknown:
            raise RecipeError(f"recipe: {where}.weights names unknown dataset {unknown[0]!r}; datasets are {names}")
        w = [_num(f"{where}.weights.", n, ph["weights"].get(n, 0.0), maximum=LIMITS["weight"]) for n in names]
        if step <= phases[-1][0]:
            raise RecipeError(
                f"recipe: {where}.step = {step} must be larger than the previous phase's step {phases[-1][0]}"
            )
        phases.append((step, w))
    try:
        return WeightSchedule(phases)
    except ValueError as e:
        raise RecipeError(f"recipe: schedule: {e}") from None
