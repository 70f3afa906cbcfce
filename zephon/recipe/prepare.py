"""Preparing a recipe: what must be read or measured before lanes can be built.

:func:`prepare` loads the tokenizer, indexes the datasets, measures tokens per byte from a seeded
sample of each dataset and plans the work (:class:`zephon.nodes.WorkPlan`). The result, a frozen
:class:`Prepared`, is the same on every rank. Its derived values (token estimates) travel in
every checkpoint: :meth:`Prepared.adopt` returns the :class:`Prepared` a resumed run must use, so
a resume never silently re-derives them, and it refuses a checkpoint whose files or tokenizer
changed, naming what changed.

A finite recipe also needs, before its first step, how many micro-batches each lane holds (the
end of the data is a global step boundary, see :class:`zephon.engine.end.LaneEnd`). That count is a
pass over the data; :func:`cached_lane_steps` keeps it on disk next to the dataset indexes,
keyed by the recipe's fingerprint and token estimates, so it is paid once per data definition.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import numpy as np
from tqdm.auto import tqdm

from zephon.data import (
    BYTES_PER_TOKEN,
    BadRecord,
    DatasetIndex,
    ImageTextShardIndex,
    ShardIndex,
    TextTokenizer,
    default_cache_dir,
    index_dataset,
    index_multimodal,
    out_of_vocab,
)
from zephon.engine import IndexPermutation, StateError, stable_u64
from zephon.nodes import (
    DatasetPlan,
    FetchTokenize,
    FetchVision,
    VisionConfig,
    WorkPlan,
    reason_class,
)

from .spec import DatasetSpec, RecipeError, RecipeSpec

__all__ = [
    "BadSamplesWarning",
    "Prepared",
    "TokenEstimate",
    "bad_samples_message",
    "cached_lane_steps",
    "estimate_tokens",
    "fingerprint_of",
    "index_kwargs",
    "lane_steps_key",
    "prepare",
    "record_weights",
    "work_plan",
]

_LOG = logging.getLogger("zephon")


#: bytes of each sampled text that token estimation tokenizes (a longer text is measured on its
#: start and extrapolated): estimation costs at most this per sampled record
ESTIMATE_BYTES = 64 << 10


@dataclass(frozen=True)
class TokenEstimate:
    """Measured tokens per record byte (content) and fixed tokens per record (BOS/EOS), from
    ``sampled`` good records; ``bad`` counts the sampled records that were bad, by reason class,
    with an example reason each (not part of the estimate: a checkpoint stores the first three)."""

    tokens_per_byte: float
    tokens_per_record: float
    sampled: int
    bad: Mapping[str, tuple[int, str]] = field(default_factory=dict, compare=False)


def _estimation_sample(
    index: ShardIndex, *, seed: int, samples: int, ds_number: int
) -> Iterator[tuple[int, list[int]]]:
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


def _head(text: str) -> tuple[str, float]:
    """``text``, or its first :data:`ESTIMATE_BYTES` bytes (whole characters), and the share of
    the text's bytes that is."""
    if len(text) <= ESTIMATE_BYTES // 4:  # at most 4 bytes per character: short for sure
        return text, 1.0
    raw = text.encode("utf-8")
    if len(raw) <= ESTIMATE_BYTES:
        return text, 1.0
    head = raw[:ESTIMATE_BYTES].decode("utf-8", "ignore")
    return head, len(head.encode("utf-8")) / len(raw)


def estimate_tokens(
    index: ShardIndex, tokenizer: TextTokenizer, *, seed: int, samples: int, ds_number: int
) -> TokenEstimate:
    """Tokens per text byte of a dataset, from a seeded sample of its records (text documents,
    or the captions and text entries of image-text samples), tokenized in one call.

    The bytes are the ones the plan weighs a record by: the indexed record size for text, the
    UTF-8 size of the text segments for image-text records (their images are counted exactly
    elsewhere, from the indexed image sizes). A text longer than :data:`ESTIMATE_BYTES` is
    measured on its first :data:`ESTIMATE_BYTES` and extrapolated, so one huge record cannot
    make estimation slow or costly. Bad records are not sampled: they are counted in ``bad``."""
    texts: list[str] = []
    shares: list[float] = []
    nbytes = records = 0
    bad: dict[str, list[Any]] = {}
    for s, local in _estimation_sample(index, seed=seed, samples=samples, ds_number=ds_number):
        sizes = index.record_bytes(s)
        for r, rec in zip(local, index.read(s, local)):
            if isinstance(rec, np.ndarray):  # pretokenized: its ids are checked, its size is exact
                why = out_of_vocab(rec, tokenizer.vocab_size)
                if why is None:
                    records += 1
                    continue
                rec = BadRecord(index.name, "", "", why)
            if isinstance(rec, str):
                segs = [rec]
                nbytes += int(sizes[r])
            elif getattr(rec, "segments", None) is not None:
                segs = [seg for seg in rec.segments if isinstance(seg, str) and seg]
                nbytes += sum(len(seg.encode("utf-8")) for seg in segs)
            else:  # a bad record: not sampled, but counted
                reason = str(getattr(rec, "reason", rec))
                entry = bad.setdefault(reason_class(reason), [0, reason])
                entry[0] += 1
                continue
            for seg in segs:
                head, share = _head(seg)
                texts.append(head)
                shares.append(share)
            records += 1
    per_record = (1 if tokenizer.add_bos else 0) + (1 if tokenizer.add_eos else 0)
    bad_counts = {k: (int(v[0]), str(v[1])) for k, v in bad.items()}
    if getattr(index, "pretokenized", False):  # ids as stored, 4 "bytes" a token: exact, nothing added
        return TokenEstimate(1 / BYTES_PER_TOKEN, 0.0, records, bad_counts)
    if not texts or nbytes == 0:
        return TokenEstimate(1.0, float(per_record), records, bad_counts)
    lengths = [len(ids) for ids in tokenizer.encode_content(texts)]
    content: float = sum(n for n, f in zip(lengths, shares) if f == 1.0)
    if any(f != 1.0 for f in shares):  # the texts measured on their start, extrapolated
        content += sum(n / f for n, f in zip(lengths, shares) if f != 1.0)
    return TokenEstimate(max(content, 1) / nbytes, float(per_record), records, bad_counts)


def _bad_summary(est: TokenEstimate) -> str:
    """The bad records estimation sampled: the most common reason with its count and an
    example, then up to three others."""
    ranked = sorted(est.bad.items(), key=lambda kv: (-kv[1][0], kv[0]))
    top, (n, example) = ranked[0]
    more = f"; also: {', '.join(f'{c} x {k!r}' for k, (c, _) in ranked[1:4])}" if len(ranked) > 1 else ""
    return f"most often ({n} x) {top!r}, e.g. {example!r}{more}"


def _all_bad_error(name: str, est: TokenEstimate, on_error: str) -> RecipeError:
    """Every record token estimation sampled is bad: the dataset cannot deliver (in skip mode it
    would skip forever), so the run fails before it starts, naming the most common reason."""
    total = sum(n for n, _ in est.bad.values())
    return RecipeError(
        f"recipe: dataset {name!r}: all {total} records sampled for token estimation are bad, {_bad_summary(est)}. "
        "The dataset cannot deliver a document"
        + (' (on_error = "skip" would skip its records forever)' if on_error == "skip" else "")
        + ". Fix the data or the dataset's settings (text_field, format, path, max_record_bytes)."
    )


class BadSamplesWarning(UserWarning):
    """Token estimation sampled bad records of a dataset: said before the run starts."""


def bad_samples_message(s: DatasetSpec, est: TokenEstimate) -> str | None:
    """What to say before the run when estimation sampled some bad records of dataset ``s``
    (None when it saw none): counts, the first reasons with an example, and what it does to the
    mix (skipped records deliver no tokens: the dataset's realized share falls below its weight)."""
    bad = sum(n for n, _ in est.bad.values())
    if not bad:
        return None
    seen = bad + est.sampled
    effect = (
        f"about {bad / seen:.0%} of its records will be skipped, and its realized share of the "
        "batches will fall below its declared weight by about as much"
        if s.on_error == "skip"
        else 'with on_error = "raise" the run stops at the first one'
    )
    return (
        f"dataset {s.name!r}: {bad} of {seen} records sampled for token estimation are bad ({bad / seen:.1%}), "
        f"{_bad_summary(est)}; {effect}. Check the data and the dataset's settings (text_field = {s.text_field!r}, "
        f"format, max_record_bytes)."
    )


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


def _image_text_tokens(index: ImageTextShardIndex, est: TokenEstimate, vision: VisionConfig, shard: int) -> np.ndarray:
    """Record weights of an image-text dataset: estimated tokens per record (text bytes x
    tokens/byte + BOS/EOS + each image's placeholder run, exact from its indexed size)."""
    text = index.record_bytes(shard).astype(np.float64) * est.tokens_per_byte + est.tokens_per_record
    n_img, ws, hs = index.image_sizes(shard)
    per_image = np.array([vision.image_tokens(int(w), int(h)) + 2 for w, h in zip(ws, hs)], np.float64)
    owner = np.repeat(np.arange(len(n_img)), n_img)
    img = np.bincount(owner, weights=per_image, minlength=len(n_img)) if per_image.size else np.zeros(len(n_img))
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
    if ds.kind != "text":
        if not isinstance(index, ImageTextShardIndex):
            raise RecipeError(f"recipe: dataset {ds.name!r} is {ds.kind!r} but its index has no image sizes")
        weights = _PerShard(partial(_image_text_tokens, index, est, spec.vision.config))
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
        split_tokens=spec.mixing.split_tokens or None,
        policy=ds.policy,
        epochs=ds.epochs,
    )


def work_plan(spec: RecipeSpec, indexes: Sequence[ShardIndex], estimates: Mapping[str, TokenEstimate]) -> WorkPlan:
    """The run's curriculum from its datasets' metadata and token estimates (no I/O)."""
    plans = [record_weights(spec, s, ix, estimates[s.name]) for s, ix in zip(spec.datasets, indexes)]
    return WorkPlan(
        plans,
        seed=spec.seed,
        lanes=spec.lanes,
        schedule=spec.schedule,
        tokens_per_step=spec.rows_per_lane * spec.seq_len,
    )


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
    fetch: Any  # the mapper's worker function: FetchTokenize, or FetchVision for image-text recipes
    fingerprint: str
    special: Mapping[str, int]  # image placeholder token ids (multimodal recipes)

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
                k: [v.tokens_per_byte, v.tokens_per_record, v.sampled] for k, v in sorted(self.estimates.items())
            },
            "data": {s.name: ix.fingerprint[:16] for s, ix in zip(self.spec.datasets, self.indexes)},
            "tokenizer": self.tokenizer.fingerprint[:16],
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
        unknown = sorted(k for k in shared if k not in ("token_estimates", "data", "tokenizer"))
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
        and len(v) == 3
        and number(v[0], 0.0, 1e6, True)
        and number(v[1], 0.0, 1e6, False)
        and type(v[2]) is int
        and 0 <= v[2] <= 2**53
    )
    if not ok:
        raise StateError(
            f"checkpoint token estimate of dataset {name!r} must be [tokens_per_byte > 0, tokens_per_record >= 0, "
            f"sampled records >= 0], got {v!r}; the checkpoint is corrupt or edited"
        )
    return TokenEstimate(float(v[0]), float(v[1]), int(v[2]))


def index_kwargs(ds: DatasetSpec) -> dict[str, Any]:
    """The keyword arguments that index dataset ``ds`` as its recipe says (the cache folder and
    progress bar aside): :func:`zephon.data.index_dataset`'s for a text dataset,
    :func:`zephon.data.index_multimodal`'s for an image-text one; one place for both."""
    kw: dict[str, Any] = {"format": ds.format, "text_field": ds.text_field, "max_record_bytes": ds.max_record_bytes}
    if ds.same_file != "each":
        kw["same_file"] = ds.same_file
    if ds.kind == "text":
        kw["text_mode"] = ds.text_mode
        if ds.empty != "bad":
            kw["empty"] = ds.empty
    else:
        kw.update(kind=ds.kind, image_field=ds.image_field, on_error=ds.on_error)
    return kw


def _index(spec: RecipeSpec, s: DatasetSpec, progress: bool | None) -> ShardIndex:
    if s.kind == "text":
        return index_dataset(s.name, s.path, cache_dir=spec.cache_dir, progress=progress, **index_kwargs(s))
    return index_multimodal(s.name, s.path, cache_dir=spec.cache_dir, **index_kwargs(s))


def prepare(spec: RecipeSpec, progress: bool | None = None) -> Prepared:
    """Load the tokenizer, index the datasets, estimate tokens and plan the work (I/O)."""
    t = spec.tokenizer
    try:
        tok = TextTokenizer(t.path, t.add_bos, t.add_eos, t.bos_token, t.eos_token, t.special_tokens_in_text)
    except (OSError, ValueError) as e:
        raise RecipeError(f"recipe: [tokenizer]: {e}") from None
    indexes = tuple(_index(spec, s, progress) for s in spec.datasets)
    special = special_ids(spec, tok) if spec.multimodal else {}
    for s, ix in zip(spec.datasets, indexes):
        if ix.num_records == 0:
            raise RecipeError(
                f"recipe: dataset {s.name!r} has no records at {s.path!r}; fix the path or remove the dataset"
            )
    pairs: Any = list(enumerate(zip(spec.datasets, indexes)))
    if progress:
        pairs = tqdm(pairs, desc="token estimation", unit="dataset")
    estimates = {
        s.name: estimate_tokens(ix, tok, seed=spec.seed, samples=spec.mixing.estimate_samples, ds_number=i)
        for i, (s, ix) in pairs
    }
    for s in spec.datasets:
        if estimates[s.name].sampled == 0 and estimates[s.name].bad:
            raise _all_bad_error(s.name, estimates[s.name], s.on_error)
        said = bad_samples_message(s, estimates[s.name])
        if said is not None:
            warnings.warn(said, BadSamplesWarning, stacklevel=2)
    on_error = [s.on_error for s in spec.datasets]
    if spec.multimodal:
        kinds = [s.kind for s in spec.datasets]
        fetch: Any = FetchVision(
            indexes, kinds, tok, spec.vision.config, special, on_error=on_error, row_len=spec.seq_len + 1
        )
    else:
        align = 1 if spec.pack.algorithm == "greedy" else spec.seq_len + 1
        # a recipe without image-text datasets has text indexes only
        fetch = FetchTokenize(
            cast("Sequence[DatasetIndex]", indexes), tok, on_error, align=align, split=spec.mixing.split_mode
        )
    return Prepared(
        spec=spec,
        indexes=indexes,
        tokenizer=tok,
        estimates=estimates,
        plan=work_plan(spec, indexes, estimates),
        fetch=fetch,
        fingerprint=fingerprint_of(spec, indexes, tok),
        special=special,
    )


def fingerprint_of(spec: RecipeSpec, indexes: Sequence[ShardIndex], tok: TextTokenizer) -> str:
    """The recipe fingerprint every checkpoint carries: its data definition, its files (through
    the indexes' fingerprints) and its tokenizer."""
    h = hashlib.sha256()
    h.update(json.dumps(spec.data_definition(), sort_keys=True, default=str).encode())
    for ix in indexes:
        h.update(ix.fingerprint.encode())
    h.update(tok.fingerprint.encode())
    return h.hexdigest()[:32]


#: what a cached lane-count file holds: bump when counting changes (old files are then recounted)
LANE_STEPS_FORMAT = 2


def _zephon_version() -> str:
    try:
        return importlib.metadata.version("zephon")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "unknown"


def lane_steps_key(p: Prepared) -> str:
    """What a finite recipe's per-lane step counts depend on: its fingerprint (data definition,
    files, tokenizer, end mode), the token estimates its plan was made with, its data version
    and the zephon version that counts (another version may pack, hence count, differently)."""
    est = json.dumps(
        {k: [v.tokens_per_byte, v.tokens_per_record, v.sampled] for k, v in sorted(p.estimates.items())},
        sort_keys=True,
    )
    ver = f"{LANE_STEPS_FORMAT}\0{_zephon_version()}\0{p.spec.data_version}"
    return hashlib.sha256(f"{p.fingerprint}\0{est}\0{ver}".encode()).hexdigest()[:32]


def _read_counts(path: str, p: Prepared, key: str) -> list[int] | None:
    """The counts in ``path`` if the file is whole and was written for exactly this recipe,
    data version and zephon version (its own record says so); None otherwise (count again)."""
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
        got = rec.get("lane_steps")
        mine = (rec.get("key"), rec.get("fingerprint"), rec.get("lanes"), rec.get("end"), rec.get("zephon"))
    except (OSError, ValueError, AttributeError):
        return None
    if mine != (key, p.fingerprint, p.spec.lanes, p.spec.end, _zephon_version()):
        return None
    if isinstance(got, list) and len(got) == p.spec.lanes and all(type(n) is int and n >= 0 for n in got):
        return got
    return None


def _write_counts(path: str, record: dict[str, Any]) -> bool:
    """Write ``record`` to ``path`` atomically; False (with a warning, nothing left behind) where
    the folder is full or read-only: the counts are still used, just not kept."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, path)
        return True
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        warnings.warn(
            f"zephon: cannot write the lane step cache {path!r} ({e}); the counts are used but not kept. "
            "Free space there or set ZEPHON_CACHE_DIR to a writable directory.",
            stacklevel=3,
        )
        return False


def cached_lane_steps(p: Prepared, count: Callable[[], Sequence[int]]) -> list[int]:
    """The micro-batches each lane of the finite recipe ``p`` holds: from the cache folder
    (the recipe's ``cache_dir``, else ``$ZEPHON_CACHE_DIR`` / ``~/.cache/zephon/index``) when
    there, else ``count()`` (a dry run of every lane) stored there under a file lock, so that
    the ranks of one node sharing the folder count once and the others wait and read it.

    The count is a pass over the data (read, tokenize, pack: what one epoch of loading costs,
    with the rank's workers); the file is keyed by :func:`lane_steps_key`, so any change of
    the data definition (or of the data or zephon version) counts again; a full or read-only
    folder counts without keeping the result."""
    folder = p.spec.cache_dir or default_cache_dir()
    key = lane_steps_key(p)
    path = os.path.join(folder, f"lane_steps-{key}.json")
    lanes = p.spec.lanes
    got = _read_counts(path, p, key)
    if got is not None:
        return got
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(path + ".lock", "a+")
    except OSError as e:
        warnings.warn(
            f"zephon: cannot write the lane step cache in {folder!r} ({e}); counting without caching. "
            "Set ZEPHON_CACHE_DIR to a writable directory.",
            stacklevel=2,
        )
        return [int(n) for n in count()]
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of a node: one counts, the others wait and read
        try:
            got = _read_counts(path, p, key)
            if got is not None:
                return got
            t0 = time.perf_counter()
            got = [int(n) for n in count()]
            seconds = time.perf_counter() - t0
            record = {
                "key": key,
                "fingerprint": p.fingerprint,
                "lanes": lanes,
                "end": p.spec.end,
                "zephon": _zephon_version(),
                "data_version": p.spec.data_version,
                "lane_steps": got,
                "count_seconds": round(seconds, 3),
            }
            if not _write_counts(path, record):
                return got
            _LOG.info(
                "zephon: counted the micro-batches of the %d lanes of a finite recipe in %.1f s (%d..%d per lane); "
                "cached in %s",
                lanes,
                seconds,
                min(got),
                max(got),
                path,
            )
            return got
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
