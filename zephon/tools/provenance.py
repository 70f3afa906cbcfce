"""Provenance resolved: each segment of a batch row traced back to its source record and bytes.

A batch's ``provenance`` field holds, per row, one :class:`zephon.nodes.Provenance` per segment
(dataset, shard, record, epoch, token range). :func:`provenance` re-reads each record through
the recipe's indexes and says which file, which line or tar member or Parquet cell, which
characters and bytes, and (multimodal samples) which images those tokens came from. The
worked example is in :mod:`zephon.tools.display`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon.data.datasets import MMRecord, image_header_size
from zephon.nodes import PartProvenance, Provenance, part_span, provenance_entry, row_spans, sample_layout
from zephon.nodes.worksource import WorkItem

from .batch_images import image_blocks, is_multimodal, row_images

__all__ = ["provenance", "segment_positions"]


def segment_positions(row: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Token positions of each segment of a row (in row order), padding excluded."""
    doc = row["document_ids"]
    out = []
    for j in np.unique(doc[doc >= 0]):
        out.append(np.nonzero(doc == j)[0])
    return out


def provenance(recipe: Any, batch: dict[str, Any], row: int) -> list[dict[str, Any]]:
    """Where every segment (document, or image-text sample) of ``batch`` row ``row`` came from,
    so that a surprising sample can be traced back to its source bytes.

    One dict per segment, in row order. Every entry has ``dataset``, ``kind`` (the dataset's:
    "text", "chat", "image_text" or "interleaved"), ``file``, ``locator``, ``shard``, ``record``,
    ``epoch``, ``tokens`` (the range within the document's / sample's tokens, BOS/EOS
    included), ``row_positions`` (where those tokens sit among the row's ``seq_len + 1``
    tokens: the inputs, then the last label, so ``stop`` may be ``seq_len + 1``), ``text`` (the
    text they cover) and ``images`` (empty for text).

    Text documents also have ``chars`` and ``bytes`` (the range of the record's text those
    tokens cover; the bytes are UTF-8 offsets into the text field), ``file_bytes`` (the
    record's byte range in the file, for line formats), ``has_bos`` / ``has_eos``. Re-reading
    the record, tokenizing it and taking ``tokens`` gives back the segment exactly.

    Image-text samples (multimodal batches) have ``key`` (tar shards) or ``row`` (Parquet),
    ``texts`` and ``images``: one dict per caption / text entry and per image of the sample, in
    document order, each with ``segment`` (its place among the record's segments), its source
    (``member`` and ``file_bytes``, the tar member and its byte range in the tar file; or
    ``column``, ``row``, ``list_index`` and ``field`` in a Parquet file, see
    :meth:`zephon.data.datasets.MultimodalIndex.sources`), ``tokens`` and ``row_positions``. A text
    entry adds ``chars``, ``bytes`` (UTF-8 range of the caption the row's tokens cover) and
    ``text``; an image entry adds ``index`` (its index in the batch's ``grid_thw`` and image
    order), ``grid``, ``num_bytes``, ``sha256`` (of the encoded image bytes) and ``width`` /
    ``height`` (the source image's, EXIF orientation applied). Re-reading a cited caption and
    tokenizing it gives back the row's text tokens; re-reading a cited image and preprocessing it
    (:func:`zephon.nodes.images.preprocess_image`) gives back the batch's pixels.

    Conversations (``kind`` "chat") have ``conversation`` (the record's JSON text), ``trained``
    (how many of the row's tokens are targets) and, with images, ``images`` as above; their
    ``text`` is the rendered conversation the tokens spell.

    The module docstring has a worked example (an image-caption tar shard); ``tests/tools/
    test_display.py`` and ``tests/tools/test_display_mm.py`` re-read every cited range of text,
    WebDataset, Parquet and interleaved sources and get the batch back.
    """
    if "provenance" not in batch:
        raise ValueError(
            "this batch has no provenance field: it was not made by zephon's packers "
            "(Pack, MMPack), or the field was dropped"
        )
    p = recipe.prepare()
    prov = batch["provenance"][row]
    blocks: list[dict[str, Any]] = []
    if is_multimodal(batch) and p.special:
        first, grids, _ = row_images(batch, row)
        blocks = image_blocks(batch["input"][row], p.special, grids, first, recipe.vision.patch_size)
    out = []
    # from the provenance, not document_ids: a document whose only token is the final label
    # has no input position, but has its row position
    spans = row_spans(prov)
    for j, entry in enumerate(prov):
        e = provenance_entry(entry)
        rowpos = spans[j]
        kind = recipe.datasets[e.dataset].kind
        if kind == "text":
            out.append(_text_provenance(recipe, p, e, rowpos))
        elif kind == "chat":
            out.append(_chat_provenance(recipe, p, e, rowpos, blocks))
        else:
            out.append(_mm_provenance(recipe, p, kind, e, rowpos, blocks))
    return out


def _chat_provenance(
    recipe: Any, p: Any, e: Provenance | PartProvenance, rowpos: tuple[int, int] | None, blocks: Sequence[dict]
) -> dict[str, Any]:
    """A conversation's provenance: its record (the conversation's JSON text), the rendered text
    of the row's tokens, how many of them are trained on, and each of its images' source (a
    conversation is never split, so the row holds all of it). Encoding the re-read record with
    the recipe's encoder gives back the row's tokens."""
    d, shard, record, epoch, t0, t1 = e[:6]
    ix = p.indexes[d]
    rec = ix.read(shard, [record])[0]
    doc = p.pipeline.encoders[d]([WorkItem(d, shard, record, epoch, 0)], {(d, shard, record): rec})[0]
    if getattr(doc, "skipped", None) or (not hasattr(rec, "segments") and not isinstance(rec, str)):
        raise ValueError(f"record {record} of {ix.shards[shard].path} is no longer readable: {rec}")
    loc = ix.locate(shard, record)
    mask = doc.mask if doc.mask is not None else np.ones(len(doc.tokens), bool)
    out = {"dataset": recipe.datasets[d].name, "kind": "chat", "file": loc["file"], "locator": loc["locator"]}
    out.update({k: loc[k] for k in ("key", "row") if k in loc})
    out |= {
        "record": record,
        "shard": shard,
        "epoch": epoch,
        "tokens": (t0, t1),
        "row_positions": rowpos,
        "text": p.tokenizer.decode(doc.tokens[t0:t1]),
        "trained": int(mask[t0 + 1 : t1].sum()),  # tokens that are targets (the first never is, in a row)
        "conversation": rec.segments[0] if hasattr(rec, "segments") else rec,
        "file_bytes": (loc["byte_offset"], loc["byte_offset"] + loc["byte_length"]) if "byte_offset" in loc else None,
        "images": [],
    }
    if hasattr(rec, "segments") and len(rec.segments) > 1:
        sources = ix.sources(shard, record)
        mine = [b for b in blocks if rowpos is not None and rowpos[0] <= b["start"] < rowpos[1]]
        for j, seg in enumerate(rec.segments[1 : 1 + len(doc.grid_thw)]):
            b = mine[j] if j < len(mine) else None
            where = (b["start"], b["stop"]) if b is not None else None
            info = {k: v for k, v in sources[j + 1].items() if k != "kind"} if j + 1 < len(sources) else {}
            a, z = (where[0] - rowpos[0] + t0, where[1] - rowpos[0] + t0) if where and rowpos else (0, 0)
            out["images"].append(_image_entry(seg, j + 1, info, a, z, b, where))
    return out


def _covered(tok: Any, text: str, k0: int, k1: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(chars, bytes) of ``text`` covered by its content tokens ``k0:k1`` (no BOS/EOS)."""
    offsets = tok.content_offsets(text)
    k0, k1 = max(k0, 0), min(k1, len(offsets))
    if k1 <= k0:
        return (0, 0), (0, 0)
    chars = (offsets[k0][0], offsets[k1 - 1][1])
    b0 = len(text[: chars[0]].encode("utf-8"))
    return chars, (b0, b0 + len(text[chars[0] : chars[1]].encode("utf-8")))


def _text_provenance(
    recipe: Any, p: Any, e: Provenance | PartProvenance, rowpos: tuple[int, int] | None
) -> dict[str, Any]:
    d, shard, record, epoch, t0, t1 = e[:6]
    tok = p.tokenizer
    ix = p.indexes[d]
    text = ix.read(shard, [record])[0]
    if not isinstance(text, str):
        raise ValueError(f"record {record} of {ix.shards[shard].path} is no longer readable: {text}")
    # a part cut from the text: its tokens are the part's own (BOS on the first, EOS on the last)
    part, parts = (e.part, e.parts) if isinstance(e, PartProvenance) else (0, 1)
    c0, c1 = part_span(text, part, parts) if parts > 1 else (0, len(text))
    lead = 1 if tok.add_bos and part == 0 else 0
    n_content = len(tok.encode_content([text[c0:c1]])[0])
    chars, byts = _covered(tok, text[c0:c1], t0 - lead, t1 - lead)
    b0 = len(text[:c0].encode("utf-8")) if c0 else 0
    chars, byts = (chars[0] + c0, chars[1] + c0), (byts[0] + b0, byts[1] + b0)
    loc = ix.locate(shard, record)
    return {
        "dataset": recipe.datasets[d].name,
        "kind": "text",
        "file": loc["file"],
        "locator": loc["locator"],
        "record": record,
        "shard": shard,
        "epoch": epoch,
        "tokens": (t0, t1),
        # (part, parts) of a part cut from the text (tokens count in the part's own), else None
        "part": (part, parts) if isinstance(e, PartProvenance) else None,
        "chars": chars,
        "bytes": byts,
        "row_positions": rowpos,
        "text": text[chars[0] : chars[1]],
        "has_bos": t0 == 0 and bool(lead),
        "has_eos": tok.add_eos and part == parts - 1 and t1 == n_content + lead + 1,
        # the record's own bytes in the (decompressed) file, for line formats: re-read them,
        # parse, tokenize (with BOS/EOS) and take tokens[t0:t1] to get this segment back
        "file_bytes": ((loc["byte_offset"], loc["byte_offset"] + loc["byte_length"]) if "byte_offset" in loc else None),
        "images": [],
    }


def _mm_provenance(
    recipe: Any,
    p: Any,
    kind: str,
    e: Provenance | PartProvenance,
    rowpos: tuple[int, int] | None,
    blocks: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """An image-text sample's provenance: the sample's layout (BOS, text, vision blocks, EOS, as
    :class:`zephon.nodes.FetchVision` builds it) re-derived from the re-read record."""
    d, shard, record, epoch, t0, t1 = e[:6]
    tok = p.tokenizer
    rec, loc, sources = _reread(p.indexes[d], shard, record)
    layout, row_blocks = _layout(recipe, tok, rec, t0, rowpos, blocks)
    texts, images = _entries(tok, rec, sources, layout, row_blocks, t0, t1, rowpos)
    end = layout[-1].stop if layout else 0
    out = {"dataset": recipe.datasets[d].name, "kind": kind, "file": loc["file"], "locator": loc["locator"]}
    out.update({k: loc[k] for k in ("key", "row") if k in loc})
    out.update(
        {
            "record": record,
            "shard": shard,
            "epoch": epoch,
            "tokens": (t0, t1),
            "row_positions": rowpos,
            "text": "".join(t["text"] for t in texts),
            "texts": texts,
            "images": images,
            "has_bos": t0 == 0 and tok.add_bos,
            "has_eos": tok.add_eos and t1 == end,
            "file_bytes": None,
        }
    )
    return out


def _reread(ix: Any, shard: int, record: int) -> tuple[MMRecord, dict[str, Any], list[dict[str, Any]]]:
    """The record read again from its shard, its location, and the source of each of its segments."""
    rec = ix.read(shard, [record])[0]
    if not isinstance(rec, MMRecord):
        raise ValueError(f"record {record} of {ix.shards[shard].path} is no longer readable: {rec}")
    loc = ix.locate(shard, record)
    sources = ix.sources(shard, record)
    if len(sources) != len(rec.segments):
        raise ValueError(f"record {record} of {ix.shards[shard].path}: its sources do not match its segments")
    return rec, loc, sources


def _layout(
    recipe: Any,
    tok: Any,
    rec: MMRecord,
    t0: int,
    rowpos: tuple[int, int] | None,
    blocks: Sequence[dict[str, Any]],
) -> tuple[list[Any], list[dict[str, Any] | None]]:
    """The sample laid out again, by FetchVision's own rule: each caption's tokens, each image's
    block (its size from the row when the row holds it, else from the image's header). Returns
    the layout's spans and, per image, its block in the row (None when the row does not hold it)."""
    # the sample's image blocks in this row (samples with images are never split across rows)
    mine = [b for b in blocks if rowpos is not None and rowpos[0] <= b["start"] < rowpos[1]]
    lengths: list[tuple[str, int]] = []
    row_blocks: list[dict[str, Any] | None] = []
    for seg in rec.segments:
        if isinstance(seg, str):
            lengths.append(("text", len(tok.encode_content([seg])[0])))
            continue
        block = mine[len(row_blocks)] if t0 == 0 and len(row_blocks) < len(mine) else None
        w, h = image_header_size(seg)
        k = (block["stop"] - block["start"]) if block is not None else recipe.vision.image_tokens(w, h) + 2
        lengths.append(("image", k))
        row_blocks.append(block)
    return sample_layout(lengths, bos=tok.add_bos, eos=tok.add_eos), row_blocks


def _entries(
    tok: Any,
    rec: MMRecord,
    sources: Sequence[dict[str, Any]],
    layout: Sequence[Any],
    row_blocks: Sequence[dict[str, Any] | None],
    t0: int,
    t1: int,
    rowpos: tuple[int, int] | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The sample's text and image entries that tokens ``t0:t1`` (this row's part) cover, in
    document order."""
    texts: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = []
    n_img = 0
    for span in layout:
        if span.segment < 0:
            continue
        j, pos, stop = span.segment, span.start, span.stop
        seg, info = rec.segments[j], {k: v for k, v in sources[j].items() if k != "kind"}
        if span.kind == "text":
            a, z = max(pos, t0), min(stop, t1)
            if z > a or (stop == pos and t0 <= pos <= t1):
                texts.append(_text_entry(tok, seg, j, info, pos, a, z, _in_row(rowpos, t0, a, max(a, z))))
            continue
        block = row_blocks[n_img]
        n_img += 1
        if pos < t1 and stop > t0:
            images.append(_image_entry(seg, j, info, pos, stop, block, _in_row(rowpos, t0, pos, stop)))
    return texts, images


def _in_row(rowpos: tuple[int, int] | None, t0: int, a: int, z: int) -> tuple[int, int] | None:
    """The row positions of the sample's tokens ``a:z`` (the sample's token ``t0`` sits at ``rowpos[0]``)."""
    return (rowpos[0] + a - t0, rowpos[0] + z - t0) if rowpos is not None else None


def _text_entry(
    tok: Any, seg: str, j: int, info: dict[str, Any], pos: int, a: int, z: int, where: tuple[int, int] | None
) -> dict[str, Any]:
    """A caption / text entry: its source, the tokens ``a:z`` of it in the row, and the text they cover."""
    chars, byts = _covered(tok, seg, a - pos, z - pos)
    return {
        "segment": j,
        **info,
        "tokens": (a, max(a, z)),
        "row_positions": where,
        "chars": chars,
        "bytes": byts,
        "text": seg[chars[0] : chars[1]],
    }


def _image_entry(
    seg: bytes,
    j: int,
    info: dict[str, Any],
    pos: int,
    stop: int,
    block: dict[str, Any] | None,
    where: tuple[int, int] | None,
) -> dict[str, Any]:
    """An image entry: its source, its block's tokens, its index and grid in the batch (when the
    row holds it), and the encoded image's size and digest."""
    w, h = image_header_size(seg)
    return {
        "segment": j,
        **info,
        "tokens": (pos, stop),
        "row_positions": where,
        "index": None if block is None else block["index"],
        "grid": None if block is None else block["grid"],
        "num_bytes": len(seg),
        "sha256": hashlib.sha256(seg).hexdigest(),
        "width": w,
        "height": h,
    }
