"""What a recipe is: frozen dataclasses you can read, each key declared once.

Every recipe key is one dataclass field, and its :func:`key` metadata says all the parser
(:mod:`zephon.recipe.parse`) needs: the default (the field's own), the smallest value, the
largest (a name in :data:`~zephon.recipe.keys.LIMITS`), the choices, and a one-line doc. The allowed keys of each
section (:func:`keys`, :data:`TOP_KEYS`, :data:`DATASET_KEYS`, :data:`VISION_KEYS`) are the
fields; an empty section parses to the dataclass defaults. How a key is declared (:func:`key`,
its :class:`~zephon.recipe.keys.Key` and the bounds in :data:`~zephon.recipe.keys.LIMITS`) lives
in :mod:`zephon.recipe.keys`; what the recipe costs in memory in :mod:`zephon.recipe.budget`.

**Adding a key is one line** in its section's dataclass, e.g. in :class:`PackSpec`::

    lookahead: int = key(0, hi="lookahead", doc="rows a packer may look ahead", new=True)

(plus ``"lookahead": N`` in :data:`~zephon.recipe.keys.LIMITS` if it has an upper bound). ``new=True`` keeps the
fingerprints, caches and checkpoints of recipes that leave the key at its default: the key enters
:meth:`RecipeSpec.data_definition` only when set to another value. A ``[vision]`` image setting is
a field of :class:`zephon.nodes.VisionConfig` plus its line in :class:`VisionTable` (the default
is taken from VisionConfig). A rule that relates several keys goes with the other cross-field
rules in :mod:`zephon.recipe.parse`.

    >>> from zephon.recipe.keys import meta
    >>> keys(PackSpec)
    ['algorithm', 'flush_every', 'max_open', 'labels']
    >>> meta(PackSpec, "flush_every").lo, meta(PackSpec, "flush_every").limit(), PackSpec().flush_every
    (1, 1000000, 512)
"""

# key() is dataclasses.field() with metadata; ruff cannot tell, and sees a call in every default
# ruff: noqa: RUF009

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zephon.data.chat import CHAT_FORMATS, LOSS_ON
from zephon.data.datasets import DEFAULT_MAX_RECORD_BYTES, EMPTY, KINDS, SAME_FILE, TEXT_MODES
from zephon.engine import WorkerConfig
from zephon.engine.end import END_MODES
from zephon.engine.workers import BACKENDS
from zephon.nodes import (
    ALGORITHMS,
    DECODE_RULES,
    LABELS,
    LONG,
    ON_ERROR,
    POLICIES,
    SPLIT_MODES,
    BatchSchedule,
    VisionConfig,
    WeightSchedule,
)

from .keys import as_list, field_default, key, keys, max_workers, off_default

__all__ = [
    "CHAT_KIND",
    "COUNT",
    "DATASET_KEYS",
    "DATA_VERSION",
    "MIX_BY",
    "TOP_KEYS",
    "VERSIONED",
    "VISION_KEYS",
    "VISION_TOKENS",
    "DatasetSpec",
    "FilterSpec",
    "ForkSpec",
    "MixingSpec",
    "PackSpec",
    "PhaseTable",
    "RecipeError",
    "RecipeSpec",
    "ShuffleSpec",
    "TokenizeTable",
    "TokenizerSpec",
    "VisionSpec",
    "VisionTable",
    "WorkersSpec",
    "WorkersTable",
    "versioned_default",
]

MIX_BY = ("tokens", "samples")
#: a dataset of conversations (:mod:`zephon.recipe.chat`); the other kinds are zephon.data's KINDS
CHAT_KIND = "chat"
#: which tokens mixing by tokens counts: "all", or "loss" (the tokens trained on)
COUNT = ("all", "loss")

#: The newest data-definition version: a recipe's batches are those of its ``data_version``
#: (default: this one). A zephon change that alters the batches of an existing recipe bumps it
#: and keeps the old behaviour for the old version, so a checkpoint written before the change
#: resumes its own stream with ``data_version = N`` at the top of the recipe (the refusal of a
#: checkpoint from another version says which N). Version 1: every recipe before the versions.
#: Version 2 (each a setting whose version-1 value stays available, see :data:`VERSIONED`): no
#: label crosses a document (``[pack] labels``), a long document's parts are cut from its text
#: (``[mixing] split_mode``), a symlinked file is read once (``same_file``), an empty text is a
#: document (``empty``), images are decoded exactly (``[vision] decode``), and an image-text
#: recipe's default ``[shuffle] buffer`` fits 1 GiB per lane.
#: Version 3: the block shuffle (``[shuffle] block``, :mod:`zephon.nodes.blockorder`): lanes read
#: seeded random blocks of consecutive records from all shards instead of one shard-ordered stripe.
#: Version 4: the tokenizer's identity (a hash of its content, ``TextTokenizer.identity``) is part
#: of the data definition (``tokenizer.identity``), so a fork or resume under another tokenizer is
#: refused naming it.
#: Version 5: token estimation weighs the sampled bad records' planned bytes with no tokens (BOS/EOS
#: scaled by the share of good records), so a dataset whose bad records are skipped still realizes
#: its weight (:func:`zephon.recipe.estimate.estimate_tokens` ``bad_weigh``).
#: Version 6: a chat template's own roles are accepted (Llama 3's ``ipython``; before, a bad record),
#: mixing by trained tokens (``[mixing] count = "loss"``) leaves image tokens out of every
#: image dataset's weight (they are never trained on), and ``[pack] algorithm = "best_fit"`` places
#: a recipe's image samples in the fullest row they fit (first fit before).
DATA_VERSION = 6

#: Settings whose default depends on the data version: ``(section class name, key) -> {first
#: version: value}``, e.g. ``("PackSpec", "labels"): {2: "document"}``. The field's own default is
#: version 1's value, and the field is declared ``new=True``: it enters the data definition only
#: off that value, so version-1 fingerprints stay. A recipe that gives the key keeps its value
#: under every version (the parser fills in the versioned default only for keys not given).
VERSIONED: Mapping[tuple[str, str], Mapping[int, Any]] = {
    # version 2: labels shifted inside each document, no target crosses a document boundary
    ("PackSpec", "labels"): {2: "document"},
    # version 2: a long document's parts are cut from its text, so it is tokenized once
    ("MixingSpec", "split_mode"): {2: "text"},
    ("DatasetSpec", "same_file"): {2: "once"},
    ("DatasetSpec", "empty"): {2: "document"},
    # version 2: images decoded exactly (16-bit kept, transparency composited on `background`)
    ("VisionTable", "decode"): {2: "exact"},
    # version 3: the block shuffle (blocks of 16 records from every shard dealt to the lanes)
    ("ShuffleSpec", "block"): {3: 16},
}


def versioned_default(cls: type, name: str, version: int) -> Any:
    """The default of key ``name`` of section ``cls`` under data version ``version``.

    >>> versioned_default(PackSpec, "flush_every", 1)
    512
    """
    out = field_default(cls, name)
    for first, value in sorted(VERSIONED.get((cls.__name__, name), {}).items()):
        if version >= first:
            out = value
    return out


class RecipeError(ValueError):
    """An invalid recipe; the message names the key and the fix."""


# -- the sections ------------------------------------------------------------------------------
@dataclass(frozen=True)
class DatasetSpec:
    """One ``[[datasets]]`` entry."""

    name: str = key(doc="unique name of the dataset (in logs, metrics, the schedule and checkpoints)")
    path: Any = key(read="globs", doc="glob/fsspec URL or a list of them, made absolute against the recipe's folder")
    format: str = key("auto", doc='"auto" or a format of the kind (jsonl/parquet/text/arrow; wds/parquet for images)')
    text_field: str = key(
        "text", derived='"caption" for kind = "image_text", "texts" for "interleaved"', doc="text column"
    )
    text_mode: str = key("line", choices=tuple(TEXT_MODES), doc='text files: a document per "line" or per "file"')
    weight: float = key(1.0, hi="weight", doc="share of the tokens (or samples) from step 0")
    policy: str = key("repeat", choices=POLICIES, doc='"repeat" cycles forever; "stop" ends after `epochs`')
    epochs: int | None = key(None, lo=1, hi="epochs", doc='passes before a "stop" dataset ends (default 1)')
    on_error: str = key("raise", choices=ON_ERROR, doc='a bad record: "raise", or "skip" it and count it')
    max_skipped: int | None = key(None, hi="max_skipped", doc="skip: run-wide budget, split exactly over the lanes")
    max_skipped_fraction: float | None = key(None, doc="skip: budget as a fraction in [0, 1] of the records")
    max_record_bytes: int = key(
        DEFAULT_MAX_RECORD_BYTES, lo=1, hi="max_record_bytes", new=True, doc="larger records are bad records"
    )
    kind: str = key(
        "text", choices=(*KINDS, CHAT_KIND), doc='"text", "image_text" (one image + caption), "interleaved" or "chat"'
    )
    image_field: str | None = key(
        None,
        derived='"image" for kind = "image_text", "images" for "interleaved" and chat in .tar shards',
        doc="image column (chat: the field or column of a conversation's images; set, its records hold images)",
    )
    same_file: str = key(
        "each",
        choices=SAME_FILE,
        new=True,
        doc='a file reached through several paths (symlinks): read "once" (data version 2) or "each" time (1)',
    )
    empty: str = key(
        "bad",
        choices=EMPTY,
        new=True,
        doc='text datasets: an empty or whitespace-only text is a "document" (BOS/EOS; data version 2) or "bad" (1)',
    )
    dtype: str | None = key(
        None,
        choices=("uint8", "uint16", "int32", "int64"),
        new=True,
        doc='format "tokens": the id width of raw .bin files (they do not state it; .npy and Megatron files do)',
    )
    chat_template: str | None = key(None, new=True, doc='chat: a shipped template ("chatml"...) or a .jinja file')
    chat_format: str = key("messages", choices=CHAT_FORMATS, new=True, doc='chat: "messages" or "sharegpt" records')
    loss_on: str = key("all", choices=LOSS_ON, new=True, doc='chat: train on "all" assistant turns or the "last"')
    long: str = key("drop", choices=LONG, new=True, doc="chat: a conversation longer than a row (drop/truncate/...)")
    system_prompt: str | None = key(None, new=True, doc="chat: a system message put first when a record has none")
    roles: Mapping[str, str] | None = key(
        None,
        read="rule",
        new=True,
        doc='chat: rename the records\' roles before every check, e.g. {"human" = "user", "function_response" = "ipython"}',
    )

    @property
    def has_images(self) -> bool:
        """Whether the dataset's records hold images: an image kind, or a chat dataset that names
        its images (``image_field``; its conversations show them: vision-language chat)."""
        return self.kind not in ("text", CHAT_KIND) or (self.kind == CHAT_KIND and self.image_field is not None)


@dataclass(frozen=True)
class TokenizerSpec:
    """``[tokenizer]``: where the tokenizer is and the loader's BOS/EOS policy."""

    path: str = key(example='"folder with tokenizer.json, or the file itself"', doc="tokenizer.json or its folder")
    add_bos: bool = key(True, doc="start every document with BOS")
    add_eos: bool = key(True, doc="end every document with EOS")
    bos_token: str | None = key(None, doc="the BOS token's text (default: from the tokenizer's config)")
    eos_token: str | None = key(None, doc="the EOS token's text (default: from the tokenizer's config)")
    special_tokens_in_text: bool = key(False, doc='opt-in: text like "<|eos|>" in a document becomes the special token')


@dataclass(frozen=True)
class PackSpec:
    """``[pack]``: how documents become rows (``flush_every`` is part of the data definition)."""

    algorithm: str = key("greedy", choices=ALGORITHMS, doc="how documents are placed into rows")
    flush_every: int = key(
        512,
        lo=1,
        hi="flush_every",
        doc="documents packed between flushes of the open rows (part of the data definition)",
    )
    max_open: int = key(8, lo=1, hi="max_open", doc="rows a first/best-fit packer keeps open")
    labels: str = key(
        "row",
        choices=LABELS,
        new=True,
        doc='"document": no target crosses a document (TorchTitan 0.3); "row": the whole row shifted',
    )


@dataclass(frozen=True)
class ShuffleSpec:
    """``[shuffle]``: rows per shuffle window (1 = no shuffle)."""

    buffer: int = key(
        1024,
        lo=1,
        hi="buffer",
        doc="rows in each lane's shuffle window (1 = no shuffle; image-text, data version 2: what fits 1 GiB)",
    )
    # the block shuffle (zephon.nodes.blockorder): records per block dealt to the lanes
    block: int = key(
        0, hi="block", new=True, doc="records per block of the block shuffle (0 = stripe order, v1-2; v3: 16)"
    )


@dataclass(frozen=True)
class MixingSpec:
    """``[mixing]``: token- or sample-weighted mixing, how tokens per byte are measured, and
    from which estimated length a document is planned as several parts (0 = never)."""

    by: str = key("tokens", choices=MIX_BY, doc="weights are shares of tokens or of samples")
    estimate_samples: int = key(256, lo=1, hi="estimate_samples", doc="records sampled to estimate tokens per byte")
    # documents estimated longer than this are planned as several parts, so a single huge
    # document cannot skew a lane's mix for long (0 = never split)
    split_tokens: int = key(
        0, hi="split_tokens", derived="4 x (seq_len + 1)", doc="longer documents are planned as parts (0 = never)"
    )
    # how the parts are made: "text" cuts the document's text at whitespace and tokenizes each
    # part alone (work and memory proportional to the part, on any lane, worker or rank);
    # "tokens" tokenizes the whole document for every part and cuts token slices (version 1)
    split_mode: str = key(
        "tokens", choices=SPLIT_MODES, new=True, doc='parts cut from the "text" (v2) or from its "tokens" (v1)'
    )
    count: str = key("all", choices=COUNT, new=True, doc='chat datasets\' tokens: "all", or "loss" (trained on)')


@dataclass(frozen=True)
class WorkersTable:
    """The ``[workers]`` table: a :class:`WorkerConfig` (whose defaults these are) plus the size of
    a work chunk and the prefetch depth."""

    count: int = key(field_default(WorkerConfig, "count"), hi=max_workers, doc="workers per pool (0 = inline)")
    backend: str = key(field_default(WorkerConfig, "backend"), choices=BACKENDS, doc='"thread" or "process" workers')
    timeout_s: float = key(
        field_default(WorkerConfig, "timeout_s"), positive=True, hi="timeout_s", doc="wait for one task"
    )
    start_method: str = key(
        field_default(WorkerConfig, "start_method"), doc="multiprocessing start method of process workers"
    )
    chunk_size: int = key(32, lo=1, hi="chunk_size", doc="documents per tokenize task")
    prefetch: int | str = key("auto", auto=True, hi="prefetch", doc='local batches computed ahead ("auto")')
    shm_mb: int | None = key(
        field_default(WorkerConfig, "shm_mb"), auto=True, doc='MiB of shared memory per process worker ("auto")'
    )


@dataclass(frozen=True)
class TokenizeTable:
    """The ``[tokenize]`` table: the tokenize stage's own workers (default: ``[workers]``)."""

    workers: int | None = key(None, hi=max_workers, derived="[workers].count", doc="tokenize workers")
    backend: str | None = key(None, choices=BACKENDS, derived="[workers].backend", doc="tokenize worker kind")


@dataclass(frozen=True)
class VisionTable:
    """The ``[vision]`` table: the :class:`~zephon.nodes.VisionConfig` image settings (whose
    defaults these are), the placeholder tokens' text, and the image stage's workers."""

    patch_size: int = key(field_default(VisionConfig, "patch_size"), lo=1, hi="patch_size", doc="pixels per patch side")
    temporal_patch_size: int = key(
        field_default(VisionConfig, "temporal_patch_size"), lo=1, hi="temporal_patch_size", doc="frames per patch"
    )
    merge_size: int = key(
        field_default(VisionConfig, "merge_size"), lo=1, hi="merge_size", doc="patches merged per token side"
    )
    min_pixels: int = key(field_default(VisionConfig, "min_pixels"), lo=1, hi="pixels", doc="smallest resized image")
    max_pixels: int = key(field_default(VisionConfig, "max_pixels"), lo=1, hi="pixels", doc="largest resized image")
    mean: tuple[float, float, float] = key(
        field_default(VisionConfig, "mean"), read="rgb", doc="per-channel normalization mean"
    )
    std: tuple[float, float, float] = key(
        field_default(VisionConfig, "std"), read="rgb", positive=True, doc="per-channel std"
    )
    max_image_pixels: int = key(
        field_default(VisionConfig, "max_image_pixels"),
        lo=1,
        hi="pixels",
        doc="source images above this are refused before decoding",
    )
    max_images_per_batch: int = key(
        field_default(VisionConfig, "max_images_per_batch"), lo=1, hi="images", doc="images per lane micro-batch"
    )
    max_images_per_row: int = key(
        field_default(VisionConfig, "max_images_per_row"), hi="images", doc="0 = no per-row limit"
    )
    mrope: bool = key(field_default(VisionConfig, "mrope"), doc="3-D (t, h, w) rotary position ids")
    decode: str = key(
        field_default(VisionConfig, "decode"),
        choices=DECODE_RULES,
        new=True,
        doc='"exact": alpha onto background, 16-bit/float scaled (data_version 2); "convert": Pillow RGB (1)',
    )
    background: tuple[float, float, float] = key(
        field_default(VisionConfig, "background"), read="rgb", new=True, doc="RGB in [0, 1] under transparent pixels"
    )
    image_token: str = key("<|image_pad|>", doc="text of an image placeholder token")
    video_token: str = key("<|video_pad|>", doc="text of a video placeholder token")
    vision_start_token: str = key("<|vision_start|>", doc="text of the token before an image")
    vision_end_token: str = key("<|vision_end|>", doc="text of the token after an image")
    workers: int | None = key(None, hi=max_workers, derived="[tokenize] / [workers]", doc="image workers")
    backend: str | None = key(None, choices=BACKENDS, derived="[tokenize] / [workers]", doc="image worker kind")
    chunk_size: int = key(8, lo=1, hi="vision_chunk_size", doc="samples per image task")


#: the placeholder tokens of :class:`VisionSpec`: VisionTable's ``<name>_token`` keys
VISION_TOKENS = tuple(n.removesuffix("_token") for n in keys(VisionTable) if n.endswith("_token"))


@dataclass(frozen=True)
class PhaseTable:
    """One ``[[schedule]]`` entry: from ``step`` on, the datasets' weights are ``weights``."""

    step: int = key(lo=1, hi="step", doc="the first step of the phase")
    weights: Mapping[str, float] = key(read="table", doc="weight of each dataset by name (missing: 0)")


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
    chunk_size: int = field_default(WorkersTable, "chunk_size")
    prefetch: int | str = field_default(WorkersTable, "prefetch")
    tokenize: WorkerConfig | None = None
    vision: WorkerConfig | None = None
    vision_chunk_size: int = field_default(VisionTable, "chunk_size")

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
        default_factory=lambda: {name: field_default(VisionTable, f"{name}_token") for name in VISION_TOKENS}
    )


@dataclass(frozen=True)
class FilterSpec:
    """One ``[[filters]]`` entry, validated (read by :mod:`zephon.recipe.filterspec`); ``code``
    fingerprints a user function's code; ``sees`` is set only off its default (``"raw"``)."""

    name: str
    kind: str
    datasets: tuple[str, ...] | None = None
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    function: str | None = None
    code: str | None = None
    sees: str | None = None

    def definition(self) -> dict[str, Any]:
        """What enters the data definition (and the fingerprint)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ForkSpec:
    """The ``[fork]`` section (read by :mod:`zephon.recipe.filterspec`): the parent recipe's path,
    the fork step, its expected fingerprint."""

    parent: str = key(read="rule", doc="the recipe the run was started with (relative to this file)")
    step: int = key(read="rule", doc="the first global batch made under this recipe (an integer >= 0)")
    fingerprint: str | None = key(
        None, doc="optional: the parent's fingerprint; refused if the parent or its data changed"
    )


@dataclass(frozen=True)
class RecipeSpec:
    """A whole recipe, validated: everything that defines the data, plus performance settings
    (``workers``) that never change it."""

    seed: int = key(hi="seed", doc="the seed of every random choice (mixing, shuffling)")
    lanes: int = key(lo=1, hi="lanes", doc="fixed lane count L: any world size dividing it gets the same batches")
    seq_len: int = key(lo=8, hi="seq_len", doc="tokens per row (rows hold seq_len + 1 for the shifted labels)")
    global_batch_size: int = key(
        lo=1, hi="global_batch_size", derived="global_batch_tokens / seq_len", doc="rows per step, a multiple of lanes"
    )
    tokenizer: TokenizerSpec = key(read="table", doc="the [tokenizer] table")
    datasets: tuple[DatasetSpec, ...] = key(read="table", doc="the [[datasets]] entries")
    schedule: WeightSchedule = key(read="table", derived="the datasets' weights from step 0", doc="[[schedule]]")
    global_batch_tokens: int | None = key(
        None, lo=1, hi="global_batch_tokens", new=True, doc="tokens per step instead of rows (rows = tokens / seq_len)"
    )
    batch_schedule: BatchSchedule | None = key(
        None, read="table", new=True, doc="[[batch_schedule]]: from a step on, another global batch or seq_len"
    )
    pack: PackSpec = key(PackSpec(), read="table", doc="the [pack] table")
    shuffle: ShuffleSpec = key(ShuffleSpec(), read="table", doc="the [shuffle] table")
    mixing: MixingSpec = key(MixingSpec(), read="table", doc="the [mixing] table")
    workers: WorkersSpec = key(WorkersSpec(), read="table", also=("tokenize",), doc="[workers] and [tokenize]")
    vision: VisionSpec = key(VisionSpec(), read="table", doc="the [vision] table")
    cache_dir: str | None = key(None, doc="folder of the index and plan caches, made absolute against the recipe's")
    #: how a finite recipe ends (every dataset ``policy = "stop"``): "pad" or "drop"; None for a
    #: recipe that never ends (it has a "repeat" dataset)
    end: str | None = key(None, choices=END_MODES, derived='"pad" for a finite recipe', doc="how a finite recipe ends")
    memory_gb: float | None = key(
        None,
        positive=True,
        hi="memory_gb",
        doc="GB one rank's lanes may hold, worst case (default $ZEPHON_MEMORY_GB, else 32); never changes the data",
    )
    data_version: int = key(
        DATA_VERSION,
        lo=1,
        hi=lambda: DATA_VERSION,
        doc="the version of zephon's data definition whose batches this recipe makes (default: the newest)",
    )
    #: not in :meth:`data_definition`: :class:`~zephon.recipe.Recipe` adds them (a fork with its parent's fingerprint)
    filters: tuple[FilterSpec, ...] = key((), read="table", doc="the [[filters]] entries")
    fork: ForkSpec | None = key(None, read="table", doc="the [fork] table")

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
    def batch_phases(self) -> list[tuple[int, int, int]]:
        """``(first step, global_batch_size, seq_len)`` per phase (one without a schedule)."""
        if self.batch_schedule is None:
            return [(0, self.global_batch_size, self.seq_len)]
        return [(s, r * self.lanes, n) for s, r, n in self.batch_schedule.phases]

    def rows_per_lane_at(self, step: int) -> int:
        """Rows each lane contributes to ``step`` (the batch-size schedule applied)."""
        return self.rows_per_lane if self.batch_schedule is None else self.batch_schedule.rows_at(step)

    def seq_len_at(self, step: int) -> int:
        """Tokens per row at ``step`` (the sequence-length schedule applied)."""
        return self.seq_len if self.batch_schedule is None else self.batch_schedule.seq_len_at(step)

    @property
    def multimodal(self) -> bool:
        """Whether any dataset has images (image-text lanes, :class:`zephon.nodes.MMPack`)."""
        return any(s.has_images for s in self.datasets)

    def data_definition(self) -> dict[str, Any]:
        """Everything that defines the data (not workers, not the cache folder, not paths: the
        files enter the fingerprint through their own metadata)."""
        datasets = []
        for s in self.datasets:
            d = off_default(DatasetSpec, dataclasses.asdict(s)) | {"path": None}
            if s.kind == "text":
                for k in _MM_ONLY_KEYS:
                    d.pop(k)
            datasets.append(d)
        shuffle = as_list(self.shuffle)
        out = {
            "seed": self.seed,
            "lanes": self.lanes,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "tokenizer": {"add_bos": self.tokenizer.add_bos, "add_eos": self.tokenizer.add_eos},
            "datasets": datasets,
            "pack": as_list(self.pack),
            "shuffle": shuffle[0] if len(shuffle) == 1 else shuffle,  # one key: a number, as it always was
            "mixing": as_list(self.mixing),
            "schedule": self.schedule.phases,
        }
        if self.batch_schedule is not None:  # recipes without one keep their fingerprints
            out["batch_schedule"] = [[s, r * self.lanes, n] for s, r, n in self.batch_schedule.phases]
        if self.multimodal:
            config = off_default(VisionTable, dataclasses.asdict(self.vision.config))
            out["vision"] = config | {"tokens": dict(self.vision.tokens)}
        if self.end is not None:  # finite recipes only: the fingerprints of the others stay
            out["end"] = self.end
        if self.data_version != 1:  # version 1's fingerprints are those of every recipe before versions
            out["data_version"] = self.data_version
        return out


#: keys a text dataset's entry leaves out of the data definition (so text-only fingerprints stay)
_MM_ONLY_KEYS = ("kind", "image_field")


DATASET_KEYS = keys(DatasetSpec)
TOP_KEYS = keys(RecipeSpec)
VISION_KEYS = keys(VisionTable)
