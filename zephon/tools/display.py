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
    row 0 (92% tokens, 2 images): [pairs:34] <|bos|>[image 0: 32x96, 3 tokens]Measure lys smur eldin
    >>> batch["provenance"][0][0]   # one zephon.nodes.Provenance per sample of the row
    Provenance(dataset=0, shard=0, record=7, epoch=0, tok_start=0, tok_end=34)
    >>> sample = view.provenance(0)[0]
    >>> sample["locator"], sample["tokens"], sample["texts"][0]["member"]
    ("key '00000007'", (0, 34), '00000007.txt')
    >>> image = sample["images"][0]
    >>> image["index"], image["member"], image["row_positions"]   # image 0 of the batch, its tokens
    (0, '00000007.png', (1, 6))
    >>> with open(sample["file"], "rb") as f:          # the cited bytes, read from the tar itself
    ...     _ = f.seek(image["file_bytes"][0])
    ...     data = f.read(image["file_bytes"][1] - image["file_bytes"][0])
    >>> hashlib.sha256(data).hexdigest() == image["sha256"]
    True
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon.engine import LaneContext
from zephon.engine.lanes import divisors, lanes_of_rank
from zephon.nodes import IGNORE_INDEX, PartProvenance, VisionConfig, provenance_entry

from .batch_images import (
    MM_BATCH_FIELDS,
    denormalize,
    image_blocks,
    image_label,
    is_multimodal,
    png_base64,
    row_images,
    row_pieces,
    thumbnail_size,
    unpatchify,
)
from .chat_html import conversation_html
from .provenance import provenance, segment_positions

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
        self.chat = {i for i, d in enumerate(recipe.spec.datasets) if d.kind == "chat"}  # shown trained / not
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
        for pos in segment_positions(r):
            ds = int(r["dataset"][pos[0]])
            seg: dict[str, Any] = {
                "dataset": self.names[ds] if 0 <= ds < len(self.names) else str(ds),
                "dataset_index": ds,
                "tokens": len(pos),
                "masked": int((r["labels"][pos] == IGNORE_INDEX).sum()),
            }
            lo, hi = int(pos[0]), int(pos[-1]) + 1
            seg["start"], seg["stop"] = lo, hi
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

    def trained(self, i: int) -> np.ndarray:
        """Which tokens of row ``i`` are trained on: token ``t`` is a target of the label at ``t - 1``
        (a chat row: the assistant's text and end-of-turn tokens)."""
        out = np.zeros(self.batch["input"].shape[1], dtype=bool)
        out[1:] = self.batch["labels"][i][:-1] != IGNORE_INDEX
        return out

    def _chat_html(self, i: int, seg: dict[str, Any]) -> str:
        """A conversation: its images in place of their placeholder runs, the tokens not trained on
        (system, user, tool turns, each assistant header) hatched."""
        blocks = {b["start"]: (b["stop"], self._image_html(b)) for b in self._blocks(i)}
        return conversation_html(
            self.batch["input"][i],
            self.trained(i),
            (seg["start"], seg["stop"]),
            blocks,
            self.tokenizer.decode,
            self.max_chars,
        )

    def _seg_html(self, seg: dict[str, Any], row: int | None = None) -> str:
        if row is not None and seg["dataset_index"] in self.chat:
            return self._chat_html(row, seg)
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
        if self.chat:
            images += " &middot; conversations: the tokens not trained on are hatched"
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
                text = self._seg_html(seg, i)
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
        f"lanes: {recipe.lanes} (valid world sizes: {divisors(recipe.lanes)}); rows per lane per step: "
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
    lines += recipe.describe_phases()
    if world_size:
        for r in range(world_size):
            owned = lanes_of_rank(recipe.lanes, world_size, r)
            lines.append(f"  rank {r}/{world_size}: lanes {owned.start}..{owned.stop - 1}")
    return "\n".join(lines)
