"""Token estimation: tokens per byte of each dataset, measured on a seeded sample of its records
before the run, so the plan can weigh records by tokens without tokenizing the corpus. The same
sample on every rank and run; bad sampled records are counted and said before the run starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zephon.data import BadRecord, ShardIndex, TextTokenizer
from zephon.data.datasets import BYTES_PER_TOKEN, out_of_vocab
from zephon.data.datasets.tokencache import TokenCache
from zephon.engine import IndexPermutation
from zephon.engine.seeding import stable_u64
from zephon.nodes import reason_class
from zephon.nodes.tokencached import cached_entries

from .spec import DatasetSpec, RecipeError

__all__ = [
    "ESTIMATE_BYTES",
    "BadSamplesWarning",
    "TokenEstimate",
    "all_bad_error",
    "bad_samples_message",
    "estimate_tokens",
    "estimation_sample",
    "planned_bytes",
]


#: bytes of each sampled text that token estimation tokenizes (a longer text is measured on its
#: start and extrapolated): estimation costs at most this per sampled record
ESTIMATE_BYTES = 64 << 10


@dataclass(frozen=True)
class TokenEstimate:
    """Measured tokens per record byte (content) and fixed tokens per record (BOS/EOS), from
    ``sampled`` good records; ``bad`` counts the sampled records that were bad, by reason class,
    with an example reason each (not part of the estimate: a checkpoint stores the first three).
    ``kept``: the share of an image-text dataset's sampled samples its ``[[filters]]`` keep (its
    image tokens, counted exactly from the index, are planned at that share; 1.0 otherwise)."""

    tokens_per_byte: float
    tokens_per_record: float
    sampled: int
    bad: Mapping[str, tuple[int, str]] = field(default_factory=dict, compare=False)
    kept: float = 1.0


def estimation_sample(index: ShardIndex, *, seed: int, samples: int, ds_number: int) -> Iterator[tuple[int, list[int]]]:
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


def planned_bytes(index: ShardIndex, size: int) -> int:
    """The bytes the plan weighs a record of ``size`` indexed bytes by: its size, or 1 above the
    index's ``max_record_bytes`` (such a record reads back as bad without being read; see
    :func:`zephon.recipe.prepare.record_weights`)."""
    return 1 if size > index.max_record_bytes else size


def estimate_tokens(
    index: ShardIndex,
    tokenizer: TextTokenizer,
    *,
    seed: int,
    samples: int,
    ds_number: int,
    bad_weigh: bool = False,
    cache: TokenCache | None = None,
) -> TokenEstimate:
    """Tokens per text byte of a dataset, from a seeded sample of its records (text documents,
    or the captions and text entries of image-text samples), tokenized in one call.

    The bytes are the ones the plan weighs a record by: the indexed record size for text, the
    UTF-8 size of the text segments for image-text records (their images are counted exactly
    elsewhere, from the indexed image sizes). A text longer than :data:`ESTIMATE_BYTES` is
    measured on its first :data:`ESTIMATE_BYTES` and extrapolated, so one huge record cannot
    make estimation slow or costly. Bad records are counted in ``bad``; with ``bad_weigh`` (data
    version 5) they also weigh their planned bytes with no tokens, and BOS/EOS are scaled by the
    share of good records: a bad record skipped under ``on_error = "skip"`` uses the weight the
    plan gave it and delivers nothing, so the tokens per byte the plan uses are the ones the
    dataset delivers (before version 5 they were measured on the good records alone, and a
    dataset with bad records realized less than its weight). ``cache``: the node's token cache,
    whose whole-record entries give the sampled records' lengths without tokenizing them again
    (the same ids: the estimate is unchanged)."""
    texts: list[str] = []
    shares: list[float] = []
    where: list[tuple[int, int] | None] = []  # (shard, record) of a whole text the cache may hold
    nbytes = records = bad_bytes = id_bytes = 0
    bad: dict[str, list[Any]] = {}
    for s, local in estimation_sample(index, seed=seed, samples=samples, ds_number=ds_number):
        sizes = index.record_bytes(s)
        for r, rec in zip(local, index.read(s, local)):
            if isinstance(rec, np.ndarray):  # pretokenized: its ids are checked, its size is exact
                why = out_of_vocab(rec, tokenizer.vocab_size)
                if why is None:
                    records += 1
                    id_bytes += int(sizes[r])
                    continue
                rec = BadRecord(index.name, "", "", why)
            if isinstance(rec, str):
                segs = [rec]
                nbytes += int(sizes[r])
            elif getattr(rec, "segments", None) is not None:
                segs = [seg for seg in rec.segments if isinstance(seg, str) and seg]
                nbytes += sum(len(seg.encode("utf-8")) for seg in segs)
            else:  # a bad record: counted, and under bad_weigh its planned bytes weigh no tokens
                reason = str(getattr(rec, "reason", rec))
                entry = bad.setdefault(reason_class(reason), [0, reason])
                entry[0] += 1
                bad_bytes += planned_bytes(index, int(sizes[r]))
                continue
            for seg in segs:
                head, share = _head(seg)
                texts.append(head)
                shares.append(share)
                where.append((s, r) if isinstance(rec, str) and share == 1.0 else None)
            records += 1
    per_record = (1 if tokenizer.add_bos else 0) + (1 if tokenizer.add_eos else 0)
    bad_counts = {k: (int(v[0]), str(v[1])) for k, v in bad.items()}
    nbad = sum(v[0] for v in bad_counts.values())
    kept = records / (records + nbad) if bad_weigh and records + nbad else 1.0
    if getattr(index, "pretokenized", False):  # ids as stored, 4 "bytes" a token: exact, nothing added
        good = id_bytes / (id_bytes + bad_bytes) if bad_weigh and id_bytes else 1.0
        return TokenEstimate(good / BYTES_PER_TOKEN, 0.0, records, bad_counts)
    if not texts or nbytes == 0:
        return TokenEstimate(1.0, float(per_record), records, bad_counts)
    lengths = _lengths(index, tokenizer, cache, texts, where)
    content: float = sum(n for n, f in zip(lengths, shares) if f == 1.0)
    if any(f != 1.0 for f in shares):  # the texts measured on their start, extrapolated
        content += sum(n / f for n, f in zip(lengths, shares) if f != 1.0)
    if bad_weigh:
        nbytes += bad_bytes
    return TokenEstimate(max(content, 1) / nbytes, per_record * kept, records, bad_counts)


def _lengths(
    index: ShardIndex,
    tokenizer: TextTokenizer,
    cache: TokenCache | None,
    texts: list[str],
    where: list[tuple[int, int] | None],
) -> list[int]:
    """The content tokens of each of ``texts``: a whole record's from its token cache entry (its
    ids less BOS/EOS), the others tokenized in one call."""
    known: dict[int, int] = {}
    if cache is not None:
        settings = TokenCache.settings_key(tokenizer.fingerprint)
        per_record = (1 if tokenizer.add_bos else 0) + (1 if tokenizer.add_eos else 0)
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for j, w in enumerate(where):
            if w is not None:
                by_shard.setdefault(w[0], []).append((j, w[1]))
        for s, jr in by_shard.items():
            got = cached_entries(cache, settings, index, s, [r for _, r in jr])
            known |= {j: len(got[r].tokens) - per_record for j, r in jr if r in got and not got[r].text_part}
    todo = [j for j in range(len(texts)) if j not in known]
    lengths = [known.get(j, 0) for j in range(len(texts))]
    for j, ids in zip(todo, tokenizer.encode_content([texts[j] for j in todo]) if todo else ()):
        lengths[j] = len(ids)
    return lengths


def _bad_summary(est: TokenEstimate) -> str:
    """The bad records estimation sampled: the most common reason with its count and an
    example, then up to three others."""
    ranked = sorted(est.bad.items(), key=lambda kv: (-kv[1][0], kv[0]))
    top, (n, example) = ranked[0]
    more = f"; also: {', '.join(f'{c} x {k!r}' for k, (c, _) in ranked[1:4])}" if len(ranked) > 1 else ""
    return f"most often ({n} x) {top!r}, e.g. {example!r}{more}"


def all_bad_error(name: str, est: TokenEstimate, on_error: str) -> RecipeError:
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


def bad_samples_message(s: DatasetSpec, est: TokenEstimate, weighed: bool = False) -> str | None:
    """What to say before the run when estimation sampled some bad records of dataset ``s``
    (None when it saw none): counts, the first reasons with an example, and what it does to the
    mix (skipped records deliver no tokens: before data version 5 the dataset's realized share
    falls below its weight; ``weighed``, from version 5, the estimate plans for them)."""
    bad = sum(n for n, _ in est.bad.values())
    if not bad:
        return None
    seen = bad + est.sampled
    if s.on_error != "skip":
        effect = 'with on_error = "raise" the run stops at the first one'
    elif weighed:
        effect = (
            f"about {bad / seen:.0%} of its records will be skipped; the token estimate counts them (data "
            "version 5), so the plan draws more of its records and its realized share of the batches stays "
            "near its declared weight"
        )
    else:
        effect = (
            f"about {bad / seen:.0%} of its records will be skipped, and its realized share of the batches "
            "will fall below its declared weight by about as much (data version 5 plans for the skips)"
        )
    return (
        f"dataset {s.name!r}: {bad} of {seen} records sampled for token estimation are bad ({bad / seen:.1%}), "
        f"{_bad_summary(est)}; {effect}. Check the data and the dataset's settings (text_field = {s.text_field!r}, "
        f"format, max_record_bytes)."
    )
