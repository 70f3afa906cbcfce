"""Preparing a recipe: what must be read or measured before lanes can be built.

:func:`prepare` loads the tokenizer, indexes the datasets, measures tokens per byte from a seeded
sample of each dataset and plans the work (:class:`zephon.nodes.WorkPlan`). The result, a frozen
:class:`Prepared`, is the same on every rank. Its derived values (token estimates) travel in
every checkpoint: :meth:`Prepared.adopt` returns the :class:`Prepared` a resumed run must use, so
a resume never silently re-derives them, and it refuses a checkpoint whose files or tokenizer
changed, naming what changed.

Token estimation is :mod:`zephon.recipe.estimate`; a finite recipe's per-lane step counts, kept
on disk per data definition, are :mod:`zephon.recipe.lanesteps`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import numpy as np
from tqdm.std import tqdm  # tqdm.auto warns in a notebook kernel without ipywidgets (IProgress)

from zephon.data import (
    ChatRenderer,
    DatasetIndex,
    ImageTextShardIndex,
    ShardIndex,
    TextTokenizer,
    index_dataset,
    index_multimodal,
    token_cache,
)
from zephon.engine import StateError
from zephon.nodes import (
    DatasetPlan,
    FetchTokenize,
    FetchVision,
    RecordPipeline,
    VisionConfig,
    WeightSchedule,
    WorkPlan,
)
from zephon.nodes.vision import MMText, caption
from zephon.nodes.vlchat import MMChat

from .blocks import dataset_block
from .chat import chat_encoder, chat_renderers, estimate_chat, templates_digest, vl_chat_encoder
from .estimate import (
    BadSamplesWarning,
    TokenEstimate,
    all_bad_error,
    bad_samples_message,
    estimate_tokens,
    estimation_sample,
)
from .filters import FilterSpec, filter_rules, filters_definition, filters_fingerprint, prepare_filters
from .spec import CHAT_KIND, DatasetSpec, RecipeError, RecipeSpec

__all__ = [
    "Prepared",
    "fingerprint_of",
    "index_kwargs",
    "prepare",
    "record_pipeline",
    "record_weights",
    "with_tokenizer",
    "work_plan",
]

_LOG = logging.getLogger("zephon")


class _PerShard:
    """A dataset's record weights, computed once per shard by ``fn(shard)`` and kept: the plan
    asks for a shard's weights every time it visits the shard."""

    def __init__(self, fn: Callable[[int], np.ndarray]) -> None:
        self.fn = fn
        self._cache: dict[int, np.ndarray] = {}

    def __call__(self, shard: int) -> np.ndarray:
        a = self._cache.get(shard)
        if a is None:
            a = self._cache[shard] = self.fn(shard)
        return a


def _image_text_tokens(
    index: ImageTextShardIndex, est: TokenEstimate, vision: VisionConfig, shard: int, images: bool = True
) -> np.ndarray:
    """Record weights of a dataset with images: estimated tokens per record (text bytes x
    tokens/byte + BOS/EOS + each image's placeholder run, exact from its indexed size; without
    ``images`` when mixing counts the tokens trained on, which images never are)."""
    text = index.record_bytes(shard).astype(np.float64) * est.tokens_per_byte + est.tokens_per_record
    if not images:
        return np.maximum(1, np.rint(text)).astype(np.int64)
    n_img, ws, hs = index.image_sizes(shard)
    per_image = np.array([vision.image_tokens(int(w), int(h)) + 2 for w, h in zip(ws, hs)], np.float64)
    owner = np.repeat(np.arange(len(n_img)), n_img)
    img: Any = np.bincount(owner, weights=per_image, minlength=len(n_img)) if per_image.size else np.zeros(len(n_img))
    if est.kept != 1.0:  # [[filters]] drop samples: their images deliver no tokens either
        img = img * est.kept
    return np.maximum(1, np.rint(text + img)).astype(np.int64)


def _capped_bytes(index: ShardIndex, limit: int, shard: int) -> np.ndarray:
    """Text record weights where a record above the size limit weighs 1 byte: it reads back as a
    bad record without being read, so it is planned as one part (not as thousands of parts that
    would each be skipped)."""
    raw = index.record_bytes(shard)
    return np.where(raw > limit, 1, raw) if (raw > limit).any() else raw


def _ones(sizes: Sequence[int], shard: int) -> np.ndarray:
    """Record weights for mixing by samples: every record weighs 1."""
    return np.ones(sizes[shard], dtype=np.int64)


def record_weights(spec: RecipeSpec, ds: DatasetSpec, index: ShardIndex, est: TokenEstimate) -> DatasetPlan:
    """How the plan weighs the records of one dataset (one rule for every kind of dataset):

    * text mixed by tokens: each record's byte size, times the measured tokens per byte, plus
      BOS/EOS; long documents are planned as parts of at most ``[mixing].split_tokens``;
    * image-text mixed by tokens: each record's estimated tokens, images counted exactly from
      their indexed sizes; a sample with images is never split;
    * mixing by samples: every record weighs 1.
    """
    sizes = [sh.num_records for sh in index.shards]
    if spec.mixing.by == "samples":
        return DatasetPlan(
            ds.name,
            sizes,
            _PerShard(partial(_ones, sizes)),
            tokens_per_byte=1.0,
            tokens_per_record=0.0,
            policy=ds.policy,
            epochs=ds.epochs,
        )
    if ds.has_images:
        if not isinstance(index, ImageTextShardIndex):
            raise RecipeError(f"recipe: dataset {ds.name!r} is {ds.kind!r} but its index has no image sizes")
        # mixing by trained tokens leaves images out (from data version 6; chat with images is new there)
        images = not (spec.mixing.count == "loss" and (spec.data_version >= 6 or ds.kind == CHAT_KIND))
        weights = _PerShard(partial(_image_text_tokens, index, est, spec.vision.config, images=images))
        return DatasetPlan(
            ds.name, sizes, weights, tokens_per_byte=1.0, tokens_per_record=0.0, policy=ds.policy, epochs=ds.epochs
        )
    limit = ds.max_record_bytes
    big = any(bool((index.record_bytes(s) > limit).any()) for s in range(len(index.shards)))
    return DatasetPlan(
        ds.name,
        sizes,
        _PerShard(partial(_capped_bytes, index, limit)) if big else index.record_bytes,
        tokens_per_byte=est.tokens_per_byte,
        tokens_per_record=est.tokens_per_record,
        split_tokens=(spec.mixing.split_tokens or None) if ds.kind == "text" else None,  # a conversation: whole
        policy=ds.policy,
        epochs=ds.epochs,
    )


def work_plan(spec: RecipeSpec, indexes: Sequence[ShardIndex], estimates: Mapping[str, TokenEstimate]) -> WorkPlan:
    """The run's curriculum from its datasets' metadata and token estimates (no I/O)."""
    plans = [record_weights(spec, s, ix, estimates[s.name]) for s, ix in zip(spec.datasets, indexes)]
    for plan, s, ix in zip(plans, spec.datasets, indexes):
        plan.block = dataset_block(spec, s, ix)
    return WorkPlan(
        plans,
        seed=spec.seed,
        lanes=spec.lanes,
        schedule=_weight_steps(spec),
        tokens_per_step=spec.rows_per_lane * spec.seq_len,
    )


def _weight_steps(spec: RecipeSpec) -> WeightSchedule:
    """The weight schedule as a lane reads it: a lane knows its step from the tokens it drew at
    phase 0's tokens per step, so with a ``[[batch_schedule]]`` a weight phase starts at the
    tokens a lane has consumed by its step, in phase-0 steps."""
    sched = spec.batch_schedule
    if sched is None or len(spec.schedule.phases) == 1:
        return spec.schedule
    base = sched.phases[0][1] * sched.phases[0][2]

    def tokens_at(step: int) -> int:
        ends = [s for s, _, _ in sched.phases[1:]] + [step]
        return sum(max(0, min(end, step) - s) * r * n for (s, r, n), end in zip(sched.phases, ends))

    phases: list[Any] = [(tokens_at(s) / base if s else 0, w) for s, w in spec.schedule.phases]
    return WeightSchedule(phases)  # the steps of phase-0 tokens: not whole numbers


def special_ids(spec: RecipeSpec, tok: TextTokenizer) -> dict[str, int]:
    """Token ids of the image placeholder tokens (``[vision].*_token``), checked."""
    out = {}
    for name, text in spec.vision.tokens.items():
        i = tok.token_to_id(text)
        if i is None:
            raise RecipeError(
                f"recipe: [vision].{name}_token = {text!r} is not a token of the tokenizer at "
                f"{spec.tokenizer.path!r}; add it to the tokenizer as a special token (as Qwen-VL tokenizers have), "
                f"or set [vision].{name}_token to a special token it has"
            )
        out[name] = int(i)
    if len(set(out.values())) != len(out):
        raise RecipeError(f"recipe: [vision] placeholder tokens must be distinct tokens, got ids {out}")
    bad = [n for n, i in out.items() if i in (tok.bos_id, tok.eos_id)]
    if bad:
        raise RecipeError(f"recipe: [vision].{bad[0]}_token is the tokenizer's BOS/EOS token; use a dedicated token")
    return out


@dataclass(frozen=True)
class Prepared:
    """What a recipe needs at run time, read and measured once: the same on every rank."""

    spec: RecipeSpec
    indexes: tuple[ShardIndex, ...]
    tokenizer: TextTokenizer
    estimates: Mapping[str, TokenEstimate]
    plan: WorkPlan
    pipeline: RecordPipeline  # the lane mapper's batch function: read -> [[filters]] -> each kind's encoder
    fingerprint: str
    special: Mapping[str, int]  # image placeholder token ids (multimodal recipes)
    #: a summary of the data definition's optional parts (``[[filters]]``), kept in checkpoints
    #: so a refused resume can name what differs; empty (and absent from checkpoints) without them
    definition: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def text_encoder(self) -> FetchTokenize | None:
        """The encoder of the text datasets of a text recipe (what the token cache and a warm
        job use), None for an image-text recipe or one without text datasets."""
        for e in self.pipeline.encoders:
            if isinstance(e, FetchTokenize):
                return e
        return None

    @property
    def pad_id(self) -> int:
        """The id padding uses: the tokenizer's pad token, else its EOS, else 0 (one rule for
        the packers and the TorchTitan batch)."""
        tok = self.tokenizer
        return tok.pad_id if tok.pad_id is not None else (tok.eos_id or 0)

    def shared_state(self) -> dict[str, Any]:
        """The rank-independent part of a checkpoint: token estimates and the data and
        tokenizer fingerprints (see :meth:`adopt`)."""
        return {
            "token_estimates": {
                k: [v.tokens_per_byte, v.tokens_per_record, v.sampled, *([v.kept] if v.kept != 1.0 else [])]
                for k, v in sorted(self.estimates.items())
            },
            "data": {s.name: ix.fingerprint[:16] for s, ix in zip(self.spec.datasets, self.indexes)},
            "tokenizer": self.tokenizer.fingerprint[:16],
            **({"definition": dict(self.definition)} if self.definition else {}),
        }

    def adopt(self, shared: Mapping[str, Any]) -> Prepared:
        """The :class:`Prepared` a run resumed from a checkpoint with ``shared`` (its
        :meth:`shared_state`) must use: this one, or a copy planned with the checkpoint's token
        estimates. Refuses (naming what changed) a checkpoint whose files or tokenizer differ."""
        data = shared.get("data", {})
        if not isinstance(data, dict):
            raise StateError(f"checkpoint 'shared.data' must be a JSON object, got {type(data).__name__}")
        for s, ix in zip(self.spec.datasets, self.indexes):
            old = data.get(s.name)
            if old is not None and old != ix.fingerprint[:16]:
                raise StateError(
                    f"the files of dataset {s.name!r} changed since the checkpoint was written (a shard was "
                    f"added, removed or modified under {s.path!r}): resuming would feed different data. Restore "
                    "the original files, or start a new run from this data."
                )
        tok = shared.get("tokenizer")
        if tok is not None and tok != self.tokenizer.fingerprint[:16]:
            other = not self.tokenizer.special_tokens_in_text
            hint = ""
            if tok == self.tokenizer.fingerprint_with(other)[:16]:
                hint = (
                    f" It was written with special_tokens_in_text = {str(other).lower()} (zephon parsed special "
                    "tokens in document text before this became an explicit opt-in): set [tokenizer] "
                    f"special_tokens_in_text = {str(other).lower()} in the recipe to resume it."
                )
            raise StateError(
                f"the tokenizer at {self.spec.tokenizer.path!r} (or the BOS/EOS or special-token policy) changed "
                f"since the checkpoint was written; restore it, or start a new run.{hint}"
            )
        # definition / fork: what the recipe's filters and fork were (read by a refusal's explanation)
        unknown = sorted(k for k in shared if k not in ("token_estimates", "data", "tokenizer", "definition", "fork"))
        if unknown:
            raise StateError(f"checkpoint 'shared' has an unknown entry {unknown[0]!r}; it was edited or is foreign")
        raw = shared.get("token_estimates")
        if raw is None:
            return self
        names = sorted(s.name for s in self.spec.datasets)
        if not isinstance(raw, dict) or sorted(raw) != names:
            got = sorted(raw) if isinstance(raw, dict) else raw
            raise StateError(f"checkpoint token estimates are for datasets {got!r}, the recipe has {names}")
        adopted = {k: _estimate_from_state(k, v) for k, v in raw.items()}
        if adopted == dict(self.estimates):
            return self
        return dataclasses.replace(self, estimates=adopted, plan=work_plan(self.spec, self.indexes, adopted))


def _estimate_from_state(name: str, v: Any) -> TokenEstimate:
    """A stored ``[tokens_per_byte, tokens_per_record, sampled]``, range-checked: a bad value would
    re-plan the whole mixture."""

    def number(x: Any, lo: float, hi: float, positive: bool) -> bool:
        ok = type(x) in (int, float) and math.isfinite(x) and lo <= x <= hi
        return ok and (x > 0 or not positive)

    ok = (
        isinstance(v, list)
        and len(v) in (3, 4)
        and number(v[0], 0.0, 1e6, True)
        and number(v[1], 0.0, 1e6, False)
        and type(v[2]) is int
        and 0 <= v[2] <= 2**53
        and (len(v) == 3 or number(v[3], 0.0, 1.0, True))
    )
    if not ok:
        raise StateError(
            f"checkpoint token estimate of dataset {name!r} must be [tokens_per_byte > 0, tokens_per_record >= 0, "
            f"sampled records >= 0] (and the share its filters keep, in (0, 1]), got {v!r}; the checkpoint is "
            "corrupt or edited"
        )
    return TokenEstimate(float(v[0]), float(v[1]), int(v[2]), kept=float(v[3]) if len(v) == 4 else 1.0)


def index_kwargs(ds: DatasetSpec) -> dict[str, Any]:
    """The keyword arguments that index dataset ``ds`` as its recipe says (the cache folder and
    progress bar aside): :func:`zephon.data.index_dataset`'s for a text dataset,
    :func:`zephon.data.index_multimodal`'s for an image-text one; one place for both."""
    kw: dict[str, Any] = {"format": ds.format, "text_field": ds.text_field, "max_record_bytes": ds.max_record_bytes}
    if ds.same_file != "each":
        kw["same_file"] = ds.same_file
    if ds.dtype is not None:
        kw["dtype"] = ds.dtype
    if ds.kind == CHAT_KIND and not ds.has_images:
        kw["text_mode"] = "json"  # the conversation: the field's value as JSON text
    elif ds.kind == "text":
        kw["text_mode"] = ds.text_mode
        if ds.empty != "bad":
            kw["empty"] = ds.empty
    else:
        kw.update(kind=ds.kind, image_field=ds.image_field, on_error=ds.on_error)
    return kw


def _index(spec: RecipeSpec, s: DatasetSpec, progress: bool | None, group: Any = None) -> ShardIndex:
    if not s.has_images:
        kw = index_kwargs(s) if group is None else {**index_kwargs(s), "group": group}
        return index_dataset(s.name, s.path, cache_dir=spec.cache_dir, progress=progress, **kw)
    # which tar members are images: the four classic extensions under data version 1 (a skip
    # recipe keeps skipping the samples it skipped), every one Pillow opens from version 2
    tar_images = "classic" if spec.data_version < 2 else "pillow"
    return index_multimodal(s.name, s.path, cache_dir=spec.cache_dir, tar_images=tar_images, **index_kwargs(s))


def prepare(
    spec: RecipeSpec,
    progress: bool | None = None,
    group: Any = None,
    filters: Sequence[FilterSpec] | None = None,
    fork: tuple[str, int] | None = None,
) -> Prepared:
    """Load the tokenizer, index the datasets, estimate tokens, build the record pipeline and
    plan the work (I/O): the one place a :class:`Prepared` is assembled and its fingerprint made.
    ``group`` (a ``torch.distributed`` process group, or ``"world"``): the ranks index the text
    datasets together, each a slice of the shards (every rank of the group must call it).
    ``filters``: the ``[[filters]]`` (default: the recipe's, ``spec.filters``); ``fork``: a fork's
    parent fingerprint and step (its parent is another recipe: :class:`~zephon.recipe.Recipe` reads it)."""
    filters = spec.filters if filters is None else filters
    t = spec.tokenizer
    try:
        tok = TextTokenizer(t.path, t.add_bos, t.add_eos, t.bos_token, t.eos_token, t.special_tokens_in_text)
    except (OSError, ValueError) as e:
        raise RecipeError(f"recipe: [tokenizer]: {e}") from None
    indexes = tuple(_index(spec, s, progress, group) for s in spec.datasets)
    special = special_ids(spec, tok) if spec.multimodal else {}
    for s, ix in zip(spec.datasets, indexes):
        if ix.num_records == 0:
            raise RecipeError(
                f"recipe: dataset {s.name!r} has no records at {s.path!r}; fix the path or remove the dataset"
            )
    pairs: Any = list(enumerate(zip(spec.datasets, indexes)))
    if progress:
        pairs = tqdm(pairs, desc="token estimation", unit="dataset")
    chat = chat_renderers(spec)
    cache = token_cache()  # the node's token cache: the estimates' samples read from it where it holds them
    estimates = {
        s.name: TokenEstimate(*estimate_chat(spec, i, ix, chat[i], estimation_sample, special, cache))
        if i in chat
        else estimate_tokens(
            ix,
            tok,
            seed=spec.seed,
            samples=spec.mixing.estimate_samples,
            ds_number=i,
            bad_weigh=spec.data_version >= 5,
            cache=cache,
        )
        for i, (s, ix) in pairs
    }
    for s in spec.datasets:
        if estimates[s.name].sampled == 0 and estimates[s.name].bad:
            raise all_bad_error(s.name, estimates[s.name], s.on_error)
        said = bad_samples_message(s, estimates[s.name], weighed=spec.data_version >= 5)
        if said is not None:
            warnings.warn(said, BadSamplesWarning, stacklevel=2)
    pipe = record_pipeline(spec, indexes, tok, special, chat, filters)
    if filters:
        estimates = prepare_filters(pipe, spec, tok, estimates)
    fingerprint = filters_fingerprint(fingerprint_of(spec, indexes, tok, chat), filters)
    if fork is not None:  # the parent's fingerprint and the step define the fork
        fingerprint = hashlib.sha256(f"{fingerprint}\0{fork[0]}\0{fork[1]}".encode()).hexdigest()[:32]
    return Prepared(
        spec=spec,
        indexes=indexes,
        tokenizer=tok,
        estimates=estimates,
        plan=work_plan(spec, indexes, estimates),
        pipeline=pipe,
        fingerprint=fingerprint,
        special=special,
        definition=filters_definition(filters),
    )


def _count_tokens(tok: TextTokenizer, text: str) -> int:
    """Content tokens of ``text`` (no BOS/EOS): what a length rule in ``unit = "tokens"`` counts."""
    return len(tok.encode_content([text])[0])


def record_pipeline(
    spec: RecipeSpec,
    indexes: Sequence[ShardIndex],
    tok: TextTokenizer,
    special: Mapping[str, int],
    chat: Mapping[int, ChatRenderer],
    filters: Sequence[FilterSpec] = (),
) -> RecordPipeline:
    """The recipe's per-record work, built once: its ``[[filters]]`` as rules, and each dataset's
    encoder (text and pretokenized: :class:`FetchTokenize`; chat: :class:`FetchChat`; a recipe
    with images: :func:`_image_encoders`) and the view its rules see it through."""
    on_error = [s.on_error for s in spec.datasets]
    rules = filter_rules(filters, spec)
    kinds = [s.kind for s in spec.datasets]
    encoders: list[Any]
    views: list[Any]
    if spec.multimodal:
        encoders, views = _image_encoders(spec, indexes, tok, special, chat)
    else:
        align = 1 if spec.pack.algorithm == "greedy" else spec.seq_len + 1
        rewritten = [d for d in range(len(kinds)) if any(r.kind == "transform" and r.applies(d) for r in rules)]
        plain = FetchTokenize(
            cast("Sequence[DatasetIndex]", indexes),
            tok,
            on_error,
            align=align,
            split=spec.mixing.split_mode,
            rewritten=rewritten,
        )
        talk = chat_encoder(spec, indexes, chat) if chat else None
        encoders = [talk if d in chat else plain for d in range(len(kinds))]
        views = [talk.view(d) if talk is not None and d in chat else None for d in range(len(kinds))]
    return RecordPipeline(
        indexes, encoders, rules, views=views, count_tokens=partial(_count_tokens, tok), on_error=on_error
    )


def _image_encoders(
    spec: RecipeSpec,
    indexes: Sequence[ShardIndex],
    tok: TextTokenizer,
    special: Mapping[str, int],
    chat: Mapping[int, ChatRenderer],
) -> tuple[list[Any], list[Any]]:
    """The encoders of a recipe with images, one packer for all (:class:`MMDoc` s): image-text
    samples (:class:`FetchVision`), text (:class:`MMText`), text chat (:class:`MMChat`) and
    conversations with images (:class:`~zephon.nodes.FetchVisionChat`); and each one's view."""
    on_error = [s.on_error for s in spec.datasets]
    kinds = [s.kind for s in spec.datasets]
    vision = FetchVision(
        indexes, kinds, tok, spec.vision.config, dict(special), on_error=on_error, row_len=spec.seq_len + 1
    )
    # a recipe's text indexes are DatasetIndex (image-text ones have their own reader)
    text = MMText(FetchTokenize(cast("Sequence[DatasetIndex]", indexes), tok, on_error, align=spec.seq_len + 1))
    talk = MMChat(chat_encoder(spec, indexes, chat))
    seen = vl_chat_encoder(spec, indexes, chat, special)
    encoders: list[Any] = []
    views: list[Any] = []
    for d, s in enumerate(spec.datasets):
        if s.kind == CHAT_KIND:
            enc: Any = seen if s.has_images else talk
            encoders.append(enc)
            views.append(enc.view(d))
        else:
            encoders.append(text if s.kind == "text" else vision)
            views.append(None if s.kind == "text" else caption)
    return encoders, views


def with_tokenizer(definition: dict[str, Any], tok: TextTokenizer) -> dict[str, Any]:
    """A data definition with the tokenizer's identity from data version 4 (the definitions of
    versions 1-3 hold only its BOS/EOS settings, so their fingerprints stay)."""
    if definition.get("data_version", 1) < 4:
        return definition
    return definition | {"tokenizer": {**definition["tokenizer"], "identity": tok.identity}}


def fingerprint_of(
    spec: RecipeSpec, indexes: Sequence[ShardIndex], tok: TextTokenizer, chat: Mapping[int, ChatRenderer] | None = None
) -> str:
    """The recipe fingerprint every checkpoint carries: its data definition, its files (through
    the indexes' fingerprints) and its tokenizer (and its chat templates: ``chat``, the
    renderers when built already)."""
    h = hashlib.sha256()
    h.update(json.dumps(with_tokenizer(spec.data_definition(), tok), sort_keys=True, default=str).encode())
    for ix in indexes:
        h.update(ix.fingerprint.encode())
    h.update(tok.fingerprint.encode())
    h.update(templates_digest(spec, chat).encode())  # chat templates ("" without chat datasets)
    return h.hexdigest()[:32]
