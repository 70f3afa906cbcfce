"""Seeing batches: decoded rows with document boundaries, padding and masked labels, images as
thumbnails beside their placeholder tokens (multimodal batches), provenance back to the source
record, and the plan of a pipeline. Plain-text ``repr`` everywhere, HTML in Jupyter
(``_repr_html_``).

    >>> view = show(batch, recipe)          # doctest: +SKIP
    >>> view.provenance(0)[0]["file"]       # doctest: +SKIP
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["BatchView", "Explanation", "explain", "show", "provenance", "PALETTE", "unpatchify", "denormalize",
           "thumbnail_size", "png_base64", "image_blocks", "image_label", "row_pieces", "row_images", "is_multimodal"]

PALETTE = ["#dbeafe", "#dcfce7", "#fef3c7", "#fce7f3", "#ede9fe", "#cffafe", "#fee2e2", "#e5e7eb"]


def _segments(row: Dict[str, np.ndarray]) -> List[np.ndarray]:
    """Token positions of each segment of a row (in row order), padding excluded."""
    doc = row["document_ids"]
    out = []
    for j in np.unique(doc[doc >= 0]):
        out.append(np.nonzero(doc == j)[0])
    return out


def provenance(recipe: Any, batch: Dict[str, Any], row: int) -> List[Dict[str, Any]]:
    """Where every segment of ``batch`` row ``row`` came from.

    One dict per segment, in row order: ``dataset``, ``file``, ``locator`` (line / row),
    ``record``, ``epoch``, ``tokens`` (the range within the document's tokens, BOS/EOS
    included), ``chars`` and ``bytes`` (the range of the record's text those tokens cover; the
    bytes are UTF-8 offsets into the text field), ``file_bytes`` (the record's byte range in the
    file, for line formats), ``row_positions`` and ``text``. Re-reading the record, tokenizing it
    and taking ``tokens`` gives back the segment exactly.
    """
    if "provenance" not in batch:
        raise ValueError("this batch has no provenance field (multimodal batches do not carry one yet); "
                         "provenance is available for text batches")
    p = recipe.prepare()
    tok = p.tokenizer
    prov = batch["provenance"][row]
    lead = 1 if tok.add_bos else 0
    out = []
    segs = _segments({k: batch[k][row] for k in ("document_ids",)})
    for j, (d, shard, record, epoch, t0, t1) in enumerate(prov):
        ix = p.indexes[d]
        text = ix.read(shard, [record])[0]
        if not isinstance(text, str):
            raise ValueError(f"record {record} of {ix.shards[shard].path} is no longer readable: {text}")
        enc = tok._tokenizer().encode(text, add_special_tokens=False)
        offsets = enc.offsets
        n_content = len(offsets)
        c0 = c1 = None
        for t in range(t0, t1):  # token t of the document; content tokens are t - lead
            k = t - lead
            if 0 <= k < n_content:
                c0 = offsets[k][0] if c0 is None else c0
                c1 = offsets[k][1]
        chars = (c0 or 0, c1 or 0) if c0 is not None else (0, 0)
        b0 = len(text[: chars[0]].encode("utf-8"))
        b1 = b0 + len(text[chars[0] : chars[1]].encode("utf-8"))
        loc = ix.locate(shard, record)
        out.append({
            "dataset": recipe.datasets[d].name, "file": loc["file"], "locator": loc["locator"], "record": record,
            "shard": shard, "epoch": epoch, "tokens": (t0, t1), "chars": chars, "bytes": (b0, b1),
            "row_positions": (int(segs[j][0]), int(segs[j][-1]) + 1) if j < len(segs) else None,
            "text": text[chars[0] : chars[1]],
            "has_bos": t0 == 0 and tok.add_bos, "has_eos": tok.add_eos and t1 == n_content + lead + 1,
            # the record's own bytes in the (decompressed) file, for line formats: re-read them,
            # parse, tokenize (with BOS/EOS) and take tokens[t0:t1] to get this segment back
            "file_bytes": ((loc["byte_offset"], loc["byte_offset"] + loc["byte_length"]) if "byte_offset" in loc else None),
        })
    return out


# -- images: un-patchify, pixels, thumbnails ----------------------------------------------------
#: batch-level fields of a multimodal batch (not indexed by row)
MM_BATCH_FIELDS = ("pixel_values", "grid_thw", "images_per_row")


def unpatchify(patches: np.ndarray, grid_thw: Sequence[int], patch_size: int, temporal_patch_size: int = 2,
               merge_size: int = 2) -> np.ndarray:
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
        raise ValueError(f"patches of shape {patches.shape} do not match grid {t}x{gh}x{gw} with patch_size={ps}, "
                         f"temporal_patch_size={ts} (expected ({n}, C * {ts * ps * ps}))")
    c = patches.shape[1] // (ts * ps * ps)
    bh, bw = gh // m, gw // m
    x = patches.reshape(t, bh, bw, m, m, c, ts, ps, ps)  # t bh bw m n c pt ph pw
    x = x.transpose(0, 6, 1, 3, 7, 2, 4, 8, 5)  # t pt bh m ph bw n pw c
    x = x.reshape(t * ts, gh * ps, gw * ps, c)
    return np.ascontiguousarray(x[0], dtype=np.float32)


def denormalize(img: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """A normalised float image ``(H, W, 3)`` back to uint8 RGB: ``x * std + mean``, times 255,
    rounded and clipped (exact for images zephon normalised from 8-bit pixels)."""
    x = np.asarray(img, dtype=np.float32) * np.asarray(std, dtype=np.float32) + np.asarray(mean, dtype=np.float32)
    return np.clip(np.rint(x * np.float32(255.0)), 0, 255).astype(np.uint8)


def thumbnail_size(height: int, width: int, max_side: int) -> Tuple[int, int]:
    """(width, height) of an image's thumbnail: scaled down (never up) so its longer side is at
    most ``max_side``, aspect kept, at least 1 pixel."""
    s = min(1.0, max_side / max(height, width))
    return max(1, int(round(width * s))), max(1, int(round(height * s)))


def png_base64(rgb: np.ndarray, max_side: int = 96) -> Tuple[str, Tuple[int, int]]:
    """A uint8 RGB image as a base64 PNG thumbnail (see :func:`thumbnail_size`): (data, (w, h))."""
    from PIL import Image

    im = Image.fromarray(np.ascontiguousarray(rgb, dtype=np.uint8), "RGB")
    size = thumbnail_size(im.height, im.width, max_side)
    if size != im.size:
        im = im.resize(size, Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    im.save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode("ascii"), size


def is_multimodal(batch: Dict[str, Any]) -> bool:
    """Whether ``batch`` is a multimodal batch (has ``grid_thw`` and ``images_per_row``)."""
    return "grid_thw" in batch and "images_per_row" in batch


def image_blocks(ids: np.ndarray, special: Dict[str, int], grids: Optional[np.ndarray] = None, first: int = 0,
                 patch_size: Optional[int] = None) -> List[Dict[str, Any]]:
    """The images of one row's tokens ``ids``: one dict per run of ``special["image"]`` tokens,
    in row order, with the run's token range (``run``), the block's range including its
    ``vision_start`` / ``vision_end`` tokens (``start``, ``stop``), its placeholder count
    (``tokens``), its index in the batch (``index`` = ``first`` + k, or None when the row has more
    runs than ``grids``), and, given ``grids`` (the row's rows of ``grid_thw``), its ``grid`` and
    pixel size ``height`` x ``width`` (with ``patch_size``)."""
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
        b: Dict[str, Any] = {"start": a, "stop": z, "run": (s, e), "tokens": e - s,
                             "index": first + k if k < n_grids else None, "grid": None, "height": None, "width": None}
        if k < n_grids:
            t, gh, gw = (int(v) for v in grids[k])
            b["grid"] = (t, gh, gw)
            if patch_size:
                b["height"], b["width"] = gh * patch_size, gw * patch_size
        out.append(b)
    return out


def image_label(block: Dict[str, Any]) -> str:
    """``[image N: HxW, K tokens]`` for an :func:`image_blocks` entry."""
    n = "?" if block["index"] is None else block["index"]
    size = f"{block['height']}x{block['width']}, " if block.get("height") else ""
    return f"[image {n}: {size}{block['tokens']} tokens]"


def row_pieces(decode: Any, ids: np.ndarray, lo: int, hi: int, blocks: Sequence[Dict[str, Any]]) -> List[Tuple[str, Any]]:
    """Tokens ``ids[lo:hi]`` as ``("text", str)`` and ``("image", block)`` pieces in order: each
    image block (``<|vision_start|>``, its placeholder run, ``<|vision_end|>``) collapses into one
    piece; the text between is ``decode``d."""
    out: List[Tuple[str, Any]] = []
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


def row_images(batch: Dict[str, Any], i: int) -> Tuple[int, np.ndarray, np.ndarray]:
    """Row ``i`` of a multimodal batch: (index of its first image in the batch, its rows of
    ``grid_thw``, the patch offsets ``[start, stop)`` of each of its images in ``pixel_values``)."""
    per_row = np.asarray(batch["images_per_row"])
    grids = np.asarray(batch["grid_thw"])
    first = int(per_row[:i].sum())
    k = int(per_row[i])
    sizes = grids.prod(axis=1) if len(grids) else np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    rg = grids[first:first + k]
    return first, rg, np.stack([starts[first:first + k], starts[first + 1:first + k + 1]], axis=1).astype(np.int64)


class BatchView:
    """A batch with its recipe: decoded rows in text (``repr``) and HTML (Jupyter).

    Text batches show each packed document (segment) in its dataset's colour, a red ``‖`` at
    every document boundary, padding and masked-label counts. Multimodal batches also show every
    image as a thumbnail (un-patchified from ``pixel_values`` and de-normalised with the recipe's
    ``[vision]`` mean/std) in place of its placeholder tokens, with an ``[image N: HxW, K tokens]``
    label (N is the image's index in ``grid_thw``); the text ``repr`` shows the label alone.
    ``thumb_px`` is the thumbnails' longest side (images are scaled down, never up).
    """

    def __init__(self, batch: Dict[str, Any], recipe: Any, max_rows: int = 8, max_chars: int = 600,
                 thumb_px: int = 96) -> None:
        self.batch, self.recipe = batch, recipe
        self.max_rows, self.max_chars, self.thumb_px = max_rows, max_chars, int(thumb_px)
        p = recipe.prepare()
        self.tokenizer = p.tokenizer
        self.names = [d.name for d in recipe.datasets]
        self.multimodal = is_multimodal(batch)
        self.special: Dict[str, int] = dict(getattr(p, "special", None) or {}) if self.multimodal else {}
        self.vision = getattr(recipe, "vision", None)
        if self.multimodal and ("image" not in self.special or self.vision is None):
            raise ValueError("show: this is a multimodal batch (it has grid_thw) but the recipe has no image "
                             "placeholder tokens; pass the recipe the batch came from")

    def __len__(self) -> int:
        return len(self.batch["input"])

    def row(self, i: int) -> Dict[str, Any]:
        """Row ``i``'s per-token fields (the batch-level image fields are left out; see :meth:`images`)."""
        return {k: v[i] for k, v in self.batch.items() if k not in MM_BATCH_FIELDS}

    def efficiency(self, i: int) -> float:
        """Share of non-padding input tokens in row ``i``."""
        return float((self.batch["document_ids"][i] >= 0).mean())

    def provenance(self, i: int) -> List[Dict[str, Any]]:
        return provenance(self.recipe, self.batch, i)

    # -- images -------------------------------------------------------------------------------
    def _blocks(self, i: int) -> List[Dict[str, Any]]:
        if not self.multimodal:
            return []
        first, grids, spans = row_images(self.batch, i)
        blocks = image_blocks(self.batch["input"][i], self.special, grids, first, self.vision.patch_size)
        for b in blocks:
            k = None if b["index"] is None else b["index"] - first
            b["patches"] = tuple(int(v) for v in spans[k]) if k is not None else None
            lo, hi = b["start"], b["stop"]
            b["masked"] = int((self.batch["labels"][i][lo:hi] == -100).sum())
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
        img = unpatchify(self.batch["pixel_values"][a:a + int(sizes[n])], grids[n], v.patch_size,
                         v.temporal_patch_size, v.merge_size)
        return denormalize(img, v.mean, v.std)

    def images(self, i: int) -> List[Dict[str, Any]]:
        """The images of row ``i`` in token order: ``index`` (into ``grid_thw``), ``grid``,
        ``height``, ``width``, ``tokens`` (placeholders), ``run`` (their positions in the row),
        ``patches`` (their rows of ``pixel_values``), ``masked`` (labels at -100 in the block)."""
        return [b for b in self._blocks(i) if b["index"] is not None]

    # -- text -----------------------------------------------------------------------------------
    def segments(self, i: int) -> List[Dict[str, Any]]:
        """Decoded segments of row ``i``: dataset, text, token count, masked label count; for a
        multimodal batch also ``pieces`` (``("text", str)`` / ``("image", block)``) and
        ``images`` (their indices), and ``text`` has each image's label in place of its tokens."""
        r = self.row(i)
        blocks = self._blocks(i)
        out = []
        for pos in _segments(r):
            ds = int(r["dataset"][pos[0]])
            seg: Dict[str, Any] = {
                "dataset": self.names[ds] if 0 <= ds < len(self.names) else str(ds),
                "dataset_index": ds,
                "tokens": len(pos),
                "masked": int((r["labels"][pos] == -100).sum()),
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

    def _image_html(self, b: Dict[str, Any]) -> str:
        label = html.escape(image_label(b))
        title = (f"image {b['index']} · grid_thw {b['grid']} · {b['height']}x{b['width']} px · {b['tokens']} "
                 f"placeholder tokens · labels -100 on {b['masked']} of {b['stop'] - b['start']} positions")
        thumb = ""
        if b["index"] is not None:
            data, (w, h) = png_base64(self.image(b["index"]), self.thumb_px)
            thumb = (f'<img class="zp-thumb" data-image="{b["index"]}" width="{w}" height="{h}" '
                     f'alt="image {b["index"]}" src="data:image/png;base64,{data}" '
                     'style="vertical-align:middle;margin:1px 3px;border:1px solid #6b7280"/>')
        return (f'<span class="zp-image" data-image="{"" if b["index"] is None else b["index"]}" '
                f'data-tokens="{b["tokens"]}" data-masked="{b["masked"]}" title="{html.escape(title)}" '
                'style="display:inline-block;vertical-align:middle;padding:1px 3px;margin:1px;border:1px dashed #6b7280;'
                'background:repeating-linear-gradient(45deg,#f3f4f6,#f3f4f6 4px,#e5e7eb 4px,#e5e7eb 8px)">'
                f'{thumb}<span class="zp-image-label" style="color:#374151">{label}</span></span>')

    def _seg_html(self, seg: Dict[str, Any]) -> str:
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
            f"{html.escape(name)}</span>" for i, name in enumerate(self.names))
        images = ""
        if self.multimodal:
            images = (f' &middot; <span class="zp-images">{len(self.batch["grid_thw"])} images</span> '
                      '(hatched: image placeholders, labels -100)')
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
            out.append(f'<div class="zp-row" data-row="{i}" style="margin:4px 0;padding:3px;border:1px solid #ccc">'
                       f'<div class="zp-row-head" style="color:#555">row {i} &middot; '
                       f'<span class="zp-eff">{self.efficiency(i):.1%}</span> non-padding{row_imgs}</div>')
            for j, seg in enumerate(self.segments(i)):
                color = PALETTE[seg["dataset_index"] % len(PALETTE)]
                title = seg["dataset"]
                if prov is not None and j < len(prov[i]):
                    d, shard, record, epoch, t0, t1 = prov[i][j]
                    title += f" · shard {shard} · record {record} · epoch {epoch} · tokens {t0}–{t1}"
                text = self._seg_html(seg)
                masked = f' <span class="zp-masked" style="color:#999">[{seg["masked"]} labels masked]</span>' if seg["masked"] else ""
                out.append(f'<span class="zp-boundary" style="color:#e11d48;font-weight:bold">‖</span>'
                           f'<span class="zp-seg" data-dataset="{html.escape(seg["dataset"])}" title="{html.escape(title)}" '
                           f'style="background:{color};white-space:pre-wrap">{text}</span>{masked}')
            pad = int((self.batch["document_ids"][i] < 0).sum())
            if pad:
                out.append(f'<span class="zp-pad" style="background:#eee;color:#888">[pad &times;{pad}]</span>')
            out.append("</div>")
        if n > self.max_rows:
            out.append(f"<div>… {n - self.max_rows} more rows</div>")
        out.append("</div>")
        return "\n".join(out)


def show(batch: Dict[str, Any], recipe: Any, **kw: Any) -> BatchView:
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


def explain(recipe: Any, world_size: Optional[int] = None) -> Explanation:
    """The plan (datasets, sizes, tokens per byte, target vs expected token shares, lanes, rows
    per lane per step, flush intervals, workers), the node graph of a lane, and for
    ``world_size`` the lanes each rank owns. Same content as ``zephon inspect``."""
    from zephon.cli import describe_plan
    from zephon.lanes import LaneContext

    text = describe_plan(recipe, world_size)
    lane = recipe.build_lane(LaneContext(seed=recipe.seed, lane=0, lanes=recipe.lanes, workers=recipe.workers))
    try:
        graph = lane.describe()
    finally:
        lane.close()
    return Explanation(text + "\n\nnode graph of each lane (lane 0 shown):\n" + graph)
