"""What packed rows are made of, shared by the packers (:class:`Pack`, :class:`MMPack`) and by
everything that reads their output (display, provenance, TorchTitan batches).

``labels`` hold :data:`IGNORE_INDEX` where a target must not be trained on (padding, vision
placeholders, and with ``labels = "document"`` the target of each document's last token, see
:data:`LABELS`). ``provenance`` holds, per row, one :class:`Provenance` per segment: which
record of which dataset the segment's tokens are, and which of that record's tokens; the
segments lie back to back from the row's first token, so :func:`row_spans` gives where each sits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "IGNORE_INDEX",
    "LABELS",
    "PackingMetrics",
    "PartProvenance",
    "Provenance",
    "mask_document_ends",
    "provenance_entry",
    "row_spans",
]

#: the label of a target that is not trained on (PyTorch's cross-entropy default ignore_index)
IGNORE_INDEX = -100

#: where a packed row's targets come from. ``"row"``: the whole row shifted by one, so the last
#: token of a document is trained to predict the first token of the next one (data version 1).
#: ``"document"``: shifted inside each document, as TorchTitan 0.3 does: the target of each
#: document's last token is :data:`IGNORE_INDEX`, so no target crosses a document boundary
#: (the default from data version 2).
LABELS = ("row", "document")


class Provenance(NamedTuple):
    """Where a segment of a row comes from: ``dataset`` / ``shard`` / ``record`` indices and the
    ``epoch`` it was read in (-1 where the source has no record, e.g. a test list), and the
    range ``tok_start:tok_end`` of the record's whole token sequence (BOS and EOS included) that
    the segment holds. A plain tuple of ints: JSON-able, and hashed as data.

    >>> from zephon.nodes import TokDoc, WorkItem
    >>> import numpy as np
    >>> doc = TokDoc(np.arange(9, dtype=np.int32), 0, WorkItem(0, 3, 17, 1, 0), offset=40)
    >>> Provenance.of(doc, 2, 5)
    Provenance(dataset=0, shard=3, record=17, epoch=1, tok_start=42, tok_end=45)
    >>> tuple(Provenance.of(doc, 2, 5))
    (0, 3, 17, 1, 42, 45)
    """

    dataset: int
    shard: int
    record: int
    epoch: int
    tok_start: int
    tok_end: int

    @classmethod
    def of(cls, doc: Any, lo: int, hi: int) -> Provenance | PartProvenance:
        """The provenance of tokens ``lo:hi`` of ``doc`` (a document or sample with ``dataset``,
        an optional ``item`` (:class:`~zephon.nodes.WorkItem`) and ``offset``, the index of its
        first token in the whole record). A part cut from a document's text (``doc.text_part``)
        has a :class:`PartProvenance`."""
        item = getattr(doc, "item", None)
        off = int(getattr(doc, "offset", 0) or 0)
        if item is None:
            return cls(int(doc.dataset), -1, -1, -1, off + int(lo), off + int(hi))
        where = (int(item.dataset), int(item.shard), int(item.record), int(item.epoch), off + int(lo), off + int(hi))
        if getattr(doc, "text_part", False):
            return PartProvenance(*where, int(item.part), int(item.parts))
        return cls(*where)


class PartProvenance(NamedTuple):
    """Where a segment comes from when it is a part of a long document cut from its text
    (``[mixing] split_mode = "text"``): the fields of :class:`Provenance`, with
    ``tok_start:tok_end`` counted in the tokens of part ``part`` of ``parts`` (BOS on the first
    part only, EOS on the last only); :func:`zephon.nodes.part_span` gives the part's text.

    >>> PartProvenance(0, 3, 17, 1, 0, 5, 2, 9)[-2:]
    (2, 9)
    """

    dataset: int
    shard: int
    record: int
    epoch: int
    tok_start: int
    tok_end: int
    part: int
    parts: int


def provenance_entry(entry: Any) -> Provenance | PartProvenance:
    """A batch's provenance entry (6 ints, or 8 for a part cut from the text) as its named tuple.

    >>> provenance_entry([0, 3, 17, 1, 42, 45]).tok_start, provenance_entry([0, 3, 17, 1, 0, 5, 2, 9]).part
    (42, 2)
    """
    vals = [int(v) for v in entry]
    return PartProvenance(*vals) if len(vals) == 8 else Provenance(*vals)


def row_spans(provenance: Iterable[Any]) -> list[tuple[int, int]]:
    """Where each segment of a row sits among the row's ``seq_len + 1`` tokens (the inputs,
    then the last label): ``[start, stop)`` per :class:`Provenance`, in row order.

    Why from the provenance: the packers lay segments back to back from position 0, each as
    long as its token range, so the provenance alone says where they are; ``document_ids``
    covers only the inputs and cannot place a document whose only token is the final label.

    >>> row_spans([(0, 3, 17, 1, 0, 6), (1, 0, 4, 0, 0, 1)])   # the second is the final label
    [(0, 6), (6, 7)]
    """
    out: list[tuple[int, int]] = []
    pos = 0
    for entry in provenance:
        p = provenance_entry(entry)  # 6 ints, or 8 for a part cut from the text
        n = p.tok_end - p.tok_start
        out.append((pos, pos + n))
        pos += n
    return out


def mask_document_ends(labels: np.ndarray, lengths: Sequence[int]) -> None:
    """With ``labels = "document"``: set the target of every segment's last token to
    :data:`IGNORE_INDEX` in one row's ``labels`` (``seq_len`` targets for ``seq_len + 1``
    tokens), given the segments' lengths in row order. A segment ending at the row's end has no
    target in this row. A segment ends inside a row only where its document ends (the packers
    split a document only at a row's end).

    >>> labels = np.array([2, 3, 7, 8, 9, -100, -100])   # tokens 1 2 3 | 7 8 9 | pad
    >>> mask_document_ends(labels, [3, 3]); labels.tolist()
    [2, 3, -100, 8, 9, -100, -100]
    """
    end = 0
    for n in lengths:
        end += int(n)
        if 0 < end <= len(labels):
            labels[end - 1] = IGNORE_INDEX


class PackingMetrics:
    """The packers' observability counters (not part of the data, not in the state): rows
    emitted and padding tokens, and the share of non-padding tokens they give.

    A packer sets ``row_len`` and adds to ``rows_out`` / ``pad_tokens`` as it emits rows."""

    row_len: int
    rows_out: int = 0
    pad_tokens: int = 0

    @property
    def efficiency(self) -> float:
        """Share of non-padding tokens in the rows emitted so far."""
        total = self.rows_out * self.row_len
        return 1.0 - self.pad_tokens / total if total else 1.0

    def extra_metrics(self) -> dict[str, Any]:
        """Rows emitted, padding share and the counters it comes from, for the pipeline metrics."""
        return {
            "rows": self.rows_out,
            "efficiency": round(self.efficiency, 6),
            "pad_tokens": self.pad_tokens,
            "row_tokens": self.rows_out * self.row_len,
        }

    @classmethod
    def summarize_metrics(cls, summed: dict[str, Any]) -> dict[str, Any]:
        """The padding share of many lanes together, from their summed counters."""
        if summed.get("row_tokens"):
            summed["efficiency"] = 1 - summed["pad_tokens"] / summed["row_tokens"]
        return summed
