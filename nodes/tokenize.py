"""Fetch and tokenize: the stateless, parallel half of the text pipeline.

:class:`FetchTokenize` is an elementwise batch function for :class:`zephon.OrderedMapper`: it
turns a chunk of :class:`zephon.worksource.WorkItem` into :class:`TokDoc` s, reading the
records from their shards (grouped per shard) and tokenizing them with one batched call. It is
picklable (datasets and tokenizer travel as small handles) and caches itself per process, so
process workers load the tokenizer once.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from zephon.datasets import BadRecord, DatasetIndex
from zephon.tokenizer import TextTokenizer
from zephon.worksource import WorkItem

__all__ = ["TokDoc", "FetchTokenize", "ON_ERROR"]

ON_ERROR = ("raise", "skip")


class TokDoc(NamedTuple):
    """A tokenized document (BOS/EOS included) or a skipped record (``tokens`` empty)."""

    tokens: np.ndarray
    dataset: int
    item: WorkItem
    skipped: Optional[str] = None  # reason, when the record was bad and the policy is "skip"

    @property
    def provenance(self) -> str:
        return self.item.provenance


_PROCESS_CACHE: Dict[str, "FetchTokenize"] = {}


def _restore(key: str, state: Dict[str, Any]) -> "FetchTokenize":
    obj = _PROCESS_CACHE.get(key)
    if obj is None:
        obj = FetchTokenize.__new__(FetchTokenize)
        obj.__dict__.update(state)
        _PROCESS_CACHE[key] = obj
    return obj


class FetchTokenize:
    """``items -> [TokDoc]``: read records (grouped per shard), tokenize them in one batch.

    ``on_error[d]`` is "raise" (a bad record stops the run with a message naming dataset, file
    and record) or "skip" (the record becomes a counted, deterministic skip).
    """

    def __init__(self, datasets: Sequence[DatasetIndex], tokenizer: TextTokenizer,
                 on_error: Optional[Sequence[str]] = None) -> None:
        self.datasets = list(datasets)
        self.tokenizer = tokenizer
        self.on_error = list(on_error or ["raise"] * len(self.datasets))
        for p in self.on_error:
            if p not in ON_ERROR:
                raise ValueError(f"on_error must be one of {ON_ERROR}, got {p!r}")
        self._key = uuid.uuid4().hex

    def __reduce__(self):
        return (_restore, (self._key, dict(self.__dict__)))

    def fetch(self, items: Sequence[WorkItem]) -> List[Any]:
        """Texts (or BadRecord) of ``items``, in order; one read per (dataset, shard) group."""
        out: List[Any] = [None] * len(items)
        order = sorted(range(len(items)), key=lambda i: (items[i].dataset, items[i].shard))
        for (d, s), group in itertools.groupby(order, key=lambda i: (items[i].dataset, items[i].shard)):
            idx = list(group)
            texts = self.datasets[d].read(s, [items[i].record for i in idx])
            for i, t in zip(idx, texts):
                out[i] = t
        return out

    def __call__(self, items: List[WorkItem]) -> List[TokDoc]:
        texts = self.fetch(items)
        good = [i for i, t in enumerate(texts) if not isinstance(t, BadRecord)]
        out: List[Optional[TokDoc]] = [None] * len(items)
        empty = np.zeros(0, dtype=np.int32)
        for i, t in enumerate(texts):
            if isinstance(t, BadRecord):
                if self.on_error[items[i].dataset] == "raise":
                    raise t.to_error()
                out[i] = TokDoc(empty, items[i].dataset, items[i], f"{t.locator}: {t.reason}")
        if good:
            encoded = self.tokenizer.encode_batch([texts[i] for i in good])
            for i, toks in zip(good, encoded):
                out[i] = TokDoc(toks, items[i].dataset, items[i])
        return out  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"FetchTokenize(datasets={[d.name for d in self.datasets]}, tokenizer={self.tokenizer!r})"
