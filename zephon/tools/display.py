"""Seeing batches: decoded rows with document boundaries, padding and masked labels, images as
thumbnails beside their placeholder tokens (multimodal batches), provenance back to the source
record, and the plan of a pipeline. Plain-text ``repr`` everywhere, HTML in Jupyter
(``_repr_html_``).

A small image-caption dataset (a WebDataset tar), one batch, a row, and one sample of it traced
back to the bytes of its image in the tar file:

    >>> import hashlib, os, tempfile
    >>> from tokenizers import AddedToken, Tokenizer
    >>> from zephon.recipe import Recipe
    >>> from zephon.tools.demo import TOKENIZER_DIR
    >>> from zephon.tools.synth import generate_image_text, write_wds
    >>> root = tempfile.mkdtemp()
    >>> tok = Tokenizer.from_file(os.path.join(TOKENIZER_DIR, "tokenizer.json"))  # + Qwen-VL's placeholders
    >>> tok.add_special_tokens([AddedToken(t, special=True) for t in
    ...                         ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")])
    4
    >>> tok.save(os.path.join(root, "tokenizer.json"))
    >>> _ = write_wds(os.path.join(root, "pairs", "pairs-0000.tar"), generate_image_text(8, seed=0))
    >>> recipe = Recipe.from_dict({
    ...     "seed": 0, "lanes": 1, "seq_len": 64, "global_batch_size": 2, "cache_dir": "cache",
    ...     "tokenizer": {"path": root}, "shuffle": {"buffer": 1},
    ...     "datasets": [{"name": "pairs", "kind": "image_text", "path": "pairs/*.tar"}],
    ...     "vision": {"min_pixels": 1024, "max_pixels": 4096}}, base_dir=root)
    >>> with recipe.global_loader(1) as g:
    ...     batch = next(g)
    >>> view = show(batch, recipe)
    >>> print(repr(view).splitlines()[1][:96])
    row 0 (100% tokens, 2 images): [pairs:39] <|bos|>[image 0: 32x64, 2 tokens]Being zoatou have suc
    >>> batch["provenance"][0][0]   # one zephon.nodes.Provenance per sample of the row
    Provenance(dataset=0, shard=0, record=4, epoch=0, tok_start=0, tok_end=39)
    >>> sample = view.provenance(0)[0]
    >>> sample["locator"], sample["tokens"], sample["texts"][0]["member"]
    ("key '00000004'", (0, 39), '00000004.txt')
    >>> image = sample["images"][0]
    >>> image["index"], image["member"], image["row_positions"]   # image 0 of the batch, its tokens
    (0, '00000004.webp', (1, 5))
    >>> with open(sample["file"], "rb") as f:          # the cited bytes, read from the tar itself
    ...     _ = f.seek(image["file_bytes"][0])
    ...     data = f.read(image["file_bytes"][1] - image["file_bytes"][0])
    >>> hashlib.sha256(data).hexdigest() == image["sha256"]
    True
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon.data import MMRecord, image_header_size
from zephon.engine import LaneContext, lanes_of_rank, valid_world_sizes
from zephon.nodes import (
    IGNORE_INDEX,
    PartProvenance,
    Provenance,
    VisionConfig,
    part_span,
    provenance_entry,
    sample_layout,
)

__all__ = [
    "MM_BATCH_FIELDS",
    "PALETTE",
    "BatchView",
    "Explanation",
    "denormalize",
    "describe_plan",
    "explain",
    "format_batch_rows",
    "format_row",
    "image_blocks",
    "image_label",
    "is_multimodal",
    "png_base64",
    "provenance",
    "row_images",
    "row_pieces",
    "show",
    "thumbnail_size",
    "unpatchify",
]

PALETTE = ["#dbeafe", "#dcfce7", "#fef3c7", "#fce7f3", "#ede9fe", "#cffafe", "#fee2e2", "#e5e7eb"]


def _segments(row: dict[str, np.ndarray]) -> list[np.ndarray]:
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
    "text", "image_text" or "interleaved"), ``file``, ``locator``, ``shard``, ``record``,
    ``epoch``, ``tokens`` (the range within the document's / sample's tokens, BOS/EOS
    included), ``row_positions`` (where those tokens sit among the row's ``seq_len + 1``
    tokens: the inputs, then the last label, so ``stop`` may be ``seq_len + 1``), ``text`` (the
    text they cover) and ``images`` (empty for text).

    Text documents also have ``chars`` and ``bytes`` (the range of the record's text those
    tokens cover; the bytes are UTF-8 offsets into the text field), ``file_bytes`` (the
    record's byte range in the file, for line formats), ``has_bos`` / ``has_eos``. Re-reading
    the record, tokenizing it and taking ``tokens`` gives back the segment exactly. A part of a
    long document cut from its text (``[mixing] split_mode = "text"``) has ``part`` = ``(part,
    parts)`` (else None): its ``tokens`` count in that part's own tokens
    (:func:`zephon.nodes.part_span` gives its text; BOS on the first part, EOS on the last).

    Image-text samples (multimodal batches) have ``key`` (tar shards) or ``row`` (Parquet),
    ``texts`` and ``images``: one dict per caption / text entry and per image of the sample, in
    document order, each with ``segment`` (its place among the record's segments), its source
    (``member`` and ``file_bytes``, the tar member and its byte range in the tar file; or
    ``column``, ``row``, ``list_index`` and ``field`` in a Parquet file, see
    :meth:`zephon.datasets.MultimodalIndex.sources`), ``tokens`` and ``row_positions``. A text
    entry adds ``chars``, ``bytes`` (UTF-8 range of the caption the row's tokens cover) and
    ``text``; an image entry adds ``index`` (its index in the batch's ``grid_thw`` and image
    order), ``grid``, ``num_bytes``, ``sha256`` (of the encoded image bytes) and ``width`` /
    ``height`` (the source image's, EXIF orientation applied). Re-reading a cited caption and
    tokenizing it gives back the row's text tokens; re-reading a cited image and preprocessing it
    (:func:`zephon.nodes.vision.preprocess_image`) gives back the batch's pixels.

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
    segs = _segments({"document_ids": batch["document_ids"][row]})
    blocks: list[dict[str, Any]] = []
    if is_multimodal(batch) and p.special:
        first, grids, _ = row_images(batch, row)
        blocks = image_blocks(batch["input"][row], p.special, grids, first, recipe.vision.patch_size)
    out = []
    for j, entry in enumerate(prov):
        e = provenance_entry(entry)
        rowpos = (int(segs[j][0]), int(segs[j][0]) + e.tok_end - e.tok_start) if j < len(segs) else None
        kind = recipe.datasets[e.dataset].kind
        if kind == "text":
            out.append(_text_provenance(recipe, p, e, rowpos))
        else:
            out.append(_mm_provenance(recipe, p, kind, e, rowpos, blocks))
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
    ix = p.indexes[d]
    rec = ix.read(shard, [record])[0]
    if not isinstance(rec, MMRecord):
        raise ValueError(f"record {record} of {ix.shards[shard].path} is no longer readable: {rec}")
    loc = ix.locate(shard, record)
    sources = ix.sources(shard, record)
    if len(sources) != len(rec.segments):
        raise ValueError(f"record {record} of {ix.shards[shard].path}: its sources do not match its segments")
    row0 = rowpos[0] if rowpos is not None else None
    # the sample's image blocks in this row (samples with images are never split across rows)
    mine = [b for b in blocks if rowpos is not None and rowpos[0] <= b["start"] < rowpos[1]]
    # the sample laid out again, by FetchVision's own rule: each caption's tokens, each image's
    # block (its size from the row when the row holds it, else from the image's header)
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
    layout = sample_layout(lengths, bos=tok.add_bos, eos=tok.add_eos)
    texts: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = []

    def where(a: int, z: int) -> tuple[int, int] | None:
        return (row0 + a - t0, row0 + z - t0) if row0 is not None else None

    n_img = 0
    for span in layout:
        if span.segment < 0:
            continue
        j, pos, stop = span.segment, span.start, span.stop
        seg, info = rec.segments[j], {k: v for k, v in sources[j].items() if k != "kind"}
        if span.kind == "text":
            a, z = max(pos, t0), min(stop, t1)
            if z > a or (stop == pos and t0 <= pos <= t1):
                chars, byts = _covered(tok, seg, a - pos, z - pos)
                texts.append(
                    {
                        "segment": j,
                        **info,
                        "tokens": (a, max(a, z)),
                        "row_positions": where(a, max(a, z)),
                        "chars": chars,
                        "bytes": byts,
                        "text": seg[chars[0] : chars[1]],
                    }
                )
            continue
        block = row_blocks[n_img]
        n_img += 1
        if pos < t1 and stop > t0:
            w, h = image_header_size(seg)
            images.append(
                {
                    "segment": j,
                    **info,
                    "tokens": (pos, stop),
                    "row_positions": where(pos, stop),
                    "index": None if block is None else block["index"],
                    "grid": None if block is None else block["grid"],
                    "num_bytes": len(seg),
                    "sha256": hashlib.sha256(seg).hexdigest(),
                    "width": w,
                    "height": h,
                }
            )
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


# -- images: un-patchify, pixels, thumbnails ----------------------------------------------------
#: batch-level fields of a multimodal batch (not indexed by row)
MM_BATCH_FIELDS = ("pixel_values", "grid_thw", "images_per_row")


def unpatchify(
    patches: np.ndarray, grid_thw: Sequence[int], patch_size: int, temporal_patch_size: int = 2, merge_size: int = 2
) -> np.ndarray:
    """The inverse of :func:`zephon.nodes.vision.patchify`: one image's patches
    ``(t * gh * gw, C * pt * ps * ps)`` in TorchTitan's block order (``(t, bh, bw, m, n)``, each
    vector ``(c, pt, ph, pw)``) back to the (normalised) image ``(gh * ps, gw * ps, C)`` float32
    (the first frame of the temporal patch; zephon repeats a still image to fill it).

    >>> import numpy as np
    >>> from zephon.nodes.vision import patchify
    >>> img = np.arange(64 * 32 * 3, dtype=np.float32).reshape(64, 32, 3)
    >>> patches, grid = patchify(img, 16, 2, 2)
    >>> np.array_equal(unpatchify(patches, grid, 16, 2, 2), img)
    True
    """
    t, gh, gw = (int(v) for v in grid_thw)
    ps, ts, m = int(patch_size), int(temporal_patch_size), int(merge_size)
    if gh % m or gw % m:
        raise ValueError(f"grid {t}x{gh}x{gw} is not a multiple of merge_size = {m}")
    patches = np.asarray(patches)
    n = t * gh * gw
    if patches.ndim != 2 or patches.shape[0] != n or patches.shape[1] % (ts * ps * ps):
        raise ValueError(
            f"patches of shape {patches.shape} do not match grid {t}x{gh}x{gw} with patch_size={ps}, "
            f"temporal_patch_size={ts} (expected ({n}, C * {ts * ps * ps}))"
        )
    c = patches.shape[1] // (ts * ps * ps)
    bh, bw = gh // m, gw // m
    x = patches.reshape(t, bh, bw, m, m, c, ts, ps, ps)  # t bh bw m n c pt ph pw
    x = x.transpose(0, 6, 1, 3, 7, 2, 4, 8, 5)  # t pt bh m ph bw n pw c
    x = x.reshape(t * ts, gh * ps, gw * ps, c)
    return np.ascontiguousarray(x[0], dtype=np.float32)


def denormalize(img: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """A normalised float image ``(H, W, 3)`` back to uint8 RGB: ``x * std + mean``, times 255,
    rounded and clipped (exact for images zephon normalised from 8-bit pixels).

    >>> denormalize(np.array([[[-1.0, 0.0, 1.0]]]), [0.5] * 3, [0.5] * 3).tolist()
    [[[0, 128, 255]]]
    """
    x = np.asarray(img, dtype=np.float32) * np.asarray(std, dtype=np.float32) + np.asarray(mean, dtype=np.float32)
    return np.clip(np.rint(x * np.float32(255.0)), 0, 255).astype(np.uint8)


def thumbnail_size(height: int, width: int, max_side: int) -> tuple[int, int]:
    """(width, height) of an image's thumbnail: scaled down (never up) so its longer side is at
    most ``max_side``, aspect kept, at least 1 pixel.

    >>> thumbnail_size(480, 640, 96), thumbnail_size(32, 64, 96)
    ((96, 72), (64, 32))
    """
    s = min(1.0, max_side / max(height, width))
    return max(1, int(round(width * s))), max(1, int(round(height * s)))


def png_base64(rgb: np.ndarray, max_side: int = 96) -> tuple[str, tuple[int, int]]:
    """A uint8 RGB image as a base64 PNG thumbnail (see :func:`thumbnail_size`): (data, (w, h))."""
    from PIL import Image

    im = Image.fromarray(np.ascontiguousarray(rgb, dtype=np.uint8), "RGB")
    size = thumbnail_size(im.height, im.width, max_side)
    if size != im.size:
        im = im.resize(size, Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    im.save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode("ascii"), size


def is_multimodal(batch: dict[str, Any]) -> bool:
    """Whether ``batch`` is a multimodal batch (has ``grid_thw`` and ``images_per_row``).

    >>> is_multimodal({"input": None}), is_multimodal({"grid_thw": None, "images_per_row": None})
    (False, True)
    """
    return "grid_thw" in batch and "images_per_row" in batch


def image_blocks(
    ids: np.ndarray,
    special: dict[str, int],
    grids: np.ndarray | None = None,
    first: int = 0,
    patch_size: int | None = None,
) -> list[dict[str, Any]]:
    """The images of one row's tokens ``ids``: one dict per run of ``special["image"]`` tokens,
    in row order, with the run's token range (``run``), the block's range including its
    ``vision_start`` / ``vision_end`` tokens (``start``, ``stop``), its placeholder count
    (``tokens``), its index in the batch (``index`` = ``first`` + k, or None when the row has more
    runs than ``grids``), and, given ``grids`` (the row's rows of ``grid_thw``), its ``grid`` and
    pixel size ``height`` x ``width`` (with ``patch_size``).

    >>> special = {"image": 9, "vision_start": 7, "vision_end": 8}
    >>> (b,) = image_blocks(np.array([1, 7, 9, 9, 8, 2]), special, np.array([[1, 2, 4]]), first=5, patch_size=16)
    >>> b["start"], b["stop"], b["run"], b["index"], image_label(b)
    (1, 5, (2, 4), 5, '[image 5: 32x64, 2 tokens]')
    """
    ids = np.asarray(ids)
    img, vs, ve = special["image"], special.get("vision_start"), special.get("vision_end")
    is_img = ids == img
    starts = np.flatnonzero(is_img & ~np.r_[False, is_img[:-1]])
    ends = np.flatnonzero(is_img & ~np.r_[is_img[1:], False]) + 1
    n_grids = 0 if grids is None else len(grids)
    out = []
    for k, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        a = s - 1 if s > 0 and vs is not None and ids[s - 1] == vs else s
        z = e + 1 if e < len(ids) and ve is not None and ids[e] == ve else e
        b: dict[str, Any] = {
            "start": a,
            "stop": z,
            "run": (s, e),
            "tokens": e - s,
            "index": first + k if k < n_grids else None,
            "grid": None,
            "height": None,
            "width": None,
        }
        if grids is not None and k < n_grids:
            t, gh, gw = (int(v) for v in grids[k])
            b["grid"] = (t, gh, gw)
            if patch_size:
                b["height"], b["width"] = gh * patch_size, gw * patch_size
        out.append(b)
    return out


def image_label(block: dict[str, Any]) -> str:
    """``[image N: HxW, K tokens]`` for an :func:`image_blocks` entry."""
    n = "?" if block["index"] is None else block["index"]
    size = f"{block['height']}x{block['width']}, " if block.get("height") else ""
    return f"[image {n}: {size}{block['tokens']} tokens]"


def row_pieces(
    decode: Any, ids: np.ndarray, lo: int, hi: int, blocks: Sequence[dict[str, Any]]
) -> list[tuple[str, Any]]:
    """Tokens ``ids[lo:hi]`` as ``("text", str)`` and ``("image", block)`` pieces in order: each
    image block (``<|vision_start|>``, its placeholder run, ``<|vision_end|>``) collapses into one
    piece; the text between is ``decode``d.

    >>> ids = np.array([1, 7, 9, 9, 8, 2])
    >>> blocks = image_blocks(ids, {"image": 9, "vision_start": 7, "vision_end": 8})
    >>> [(kind, v if kind == "text" else "<image>") for kind, v in row_pieces(str, ids, 0, 6, blocks)]
    [('text', '[1]'), ('image', '<image>'), ('text', '[2]')]
    """
    out: list[tuple[str, Any]] = []
    cur = lo
    for b in blocks:
        if b["stop"] <= lo or b["start"] >= hi:
            continue
        a, z = max(b["start"], lo), min(b["stop"], hi)
        if a > cur:
            out.append(("text", decode(ids[cur:a])))
        out.append(("image", b))
        cur = z
    if cur < hi:
        out.append(("text", decode(ids[cur:hi])))
    return out


def row_images(batch: dict[str, Any], i: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Row ``i`` of a multimodal batch: (index of its first image in the batch, its rows of
    ``grid_thw``, the patch offsets ``[start, stop)`` of each of its images in ``pixel_values``).

    >>> batch = {"images_per_row": np.array([1, 2]), "grid_thw": np.array([[1, 2, 2], [1, 2, 4], [1, 4, 2]])}
    >>> first, grids, spans = row_images(batch, 1)
    >>> first, grids.tolist(), spans.tolist()
    (1, [[1, 2, 4], [1, 4, 2]], [[4, 12], [12, 20]])
    """
    per_row = np.asarray(batch["images_per_row"])
    grids = np.asarray(batch["grid_thw"])
    first = int(per_row[:i].sum())
    k = int(per_row[i])
    sizes = grids.prod(axis=1) if len(grids) else np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    rg = grids[first : first + k]
    return first, rg, np.stack([starts[first : first + k], starts[first + 1 : first + k + 1]], axis=1).astype(np.int64)


class BatchView:
    """A batch with its recipe: decoded rows in text (``repr``) and HTML (Jupyter).

    Text batches show each packed document (segment) in its dataset's colour, a red ``‖`` at
    every document boundary, padding and masked-label counts. Multimodal batches also show every
    image as a thumbnail (un-patchified from ``pixel_values`` and de-normalised with the recipe's
    ``[vision]`` mean/std) in place of its placeholder tokens, with an ``[image N: HxW, K tokens]``
    label (N is the image's index in ``grid_thw``); the text ``repr`` shows the label alone.
    ``thumb_px`` is the thumbnails' longest side (images are scaled down, never up).
    """

    def __init__(
        self, batch: dict[str, Any], recipe: Any, max_rows: int = 8, max_chars: int = 600, thumb_px: int = 96
    ) -> None:
        self.batch, self.recipe = batch, recipe
        self.max_rows, self.max_chars, self.thumb_px = max_rows, max_chars, int(thumb_px)
        p = recipe.prepare()
        self.tokenizer = p.tokenizer
        self.names = [d.name for d in recipe.datasets]
        self.multimodal = is_multimodal(batch)
        self.special: dict[str, int] = dict(getattr(p, "special", None) or {}) if self.multimodal else {}
        self.vision: VisionConfig = recipe.vision
        if self.multimodal and ("image" not in self.special):
            raise ValueError(
                "show: this is a multimodal batch (it has grid_thw) but the recipe has no image "
                "placeholder tokens; pass the recipe the batch came from"
            )

    def __len__(self) -> int:
        return len(self.batch["input"])

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i``'s per-token fields (the batch-level image fields are left out; see :meth:`images`)."""
        return {k: v[i] for k, v in self.batch.items() if k not in MM_BATCH_FIELDS}

    def efficiency(self, i: int) -> float:
        """Share of non-padding input tokens in row ``i``."""
        return float((self.batch["document_ids"][i] >= 0).mean())

    def provenance(self, i: int) -> list[dict[str, Any]]:
        """Where each segment of row ``i`` came from: see :func:`provenance`."""
        return provenance(self.recipe, self.batch, i)

    def _source_title(self, entry: Sequence[int]) -> str:
        """A segment's source for the HTML tooltip, from the index alone (no read)."""
        e = provenance_entry(entry)
        d, shard, record, epoch, t0, t1 = e[:6]
        part = f" of part {e.part + 1}/{e.parts}" if isinstance(e, PartProvenance) else ""
        where = f"shard {shard} · record {record}"
        try:
            if record >= 0:
                loc = self.recipe.prepare().indexes[d].locate(shard, record)
                where = f"{loc['file']} · {loc['locator']}"
        except Exception:  # display only: fall back to the indices
            pass
        return f"{where} · epoch {epoch} · tokens {t0}–{t1}{part}"

    # -- images -------------------------------------------------------------------------------
    def _blocks(self, i: int) -> list[dict[str, Any]]:
        if not self.multimodal:
            return []
        first, grids, spans = row_images(self.batch, i)
        blocks = image_blocks(self.batch["input"][i], self.special, grids, first, self.vision.patch_size)
        for b in blocks:
            k = None if b["index"] is None else b["index"] - first
            b["patches"] = tuple(int(v) for v in spans[k]) if k is not None else None
            lo, hi = b["start"], b["stop"]
            b["masked"] = int((self.batch["labels"][i][lo:hi] == IGNORE_INDEX).sum())
        return blocks

    def image(self, n: int) -> np.ndarray:
        """Image ``n`` of the batch (index into ``grid_thw``) as uint8 RGB ``(H, W, 3)``: its
        patches un-patchified and de-normalised."""
        if not self.multimodal:
            raise ValueError("this batch has no images (no grid_thw)")
        grids = np.asarray(self.batch["grid_thw"])
        sizes = grids.prod(axis=1)
        a = int(sizes[:n].sum())
        v = self.vision
        img = unpatchify(
            self.batch["pixel_values"][a : a + int(sizes[n])],
            grids[n],
            v.patch_size,
            v.temporal_patch_size,
            v.merge_size,
        )
        return denormalize(img, v.mean, v.std)

    def images(self, i: int) -> list[dict[str, Any]]:
        """The images of row ``i`` in token order: ``index`` (into ``grid_thw``), ``grid``,
        ``height``, ``width``, ``tokens`` (placeholders), ``run`` (their positions in the row),
        ``patches`` (their rows of ``pixel_values``), ``masked`` (labels at -100 in the block)."""
        return [b for b in self._blocks(i) if b["index"] is not None]

    # -- text -----------------------------------------------------------------------------------
    def segments(self, i: int) -> list[dict[str, Any]]:
        """Decoded segments of row ``i``: dataset, text, token count, masked label count; for a
        multimodal batch also ``pieces`` (``("text", str)`` / ``("image", block)``) and
        ``images`` (their indices), and ``text`` has each image's label in place of its tokens."""
        r = self.row(i)
        blocks = self._blocks(i)
        out = []
        for pos in _segments(r):
            ds = int(r["dataset"][pos[0]])
            seg: dict[str, Any] = {
                "dataset": self.names[ds] if 0 <= ds < len(self.names) else str(ds),
                "dataset_index": ds,
                "tokens": len(pos),
                "masked": int((r["labels"][pos] == IGNORE_INDEX).sum()),
            }
            lo, hi = int(pos[0]), int(pos[-1]) + 1
            if self.multimodal and hi - lo == len(pos):
                pieces = row_pieces(self.tokenizer.decode, r["input"], lo, hi, blocks)
                seg["pieces"] = pieces
                seg["images"] = [b["index"] for kind, b in pieces if kind == "image"]
                seg["text"] = "".join(v if kind == "text" else image_label(v) for kind, v in pieces)
            else:
                seg["text"] = self.tokenizer.decode(r["input"][pos])
            out.append(seg)
        return out

    def __repr__(self) -> str:
        n = len(self)
        head = f"Batch: {n} rows x {self.batch['input'].shape[1]} tokens"
        if self.multimodal:
            pv = self.batch["pixel_values"]
            head += f", {len(self.batch['grid_thw'])} images ({pv.shape[0]} patches x {pv.shape[1]})"
        lines = [f"{head}; fields: {', '.join(sorted(self.batch))}"]
        for i in range(min(n, self.max_rows)):
            parts = [f"[{s['dataset']}:{s['tokens']}] {s['text']}" for s in self.segments(i)]
            pad = int((self.batch["document_ids"][i] < 0).sum())
            text = " ‖ ".join(parts).replace("\n", "⏎")
            if len(text) > self.max_chars:
                text = text[: self.max_chars - 1] + "…"
            imgs = f", {int(self.batch['images_per_row'][i])} images" if self.multimodal else ""
            lines.append(f"row {i} ({self.efficiency(i):.0%} tokens{imgs}): {text}" + (f" [+{pad} pad]" if pad else ""))
        if n > self.max_rows:
            lines.append(f"... {n - self.max_rows} more rows")
        return "\n".join(lines)

    def _image_html(self, b: dict[str, Any]) -> str:
        label = html.escape(image_label(b))
        title = (
            f"image {b['index']} · grid_thw {b['grid']} · {b['height']}x{b['width']} px · {b['tokens']} "
            f"placeholder tokens · labels -100 on {b['masked']} of {b['stop'] - b['start']} positions"
        )
        thumb = ""
        if b["index"] is not None:
            data, (w, h) = png_base64(self.image(b["index"]), self.thumb_px)
            thumb = (
                f'<img class="zp-thumb" data-image="{b["index"]}" width="{w}" height="{h}" '
                f'alt="image {b["index"]}" src="data:image/png;base64,{data}" '
                'style="vertical-align:middle;margin:1px 3px;border:1px solid #6b7280"/>'
            )
        return (
            f'<span class="zp-image" data-image="{"" if b["index"] is None else b["index"]}" '
            f'data-tokens="{b["tokens"]}" data-masked="{b["masked"]}" title="{html.escape(title)}" '
            'style="display:inline-block;vertical-align:middle;padding:1px 3px;margin:1px;border:1px dashed #6b7280;'
            'background:repeating-linear-gradient(45deg,#f3f4f6,#f3f4f6 4px,#e5e7eb 4px,#e5e7eb 8px)">'
            f'{thumb}<span class="zp-image-label" style="color:#374151">{label}</span></span>'
        )

    def _seg_html(self, seg: dict[str, Any]) -> str:
        if "pieces" not in seg:
            text = seg["text"]
            if len(text) > self.max_chars:
                text = text[: self.max_chars] + "…"
            return html.escape(text)
        budget, parts = self.max_chars, []
        for kind, v in seg["pieces"]:
            if kind == "image":
                parts.append(self._image_html(v))
                continue
            if budget <= 0:
                if not parts or parts[-1] != "…":
                    parts.append("…")
                continue
            if len(v) > budget:
                v = v[:budget] + "…"
            budget -= len(v)
            parts.append(html.escape(v))
        return "".join(parts)

    def _repr_html_(self) -> str:
        n = len(self)
        legend = " ".join(
            f'<span class="zp-legend" style="background:{PALETTE[i % len(PALETTE)]};padding:1px 6px;border-radius:3px">'
            f"{html.escape(name)}</span>"
            for i, name in enumerate(self.names)
        )
        images = ""
        if self.multimodal:
            images = (
                f' &middot; <span class="zp-images">{len(self.batch["grid_thw"])} images</span> '
                "(hatched: image placeholders, labels -100)"
            )
        out = [
            '<div class="zephon-batch" style="font-family:monospace;font-size:12px">',
            f'<div class="zp-head"><b>Batch</b>: {n} rows &times; {self.batch["input"].shape[1]} tokens{images} &middot; '
            f"datasets: {legend}</div>",
        ]
        for i in range(min(n, self.max_rows)):
            prov = self.batch.get("provenance")
            row_imgs = ""
            if self.multimodal:
                row_imgs = f' &middot; <span class="zp-row-images">{int(self.batch["images_per_row"][i])}</span> images'
            out.append(
                f'<div class="zp-row" data-row="{i}" style="margin:4px 0;padding:3px;border:1px solid #ccc">'
                f'<div class="zp-row-head" style="color:#555">row {i} &middot; '
                f'<span class="zp-eff">{self.efficiency(i):.1%}</span> non-padding{row_imgs}</div>'
            )
            for j, seg in enumerate(self.segments(i)):
                color = PALETTE[seg["dataset_index"] % len(PALETTE)]
                title = seg["dataset"]
                if prov is not None and j < len(prov[i]):
                    title += " · " + self._source_title(prov[i][j])
                text = self._seg_html(seg)
                masked = (
                    f' <span class="zp-masked" style="color:#999">[{seg["masked"]} labels masked]</span>'
                    if seg["masked"]
                    else ""
                )
                out.append(
                    f'<span class="zp-boundary" style="color:#e11d48;font-weight:bold">‖</span>'
                    f'<span class="zp-seg" data-dataset="{html.escape(seg["dataset"])}" title="{html.escape(title)}" '
                    f'style="background:{color};white-space:pre-wrap">{text}</span>{masked}'
                )
            pad = int((self.batch["document_ids"][i] < 0).sum())
            if pad:
                out.append(f'<span class="zp-pad" style="background:#eee;color:#888">[pad &times;{pad}]</span>')
            out.append("</div>")
        if n > self.max_rows:
            out.append(f"<div>… {n - self.max_rows} more rows</div>")
        out.append("</div>")
        return "\n".join(out)


def show(batch: dict[str, Any], recipe: Any, **kw: Any) -> BatchView:
    """Wrap a batch for display (Jupyter renders it as HTML, the console as text)."""
    return BatchView(batch, recipe, **kw)


class Explanation:
    """What a pipeline will do: plan, token shares, lane graph and lane-to-rank map."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return '<pre class="zephon-explain">' + html.escape(self.text) + "</pre>"


def explain(recipe: Any, world_size: int | None = None) -> Explanation:
    """The plan (datasets, sizes, tokens per byte, target vs expected token shares, lanes, rows
    per lane per step, flush intervals, workers), the node graph of a lane, and for
    ``world_size`` the lanes each rank owns. Same content as ``zephon inspect``."""
    text = describe_plan(recipe, world_size)
    lane = recipe.build_lane(LaneContext(seed=recipe.seed, lane=0, lanes=recipe.lanes, workers=recipe.workers))
    try:
        graph = lane.describe()
    finally:
        lane.close()
    return Explanation(text + "\n\nnode graph of each lane (lane 0 shown):\n" + graph)


# -- text renderings (the command line's) ----------------------------------------------------
def format_row(
    tokenizer: Any,
    row: dict[str, np.ndarray],
    dataset_names: list[str],
    width: int = 400,
    *,
    special: dict[str, int] | None = None,
    grids: np.ndarray | None = None,
    first_image: int = 0,
    patch_size: int | None = None,
) -> str:
    """A packed row as text: documents separated by ' ‖ ', dataset tags, padding counted.

    For a row of a multimodal batch pass the image placeholder ids (``special``: ``image``,
    ``vision_start``, ``vision_end``), the row's rows of ``grid_thw`` (``grids``), the batch index
    of its first image (``first_image``) and the recipe's ``patch_size``: each image's
    ``<|vision_start|>`` + placeholder run + ``<|vision_end|>`` then reads
    ``[image N: HxW, K tokens]`` (see :func:`format_batch_rows`)."""
    parts = []
    doc = row["document_ids"]
    valid = doc >= 0
    blocks = (
        image_blocks(row["input"], special, grids, first_image, patch_size) if special and "image" in special else []
    )
    for j in np.unique(doc[valid]):
        idx = np.nonzero(doc == j)[0]
        ds = int(row["dataset"][idx[0]])
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        if blocks and hi - lo == len(idx):
            pieces = row_pieces(tokenizer.decode, row["input"], lo, hi, blocks)
            text = "".join(v if kind == "text" else image_label(v) for kind, v in pieces)
        else:
            text = tokenizer.decode(row["input"][idx])
        text = text.replace("\n", "⏎")
        parts.append(f"[{dataset_names[ds]}:{len(idx)} tok] {text}")
    pad = int((~valid).sum())
    s = " ‖ ".join(parts)
    if len(s) > width:
        s = s[: width - 1] + "…"
    return s + (f" [+{pad} pad]" if pad else "")


def format_batch_rows(recipe: Any, batch: dict[str, Any], rows: int, width: int = 2000) -> list[str]:
    """``row <r>: ...`` lines (:func:`format_row`) for the first ``rows`` rows of a text or
    multimodal batch (images as ``[image N: HxW, K tokens]`` with the text around them)."""
    p = recipe.prepare()
    names = [d.name for d in recipe.datasets]
    mm = is_multimodal(batch)
    out = []
    for r in range(min(rows, len(batch["input"]))):
        row = {k: v[r] for k, v in batch.items() if k not in MM_BATCH_FIELDS}
        kw: dict[str, Any] = {}
        if mm:
            first, grids, _ = row_images(batch, r)
            kw = dict(special=p.special, grids=grids, first_image=first, patch_size=recipe.vision.patch_size)
        line = f"row {r}: " + format_row(p.tokenizer, row, names, width=width, **kw)
        if mm:
            line = f"row {r} ({int(batch['images_per_row'][r])} images): " + line[len(f"row {r}: ") :]
        out.append(line)
    return out


def describe_plan(recipe: Any, world_size: int | None = None, draws: int = 4000) -> str:
    """The plan as text: datasets, sizes, tokens/byte, target vs expected token shares, lanes."""
    p = recipe.prepare(progress=None)
    lines = [repr(recipe), f"fingerprint: {p.fingerprint}", ""]
    lines.append(
        f"{'dataset':<12} {'format':<8} {'shards':>6} {'records':>9} {'MB':>8} {'tok/byte':>9} {'est. tokens':>12} {'target':>7} {'expected':>8}"
    )
    expected = list(p.plan.simulated_shares(draws).values())  # lane 0's work source, from metadata only
    target = recipe.schedule.weights(0)
    for i, (s, ix) in enumerate(zip(recipe.datasets, p.indexes)):
        size = sum(sh.size_bytes for sh in ix.shards)
        e = p.estimates[s.name]
        total_bytes = sum(int(ix.record_bytes(k).sum()) for k in range(len(ix.shards)))
        lines.append(
            f"{s.name:<12} {ix.format:<8} {len(ix.shards):>6} {ix.num_records:>9} {size / 1e6:>8.2f} "
            f"{e.tokens_per_byte:>9.4f} {total_bytes * e.tokens_per_byte + ix.num_records * e.tokens_per_record:>12.0f} "
            f"{target[i]:>7.3f} {expected[i]:>8.3f}"
        )
    lines.append("")
    lines.append(
        f"lanes: {recipe.lanes} (valid world sizes: {valid_world_sizes(recipe.lanes)}); rows per lane per step: "
        f"{recipe.rows_per_lane}; seq_len: {recipe.seq_len}; mixing by {recipe.spec.mixing.by}"
    )
    lines.append(
        f"pack: {recipe.spec.pack.algorithm}, flush every {recipe.spec.pack.flush_every} documents; shuffle window: "
        f"{recipe.spec.shuffle.buffer} rows; workers: {recipe.workers.count} {recipe.workers.backend}"
    )
    if len(recipe.schedule.phases) > 1:
        lines.append(
            "schedule: "
            + "; ".join(
                f"step {s}: {dict(zip([d.name for d in recipe.datasets], w))}" for s, w in recipe.schedule.phases
            )
        )
    if world_size:
        for r in range(world_size):
            owned = lanes_of_rank(recipe.lanes, world_size, r)
            lines.append(f"  rank {r}/{world_size}: lanes {owned.start}..{owned.stop - 1}")
    return "\n".join(lines)
