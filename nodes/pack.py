"""Packing tokenized documents into training rows of ``seq_len + 1`` tokens.

Each row gives ``input`` (tokens 0..seq_len-1), ``labels`` (tokens 1..seq_len, ``-100`` where
the target is padding, and with ``labels="document"`` where it would be the next document's
first token), ``positions`` (restarting at 0 at every document segment, for RoPE and
document masks), ``document_ids`` (segment index within the row, ``-1`` on padding: usable for
varlen / document-masked attention) and ``dataset`` (dataset index per token, ``-1`` on
padding).

Algorithms: ``greedy`` concatenates documents and splits them across rows (no padding except
at flush points); ``first_fit`` / ``best_fit`` never split a document (one longer than a row is
first cut into row-sized pieces, never dropped) and keep up to ``max_open`` partially filled
rows, padding what is left when a row is closed. All flush every ``flush_every`` documents,
which bounds replay on restore.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from zephon.engine import Accumulator

from .batch import stack_rows
from .rows import IGNORE_INDEX, LABELS, PackingMetrics, PartProvenance, Provenance, mask_document_ends

__all__ = ["ALGORITHMS", "Pack", "pad_row", "pad_rows"]

#: packing algorithms: ``greedy`` splits documents across rows; the two others never split one
ALGORITHMS = ("greedy", "first_fit", "best_fit")

Segment = tuple[np.ndarray, int, Provenance | PartProvenance]  # tokens, dataset, provenance


def pad_row(seq_len: int, pad_id: int = 0) -> dict[str, Any]:
    """A row of padding only, with the fields and dtypes of :class:`Pack`'s rows: ``pad_id``
    inputs, ``-100`` labels (nothing is trained or evaluated on it), positions 0,
    ``document_ids`` and ``dataset`` -1, no provenance. What a finite recipe with ``end = "pad"``
    fills short micro-batches and ended lanes with.

    >>> row = pad_row(4, pad_id=9)
    >>> row["input"].tolist(), row["labels"].tolist(), row["document_ids"].dtype.name, row["provenance"]
    ([9, 9, 9, 9], [-100, -100, -100, -100], 'int32', ())
    """
    return {
        "input": np.full(seq_len, pad_id, dtype=np.int64),
        "labels": np.full(seq_len, IGNORE_INDEX, dtype=np.int64),
        "positions": np.zeros(seq_len, dtype=np.int64),
        "document_ids": np.full(seq_len, -1, dtype=np.int32),
        "dataset": np.full(seq_len, -1, dtype=np.int16),
        "provenance": (),
    }


def pad_rows(rows: int, seq_len: int, pad_id: int = 0) -> dict[str, Any]:
    """A lane micro-batch of ``rows`` padding rows (:func:`pad_row`), as :class:`Batch` stacks
    them: what an ended lane of a finite recipe with ``end = "pad"`` delivers.

    >>> b = pad_rows(2, 4)
    >>> b["input"].shape, b["dataset"].dtype.name, b["provenance"]
    ((2, 4), 'int16', [(), ()])
    """
    return stack_rows([pad_row(seq_len, pad_id)] * rows)


class Pack(PackingMetrics, Accumulator):
    """Pack documents (objects with ``tokens`` and ``dataset``) into rows of ``seq_len + 1`` tokens.

    ``labels`` (see :data:`zephon.nodes.rows.LABELS`): ``"row"`` shifts the whole row, so a
    document's last token predicts the next document's first; ``"document"`` shifts inside each
    document (that target is -100), as TorchTitan 0.3 does.

    >>> import numpy as np
    >>> from zephon.nodes import TokDoc, WorkItem
    >>> from zephon.engine.testing import ListSource
    >>> docs = [TokDoc(np.array(t, dtype=np.int32), 0, WorkItem(0, 0, i, 0, 0)) for i, t in enumerate([[1, 2, 3], [7, 8, 9, 4]])]
    >>> [next(Pack(ListSource(docs), seq_len=6, labels=mode))["labels"].tolist() for mode in ("row", "document")]
    [[2, 3, 7, 8, 9, 4], [2, 3, -100, 8, 9, 4]]
    """

    node_type = "pack"

    def __init__(
        self,
        source: BaseNode,
        *,
        seq_len: int,
        algorithm: str = "greedy",
        flush_every: int = 512,
        pad_id: int = 0,
        max_open: int = 8,
        max_doc_tokens: int | None = None,
        labels: str = "row",
    ) -> None:
        super().__init__(source, flush_every=flush_every)
        if labels not in LABELS:
            raise ValueError(f"pack.labels must be one of {LABELS}, got {labels!r}")
        self.labels = labels
        if algorithm not in ALGORITHMS:
            raise ValueError(f"pack.algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len must be an integer >= 2, got {seq_len!r}")
        if max_open < 1:
            raise ValueError(f"pack.max_open must be >= 1, got {max_open}")
        self.seq_len, self.algorithm, self.pad_id, self.max_open = seq_len, algorithm, pad_id, max_open
        self.row_len = seq_len + 1
        # the most tokens one document can have (None: unknown): bounds a restored 'since'
        self.max_doc_tokens = max_doc_tokens
        self._arange = np.arange(self.row_len, dtype=np.int64)
        self._bins: list[list[Segment]] = []
        self._used: list[int] = []
        # observability (not part of the data): counters since construction
        self.tokens_in = 0
        self.rows_out = 0
        self.pad_tokens = 0

    def _repr_args(self):
        yield f"seq_len={self.seq_len}"
        yield self.algorithm
        yield f"flush_every={self.flush_every}"
        if self.labels != "row":
            yield f"labels={self.labels}"

    # -- accumulator hooks ------------------------------------------------------------------
    def max_since(self) -> int | None:
        """Rows one flush interval can emit: each of its ``flush_every`` documents is cut into at
        most ``ceil(max_doc_tokens / row_len)`` pieces and each placement closes at most two
        rows; the flush closes at most ``max_open`` more (None without ``max_doc_tokens``)."""
        if self.max_doc_tokens is None or self.flush_every is None:
            return None
        pieces = -(-self.max_doc_tokens // self.row_len)
        return self.flush_every * (2 * pieces + 2) + self.max_open

    def clear(self) -> None:
        self._bins, self._used = [], []

    def buffer_empty(self) -> bool:
        return not self._bins

    def accept(self, doc: Any) -> None:
        tokens = doc.tokens
        n = len(tokens)
        if n == 0:
            return
        self.tokens_in += n
        if self.algorithm == "greedy":
            self._accept_greedy(doc)
            return
        for start in range(0, n, self.row_len):
            piece = tokens[start : start + self.row_len]
            self._place(piece, doc.dataset, Provenance.of(doc, start, start + len(piece)))

    def flush(self) -> None:
        bins, used = self._bins, self._used
        self._bins, self._used = [], []
        for segs, u in zip(bins, used):
            if u:
                self._emit_row(segs, u)

    # -- algorithms -------------------------------------------------------------------------
    def _accept_greedy(self, doc: Any) -> None:
        tokens, dataset = doc.tokens, doc.dataset
        if not self._bins:
            self._bins, self._used = [[]], [0]
        pos = 0
        n = len(tokens)
        while pos < n:
            room = self.row_len - self._used[0]
            take = min(room, n - pos)
            self._bins[0].append((tokens[pos : pos + take], dataset, Provenance.of(doc, pos, pos + take)))
            self._used[0] += take
            pos += take
            if self._used[0] == self.row_len:
                self._emit_row(self._bins[0], self.row_len)
                self._bins, self._used = ([[]], [0]) if pos < n else ([], [])

    def _place(self, piece: np.ndarray, dataset: int, prov: Provenance | PartProvenance) -> None:
        n = len(piece)
        target = -1
        if self.algorithm == "first_fit":
            for i, u in enumerate(self._used):
                if self.row_len - u >= n:
                    target = i
                    break
        else:
            best_room = self.row_len + 1
            for i, u in enumerate(self._used):
                room = self.row_len - u
                if n <= room < best_room:
                    target, best_room = i, room
        if target < 0:
            if len(self._bins) >= self.max_open:
                fullest = max(range(len(self._used)), key=lambda i: (self._used[i], -i))
                self._emit_row(self._bins.pop(fullest), self._used.pop(fullest))
            self._bins.append([])
            self._used.append(0)
            target = len(self._bins) - 1
        self._bins[target].append((piece, dataset, prov))
        self._used[target] += n
        if self._used[target] == self.row_len:
            self._emit_row(self._bins.pop(target), self._used.pop(target))

    # -- rows -------------------------------------------------------------------------------
    def _emit_row(self, segments: list[Segment], used: int) -> None:
        L = self.row_len
        tokens = np.empty(L, dtype=np.int64)
        positions = np.empty(L, dtype=np.int64)
        doc_ids = np.empty(L, dtype=np.int32)
        dataset = np.empty(L, dtype=np.int16)
        arange = self._arange
        pos = 0
        for j, (seg, ds, _) in enumerate(segments):
            k = len(seg)
            tokens[pos : pos + k] = seg
            positions[pos : pos + k] = arange[:k]
            doc_ids[pos : pos + k] = j
            dataset[pos : pos + k] = ds
            pos += k
        if pos < L:  # padding
            tokens[pos:] = self.pad_id
            positions[pos:] = 0
            doc_ids[pos:] = -1
            dataset[pos:] = -1
        labels = tokens[1:].copy()
        labels[used - 1 :] = IGNORE_INDEX  # targets that are padding
        if self.labels == "document":  # no target crosses a document boundary
            mask_document_ends(labels, [len(seg) for seg, _, _ in segments])
        self.rows_out += 1
        self.pad_tokens += L - used
        self.emit(
            {
                "input": tokens[:-1],
                "labels": labels,
                "positions": positions[:-1],
                "document_ids": doc_ids[:-1],
                "dataset": dataset[:-1],
                "provenance": tuple(prov for _, _, prov in segments),
            }
        )
