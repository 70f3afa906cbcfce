"""Packing image-text samples into micro-batches under a token and an image budget.

:class:`MMPack` consumes :class:`zephon.nodes.MMDoc` s (samples with images, or text documents)
and emits whole lane micro-batches of ``rows`` rows of ``seq_len + 1`` tokens. A sample is
never split across rows (a text document longer than a row is first cut into row-sized
pieces; a sample with images never is: the mapper already cut or skipped over-long ones). It
goes to the first row of the open micro-batch where its tokens fit and where the micro-batch
stays within ``max_images_per_batch`` images (and the row within ``max_images_per_row``);
when none fits, the micro-batch is emitted (remaining space padded) and the sample opens the
next one. The micro-batch also flushes every ``flush_every`` samples (flush and replay: the
state is the upstream cursor at the last flush point plus outputs since).

A micro-batch (numpy)::

    input, labels, positions    int64 [rows, seq_len]   (labels -100 on vision tokens and padding,
                                and with labels="document" on each sample's last token)
    document_ids int32, dataset int16 [rows, seq_len]
    mrope_positions             int64 [rows, seq_len, 3] (with mrope)
    pixel_values                float32 [patches, patch_dim]: the images' patches, in token order
    grid_thw                    int64 [images, 3]
    images_per_row              int64 [rows]
    provenance                  list (per row) of tuples (per sample, in row order) of
                                (dataset, shard, record, epoch, tok_start, tok_end)

``provenance`` has the text packer's format: ``tok_start:tok_end`` is the sample's token range
within its whole token sequence (BOS, text, vision blocks, EOS), so the cited record, re-read
and laid out again, gives back the row's tokens; :func:`zephon.tools.display.provenance` resolves it
to files, tar members / Parquet rows, byte ranges and image indices. It holds plain Python ints
(JSON-able) and is data like any other field (hashed by :func:`zephon.batch_sha256`).

Concatenating micro-batches along axis 0 (lane order) keeps every field consistent (the
``provenance`` lists concatenate), so the router's merge of lanes needs no special case.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from zephon.engine import Accumulator

from .rows import IGNORE_INDEX, LABELS, PackingMetrics, PartProvenance, Provenance, mask_document_ends

__all__ = ["PLACEMENTS", "MMPack", "mm_pad_batch"]

#: how a sample picks its row of the open micro-batch: the first it fits, or the fullest it fits
PLACEMENTS = ("first_fit", "best_fit")


def _blank(rows: int, row_len: int, pad_id: int, mrope: bool) -> dict[str, Any]:
    """The arrays of a micro-batch whose rows are all padding (``row_len`` = seq_len + 1)."""
    B, L = rows, row_len
    out: dict[str, Any] = {
        "tokens": np.full((B, L), pad_id, dtype=np.int64),
        "positions": np.zeros((B, L), dtype=np.int64),
        "doc_ids": np.full((B, L), -1, dtype=np.int32),
        "dataset": np.full((B, L), -1, dtype=np.int16),
        "labels": np.full((B, L - 1), IGNORE_INDEX, dtype=np.int64),
        "per_row": np.zeros(B, dtype=np.int64),
        # padding counts up like one more document (as TorchTitan's builder does)
        "mrope": np.broadcast_to(np.arange(L, dtype=np.int64)[None, :, None], (B, L, 3)).copy() if mrope else None,
    }
    return out


def _micro_batch(a: dict[str, Any], pixels: Any, grids: Any, prov: list, patch_dim: int) -> dict[str, Any]:
    out = {
        "input": a["tokens"][:, :-1],
        "labels": a["labels"],
        "positions": a["positions"][:, :-1],
        "document_ids": a["doc_ids"][:, :-1],
        "dataset": a["dataset"][:, :-1],
        "pixel_values": np.concatenate(pixels) if pixels else np.zeros((0, patch_dim), np.float32),
        "grid_thw": np.concatenate(grids) if grids else np.zeros((0, 3), np.int64),
        "images_per_row": a["per_row"],
        "provenance": prov,
    }
    if a["mrope"] is not None:
        out["mrope_positions"] = a["mrope"][:, :-1]
    return out


def mm_pad_batch(*, rows: int, seq_len: int, patch_dim: int, pad_id: int = 0, mrope: bool = True) -> dict[str, Any]:
    """A micro-batch of padding rows with the fields, dtypes and padding rules of
    :class:`MMPack`'s micro-batches (no images, labels -100, no provenance): what an ended lane
    of a finite recipe with ``end = "pad"`` delivers.

    >>> b = mm_pad_batch(rows=2, seq_len=4, patch_dim=12)
    >>> b["labels"].tolist()[0], b["pixel_values"].shape, b["grid_thw"].shape, b["provenance"]
    ([-100, -100, -100, -100], (0, 12), (0, 3), [(), ()])
    """
    a = _blank(rows, seq_len + 1, pad_id, mrope)
    return _micro_batch(a, [], [], [() for _ in range(rows)], patch_dim)


class MMPack(PackingMetrics, Accumulator):
    """Pack samples into micro-batches of ``rows`` rows under token and image budgets.

    Why whole micro-batches rather than rows: the image budget (``max_images_per_batch``) is
    per micro-batch, so the packer must see all rows of one at once. Samples are never split
    (the row stays a valid attention context for its images); text documents are.
    ``labels="document"``: no target crosses a sample boundary (see :class:`zephon.nodes.Pack`).

    >>> import numpy as np
    >>> from zephon.nodes import MMDoc
    >>> from zephon.engine.testing import ListSource
    >>> docs = [MMDoc(np.arange(1, 6, dtype=np.int32), 0, None), MMDoc(np.arange(1, 4, dtype=np.int32), 1, None)]
    >>> b = next(MMPack(ListSource(docs), seq_len=8, rows=1, patch_dim=12, max_images_per_batch=2, mrope=False))
    >>> b["input"].tolist(), b["labels"].tolist()
    ([[1, 2, 3, 4, 5, 1, 2, 3]], [[2, 3, 4, 5, 1, 2, 3, -100]])
    >>> [tuple(map(tuple, row)) for row in b["provenance"]]   # a Provenance per sample
    [((0, -1, -1, -1, 0, 5), (1, -1, -1, -1, 0, 3))]
    >>> b["provenance"][0][1].tok_end
    3
    """

    node_type = "mm_pack"

    def __init__(
        self,
        source: BaseNode,
        *,
        seq_len: int,
        rows: int,
        patch_dim: int,
        max_images_per_batch: int,
        max_images_per_row: int = 0,
        flush_every: int = 512,
        pad_id: int = 0,
        ignore_ids: Sequence[int] = (),
        mrope: bool = True,
        max_doc_tokens: int | None = None,
        labels: str = "row",
        placement: str = "first_fit",
    ) -> None:
        super().__init__(source, flush_every=flush_every)
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.placement = placement
        if labels not in LABELS:
            raise ValueError(f"pack.labels must be one of {LABELS}, got {labels!r}")
        self.labels = labels
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len must be an integer >= 2, got {seq_len!r}")
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be a positive integer, got {rows!r}")
        if max_images_per_batch < 1:
            raise ValueError(f"max_images_per_batch must be >= 1, got {max_images_per_batch}")
        self.seq_len, self.rows, self.patch_dim = seq_len, rows, patch_dim
        self.row_len = seq_len + 1
        self.max_images_per_batch, self.max_images_per_row = max_images_per_batch, max_images_per_row
        self.pad_id, self.mrope = pad_id, mrope
        self.max_doc_tokens = max_doc_tokens  # bounds a restored 'since' (None: unknown)
        self.ignore_ids = np.asarray(sorted({int(i) for i in ignore_ids}), dtype=np.int64)
        self.clear()
        # observability (not part of the data)
        self.rows_out = 0
        self.pad_tokens = 0
        self.images_out = 0
        #: samples cut to fit a row (the text after their last image), by dataset, and the tokens cut
        self.truncated: dict[int, int] = {}
        self.truncated_tokens = 0

    def _repr_args(self):
        yield f"seq_len={self.seq_len}"
        yield f"rows={self.rows}"
        yield f"max_images_per_batch={self.max_images_per_batch}"
        yield f"flush_every={self.flush_every}"
        if self.labels != "row":
            yield f"labels={self.labels}"
        if self.placement != "first_fit":
            yield f"placement={self.placement}"

    def extra_metrics(self) -> dict[str, Any]:
        """The packing counters, the images emitted, and the samples the mapper cut to fit a row
        (``truncated``: by dataset number; ``truncated_tokens``: the tokens they lost). Counted
        as the samples are packed, since this process started or resumed (not in the state)."""
        return {
            **super().extra_metrics(),
            "images": self.images_out,
            "truncated": dict(self.truncated),
            "truncated_tokens": self.truncated_tokens,
        }

    # -- accumulator hooks ------------------------------------------------------------------
    def max_since(self) -> int | None:
        """Micro-batches one flush interval can emit: each of its documents is placed as at most
        ``ceil(max_doc_tokens / row_len)`` pieces, each of which may close two micro-batches (the one it
        does not fit, and the one it fills), and the flush closes one more (None without
        ``max_doc_tokens``)."""
        if self.max_doc_tokens is None or self.flush_every is None:
            return None
        pieces = -(-max(self.max_doc_tokens, 1) // self.row_len)
        return self.flush_every * (2 * pieces + 1) + 1

    def clear(self) -> None:
        self._segs: list[list[Any]] = [[] for _ in range(self.rows)]
        self._used = [0] * self.rows
        self._row_images = [0] * self.rows
        self._images = 0

    def buffer_empty(self) -> bool:
        return not any(self._used)

    def accept(self, doc: Any) -> None:
        if getattr(doc, "skipped", None):
            return
        tokens = doc.tokens
        n = len(tokens)
        if n == 0:
            return
        k = doc.num_images if hasattr(doc, "num_images") else 0
        cut = getattr(doc, "truncated", 0)
        if cut:
            self.truncated[doc.dataset] = self.truncated.get(doc.dataset, 0) + 1
            self.truncated_tokens += int(cut)
        if k == 0:
            for start in range(0, n, self.row_len):
                self._place(doc, start, min(n, start + self.row_len), 0)
        else:
            if n > self.row_len or k > self.max_images_per_batch:
                raise ValueError(
                    f"MMPack: a sample with images must fit a row and the image budget "
                    f"({n} tokens, {k} images; {doc.provenance}); the mapper should have cut or skipped it"
                )
            self._place(doc, 0, n, k)

    def flush(self) -> None:
        if any(self._used):
            self._emit()
        self.clear()

    # -- placement --------------------------------------------------------------------------
    def _fits(self, r: int, n: int, k: int) -> bool:
        if self._used[r] + n > self.row_len:
            return False
        if k and self._images + k > self.max_images_per_batch:
            return False
        return not (k and self.max_images_per_row and self._row_images[r] + k > self.max_images_per_row)

    def _place(self, doc: Any, lo: int, hi: int, k: int) -> None:
        n = hi - lo
        fits = [r for r in range(self.rows) if self._fits(r, n, k)]
        if self.placement == "best_fit":  # the fullest row it fits (ties: the first)
            fits.sort(key=lambda r: self.row_len - self._used[r])
        target = fits[0] if fits else None
        if target is None:
            self._emit()
            self.clear()
            target = 0
        self._segs[target].append((doc, lo, hi))
        self._used[target] += n
        self._row_images[target] += k
        self._images += k
        if all(u == self.row_len for u in self._used):
            self._emit()
            self.clear()

    # -- output -----------------------------------------------------------------------------
    def _trained(self, r: int, used: int) -> np.ndarray | None:
        """Row ``r``'s tokens that are targets (a chat document's ``mask``; every token of the
        others), or None when no document of the row has a mask."""
        segs = self._segs[r]
        if all(getattr(doc, "mask", None) is None for doc, _, _ in segs):
            return None
        out = np.ones(used, dtype=bool)
        pos = 0
        for doc, lo, hi in segs:
            m = getattr(doc, "mask", None)
            if m is not None:
                out[pos : pos + hi - lo] = m[lo:hi]
            pos += hi - lo
        return out

    def _emit(self) -> None:
        B, L = self.rows, self.row_len
        a = _blank(B, L, self.pad_id, self.mrope)
        tokens, positions, doc_ids, dataset = a["tokens"], a["positions"], a["doc_ids"], a["dataset"]
        mrope, per_row, labels = a["mrope"], a["per_row"], a["labels"]
        pixels: list[np.ndarray] = []
        grids: list[np.ndarray] = []
        prov: list[tuple[Provenance | PartProvenance, ...]] = []
        for r in range(B):
            pos = 0
            prov.append(tuple(Provenance.of(doc, lo, hi) for doc, lo, hi in self._segs[r]))
            for j, (doc, lo, hi) in enumerate(self._segs[r]):
                k = hi - lo
                tokens[r, pos : pos + k] = doc.tokens[lo:hi]
                positions[r, pos : pos + k] = np.arange(k)
                doc_ids[r, pos : pos + k] = j
                dataset[r, pos : pos + k] = doc.dataset
                if mrope is not None:
                    m = getattr(doc, "mrope", None)
                    mrope[r, pos : pos + k] = m[lo:hi] if m is not None else np.arange(k)[:, None]
                g = getattr(doc, "grid_thw", None)
                if g is not None and len(g):
                    pixels.append(doc.pixel_values)
                    grids.append(g)
                    per_row[r] += len(g)
                pos += k
            used = self._used[r]
            if (
                mrope is not None and used < L
            ):  # padding counts up like one more document (as TorchTitan's builder does)
                mrope[r, used:] = np.arange(L - used)[:, None]
            if used > 1:
                lab = tokens[r, 1:used].copy()
                if self.ignore_ids.size:
                    lab[np.isin(lab, self.ignore_ids)] = IGNORE_INDEX
                trained = self._trained(r, used)
                if trained is not None:  # chat: only the assistant tokens are targets
                    lab[~trained[1:]] = IGNORE_INDEX
                labels[r, : used - 1] = lab
            if self.labels == "document":  # no target crosses a sample boundary
                mask_document_ends(labels[r], [hi - lo for _, lo, hi in self._segs[r]])
            self.pad_tokens += L - used
        self.rows_out += self.rows
        self.images_out += int(per_row.sum())
        self.emit(_micro_batch(a, pixels, grids, prov, self.patch_dim))
