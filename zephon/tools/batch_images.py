"""A multimodal batch's images: where each sits among a row's tokens, and its pixels back
from ``pixel_values`` (un-patchified, de-normalised, as a PNG thumbnail).

The display (:mod:`zephon.tools.display`) and provenance (:mod:`zephon.tools.provenance`) both
read images this way; the functions are plain numpy and small enough to check by hand.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "MM_BATCH_FIELDS",
    "denormalize",
    "image_blocks",
    "image_label",
    "is_multimodal",
    "png_base64",
    "row_images",
    "row_pieces",
    "thumbnail_size",
    "unpatchify",
]

MM_BATCH_FIELDS = ("pixel_values", "grid_thw", "images_per_row")


def unpatchify(
    patches: np.ndarray, grid_thw: Sequence[int], patch_size: int, temporal_patch_size: int = 2, merge_size: int = 2
) -> np.ndarray:
    """The inverse of :func:`zephon.nodes.images.patchify`: one image's patches
    ``(t * gh * gw, C * pt * ps * ps)`` in TorchTitan's block order (``(t, bh, bw, m, n)``, each
    vector ``(c, pt, ph, pw)``) back to the (normalised) image ``(gh * ps, gw * ps, C)`` float32
    (the first frame of the temporal patch; zephon repeats a still image to fill it).

    >>> import numpy as np
    >>> from zephon.nodes.images import patchify
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
    piece; the text between is decoded with ``decode``.

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
