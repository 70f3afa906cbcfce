"""Vision operators: decode, resize, normalise, patchify, placeholder tokens; run on the mapper.

The per-image steps are plain functions (:func:`decode_image`, :func:`smart_resize`,
:func:`preprocess_image`, :func:`patchify`) and :class:`FetchVision` is the elementwise batch
function for :class:`zephon.OrderedMapper` that turns a chunk of WorkItems into
:class:`MMDoc` s: it reads image-text records, decodes their images (Pillow releases the GIL
while decoding and resizing, so threads scale), tokenizes all text segments of the chunk in one
call and lays out each sample's tokens as TorchTitan's multimodal pipeline does::

    [BOS] text... <|vision_start|> <|image_pad|> x N <|vision_end|> text... [EOS]

with ``N = (H / patch) * (W / patch) / merge**2`` for an image resized to H x W. Text-only
datasets of the same recipe go through :class:`zephon.nodes.FetchTokenize` unchanged.

Layout (TorchTitan 0.3.0, ``hf_datasets/multimodal/utils/image.py::vision_to_patches`` with
``patch_order="block"``): an image becomes ``temporal_patch_size`` identical frames; patches
are ordered ``(t, bh, bw, m, n)`` (each merge group contiguous) and each patch vector is
channel-first ``(c, pt, ph, pw)``: ``patch_dim = 3 * temporal_patch_size * patch**2``;
``grid_thw = [1, H / patch, W / patch]``.

Every step is deterministic integer or IEEE float32 arithmetic in one library (Pillow's
bicubic resampling, numpy's elementwise float32 ops), so the bytes do not depend on threads,
processes or runs. Bad images (corrupt, truncated, zero pixels, above ``max_image_pixels``,
checked from the header *before* decoding) follow the dataset's ``on_error``.
"""

from __future__ import annotations

import functools
import io
import itertools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from zephon.data.datasets import BadRecord, DataError
from zephon.engine import ProcessLocal

from .policy import skip_hint
from .tokenize import FetchTokenize
from .worksource import WorkItem

__all__ = [
    "DECODE_RULES",
    "SPECIAL_NAMES",
    "FetchVision",
    "ImageError",
    "LayoutSpan",
    "MMDoc",
    "VisionConfig",
    "decode_image",
    "decode_pixels",
    "mrope_positions",
    "patchify",
    "preprocess_image",
    "preprocess_patches",
    "sample_layout",
    "smart_resize",
]

SPECIAL_NAMES = ("image", "video", "vision_start", "vision_end")

#: how decoded pixels become RGB (``[vision] decode``): "exact" (data_version 2): transparency
#: composited onto ``background``, 16/32-bit and float samples scaled to [0, 1] as float32 (no
#: clipping, no 8-bit quantisation); "convert" (data_version 1): Pillow's ``convert("RGB")``,
#: which drops alpha and clips high bit depths to 255
DECODE_RULES = ("exact", "convert")


class ImageError(ValueError):
    """An image that cannot be used; the message is the reason."""


@dataclass(frozen=True)
class VisionConfig:
    """Image settings (the recipe's ``[vision]`` section).

    Part of the data definition: they decide every image's size, pixels and token count.

    >>> v = VisionConfig(min_pixels=1024, max_pixels=4096)
    >>> v.factor, v.patch_dim, v.target_size(100, 50), v.image_tokens(100, 50)
    (32, 1536, (64, 32), 2)
    """

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_image_pixels: int = 64_000_000  # source images above this are refused before decoding
    max_images_per_batch: int = 128  # per lane micro-batch
    max_images_per_row: int = 0  # 0 = no per-row limit
    mrope: bool = True
    decode: str = "convert"  # see DECODE_RULES; the recipe's default is versioned ("exact" from data_version 2)
    background: tuple[float, float, float] = (1.0, 1.0, 1.0)  # what transparent pixels show (decode = "exact")

    @property
    def factor(self) -> int:
        """Side of one merged placeholder token in pixels: image sides are multiples of it."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one patch vector in ``pixel_values``: ``3 * temporal_patch_size * patch_size**2``."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) an image is resized to."""
        h, w = smart_resize(height, width, self.patch_size, self.merge_size, self.min_pixels, self.max_pixels)
        return w, h

    def image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens of an image of this (oriented) size; 0 if unknown (0 x 0)."""
        if width <= 0 or height <= 0:
            return 0
        try:
            w, h = self.target_size(width, height)
        except ImageError:
            return 0
        return (h // self.factor) * (w // self.factor)


def smart_resize(
    height: int, width: int, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen-VL pixel budget: (h, w) multiples of ``patch_size * merge_size`` with
    ``min_pixels <= h * w <= max_pixels``, aspect kept; the same arithmetic as TorchTitan's
    ``resize_to_pixel_budget``.

    >>> smart_resize(480, 640, 16, 2, 65536, 16777216)
    (480, 640)
    >>> smart_resize(480, 640, 16, 2, 1024, 4096)   # over the budget: scaled down
    (32, 64)
    """
    factor = patch_size * merge_size
    if height <= 0 or width <= 0:
        raise ImageError(f"the image has zero pixels ({width}x{height})")
    if height < factor or width < factor:
        scale = max(factor / width, factor / height)
        width, height = int(width * scale), int(height * scale)
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"aspect ratio {max(height, width) / min(height, width):.1f} is above 200")
    h_bar = max(round(height / factor) * factor, factor)
    w_bar = max(round(width / factor) * factor, factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(math.floor(height / beta / factor) * factor, factor)
        w_bar = max(math.floor(width / beta / factor) * factor, factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _open_image(data: bytes, max_image_pixels: int) -> Any:
    """Encoded bytes -> a loaded ``PIL.Image`` (its first frame), EXIF orientation applied, any mode."""
    from PIL import Image, ImageOps

    if not data:
        raise ImageError("the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ImageError(f"refused by Pillow's decompression-bomb check ({e})") from None
    except Exception as e:
        raise ImageError(f"cannot identify the image ({type(e).__name__}: {e})") from None
    w, h = im.size
    if w <= 0 or h <= 0:
        raise ImageError(f"the image has zero pixels ({w}x{h})")
    if w * h > max_image_pixels:
        raise ImageError(
            f"the image is above max_image_pixels ({w}x{h} = {w * h} pixels > {max_image_pixels}; "
            "a decompression bomb or an absurd size)"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            im.load()  # the first frame of a multi-frame image (GIF, APNG, TIFF pages, ...)
            img: Image.Image = ImageOps.exif_transpose(im)
    except Exception as e:
        raise ImageError(f"corrupt or truncated image data ({type(e).__name__}: {e})") from None
    return img


def decode_image(data: bytes, max_image_pixels: int = 64_000_000) -> Any:
    """Encoded bytes -> an RGB ``PIL.Image`` with EXIF orientation applied, by Pillow's
    ``convert("RGB")`` (the ``decode = "convert"`` rule of data_version 1; :func:`decode_pixels`
    is the exact rule).

    The size is checked from the header before any pixel is decoded: zero pixels or more than
    ``max_image_pixels`` raise :class:`ImageError` (so does anything Pillow cannot decode).

    >>> import io
    >>> from PIL import Image
    >>> buf = io.BytesIO(); Image.new("L", (40, 30), 128).save(buf, "PNG")
    >>> im = decode_image(buf.getvalue()); im.mode, im.size
    ('RGB', (40, 30))
    >>> decode_image(buf.getvalue(), max_image_pixels=1000)
    Traceback (most recent call last):
    ...
    zephon.nodes.vision.ImageError: the image is above max_image_pixels (40x30 = 1200 pixels > 1000; a decompression bomb or an absurd size)
    """
    img = _open_image(data, max_image_pixels)
    try:
        if img.mode != "RGB":
            img = img.convert("RGB")
    except Exception as e:
        raise ImageError(f"corrupt or truncated image data ({type(e).__name__}: {e})") from None
    return img


_HIGH_DEPTH = {"I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I;16N": 65535.0, "I": 65535.0}


def decode_pixels(
    data: bytes,
    max_image_pixels: int = 64_000_000,
    background: Sequence[float] = (1.0, 1.0, 1.0),
) -> np.ndarray:
    """Encoded bytes -> RGB pixels ``(H, W, 3)`` by the exact rule (``decode = "exact"``): uint8
    for an 8-bit image without transparency (Pillow's own conversion to RGB: L, 1, P, CMYK,
    YCbCr, LAB, ...), else float32 in [0, 1] with nothing quantised:

    * 16-bit samples (``I;16*``) and 32-bit integers (``I``) are divided by 65535 (``I``
      is how Pillow widens 16-bit samples; values outside 0..65535 clip), floats (``F``) are
      intensities in [0, 1] (clipped, NaN is 0); all three are grey;
    * transparency (an alpha channel, a palette or colour-key ``transparency``) is composited
      onto ``background`` (RGB in [0, 1], white by default, the Hugging Face processors'
      convention): ``rgb * a + background * (1 - a)``; a fully opaque image is plain uint8 RGB.

    The first frame of a multi-frame image is used; EXIF orientation is applied.

    >>> import io
    >>> from PIL import Image
    >>> buf = io.BytesIO(); Image.new("I;16", (4, 2), 32768).save(buf, "PNG")
    >>> x = decode_pixels(buf.getvalue()); x.dtype, x.shape, round(float(x[0, 0, 0]), 4)
    (dtype('float32'), (2, 4, 3), 0.5)
    >>> buf = io.BytesIO(); Image.new("RGBA", (4, 2), (0, 0, 0, 0)).save(buf, "PNG")
    >>> decode_pixels(buf.getvalue())[0, 0].tolist()   # transparent: the background (white)
    [1.0, 1.0, 1.0]
    """
    im = _open_image(data, max_image_pixels)
    try:
        return _exact_pixels(im, background)
    except ImageError:
        raise
    except Exception as e:
        raise ImageError(f"corrupt or truncated image data ({type(e).__name__}: {e})") from None


def _exact_pixels(im: Any, background: Sequence[float]) -> np.ndarray:
    mode = im.mode
    if mode in _HIGH_DEPTH or mode == "F":
        a = np.asarray(im)
        if mode == "F":
            g = np.nan_to_num(a.astype(np.float32), nan=0.0)
        else:
            g = a.astype(np.float32) * np.float32(1.0 / _HIGH_DEPTH[mode])
        g = np.clip(g, 0.0, 1.0, dtype=np.float32)
        return np.repeat(g[:, :, None], 3, axis=2)
    if (mode in ("P", "L", "RGB", "1") and "transparency" in im.info) or mode in ("PA", "RGBa"):
        im = im.convert("RGBA")
    elif mode == "La":
        im = im.convert("LA")
    if im.mode in ("RGBA", "LA"):
        a = np.asarray(im)
        alpha = a[:, :, -1]
        if alpha.min() == 255:
            return np.asarray(im.convert("RGB"))
        rgb = a[:, :, :3] if im.mode == "RGBA" else np.repeat(a[:, :, :1], 3, axis=2)
        w = alpha.astype(np.float32)[:, :, None] * np.float32(1.0 / 255.0)
        out = rgb.astype(np.float32) * np.float32(1.0 / 255.0) * w
        out += np.asarray(background, dtype=np.float32) * (np.float32(1.0) - w)
        return out
    if im.mode != "RGB":
        im = im.convert("RGB")
    return np.asarray(im)


def _decode_resized(data: bytes, cfg: VisionConfig) -> np.ndarray:
    """The decoded image resized (bicubic) to the pixel budget: the start of both image paths.
    uint8 ``(H, W, 3)``, or float32 in [0, 1] for what :func:`decode_pixels` keeps in float (each
    channel resized in float, then clipped to [0, 1] as the 8-bit path clips to 0..255)."""
    from PIL import Image

    if cfg.decode == "convert":
        im = decode_image(data, cfg.max_image_pixels)
        tw, th = cfg.target_size(*im.size)
        if (tw, th) != im.size:
            im = im.resize((tw, th), Image.Resampling.BICUBIC)
        return np.asarray(im)
    if cfg.decode != "exact":
        raise ValueError(f"[vision] decode is one of {DECODE_RULES}, got {cfg.decode!r}")
    x = decode_pixels(data, cfg.max_image_pixels, cfg.background)
    h, w = x.shape[:2]
    tw, th = cfg.target_size(w, h)
    if (tw, th) == (w, h):
        return x
    if x.dtype == np.uint8:
        return np.asarray(Image.fromarray(x, "RGB").resize((tw, th), Image.Resampling.BICUBIC))
    grey = bool((x[:, :, 0] == x[:, :, 1]).all() and (x[:, :, 0] == x[:, :, 2]).all())
    chans = [x[:, :, 0]] if grey else [x[:, :, c] for c in range(3)]
    out = [
        np.asarray(Image.fromarray(np.ascontiguousarray(c), "F").resize((tw, th), Image.Resampling.BICUBIC))
        for c in chans
    ]
    y = np.stack(out * 3 if grey else out, axis=2).astype(np.float32)
    return np.clip(y, 0.0, 1.0, out=y)


def preprocess_image(data: bytes, cfg: VisionConfig) -> np.ndarray:
    """Decode, resize to the pixel budget (bicubic), normalise: float32 ``(H, W, 3)``.

    >>> import io
    >>> from PIL import Image
    >>> buf = io.BytesIO(); Image.new("RGB", (100, 50), (255, 0, 0)).save(buf, "PNG")
    >>> x = preprocess_image(buf.getvalue(), VisionConfig(min_pixels=1024, max_pixels=4096))
    >>> x.shape, x.dtype, x[0, 0].tolist()   # (0.5, 0.5, 0.5) mean and std: [-1, 1]
    ((32, 64, 3), dtype('float32'), [1.0, -1.0, -1.0])
    """
    x = _decode_resized(data, cfg)
    if x.dtype == np.uint8:
        x = x.astype(np.float32)
        x *= np.float32(1.0 / 255.0)
    else:
        x = x.copy()
    x -= np.asarray(cfg.mean, dtype=np.float32)
    x /= np.asarray(cfg.std, dtype=np.float32)
    return x


def patchify(
    img: np.ndarray, patch_size: int, temporal_patch_size: int, merge_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(H, W, C)`` -> (patches ``(N, C * pt * ps * ps)`` float32 in block order, grid_thw ``[1, H/ps, W/ps]``).

    The same layout as TorchTitan's ``vision_to_patches(img[None], ..., patch_order="block")``
    (an image is repeated to ``temporal_patch_size`` frames).

    >>> patches, grid = patchify(np.zeros((32, 64, 3), np.float32), 16, 2, 2)
    >>> patches.shape, grid.tolist()
    ((8, 1536), [1, 2, 4])
    """
    H, W, C = img.shape
    ps, ts, m = patch_size, temporal_patch_size, merge_size
    if H % (ps * m) or W % (ps * m):
        raise ValueError(f"image {H}x{W} is not a multiple of patch_size * merge_size = {ps * m}")
    bh, bw = H // (ps * m), W // (ps * m)
    x = np.broadcast_to(img[None], (ts, H, W, C))
    x = x.reshape(1, ts, bh, m, ps, bw, m, ps, C)  # t pt bh m ph bw n pw c
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # t bh bw m n c pt ph pw
    patches = np.ascontiguousarray(x.reshape(bh * bw * m * m, C * ts * ps * ps), dtype=np.float32)
    return patches, np.array([1, H // ps, W // ps], dtype=np.int64)


@functools.lru_cache(maxsize=16)
def _normalise_lut(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """``(3 * 256,)`` float32: channel ``c``, byte ``v`` -> ``(v / 255 - mean[c]) / std[c]``, computed
    with the same float32 operations, in the same order, as :func:`preprocess_image`."""
    v = np.arange(256, dtype=np.float32) * np.float32(1.0 / 255.0)
    out = np.empty((3, 256), np.float32)
    for c in range(3):
        x = v.copy()
        x -= np.float32(mean[c])
        x /= np.float32(std[c])
        out[c] = x
    out.setflags(write=False)
    return out.reshape(-1)


def preprocess_patches(data: bytes, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """``patchify(preprocess_image(data, cfg), ...)`` bit for bit, about twice as fast after decoding.

    Why: normalising a float32 ``(H, W, 3)`` image costs three broadcast passes and patchify a
    fourth copy; here the resized image stays uint8 while it is cut into patches, and one table
    lookup per byte (the table holds the exact float32 result for each byte and channel) writes
    the normalised patches. The worker's hot path uses this; the two-step functions remain the
    readable reference, and the tests check both give the same bytes.

    >>> import io
    >>> from PIL import Image
    >>> buf = io.BytesIO(); Image.new("RGB", (100, 50), (255, 0, 0)).save(buf, "PNG")
    >>> v = VisionConfig(min_pixels=1024, max_pixels=4096)
    >>> p, g = preprocess_patches(buf.getvalue(), v)
    >>> ref, _ = patchify(preprocess_image(buf.getvalue(), v), 16, 2, 2)
    >>> p.shape, g.tolist(), bool(np.array_equal(p, ref))
    ((8, 1536), [1, 2, 4], True)
    """
    u8 = _decode_resized(data, cfg)
    if u8.dtype != np.uint8:  # high bit depth or transparency: float pixels, no table
        x = u8 - np.asarray(cfg.mean, dtype=np.float32)
        x /= np.asarray(cfg.std, dtype=np.float32)
        return patchify(x, cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size)
    H, W, C = u8.shape
    ps, ts, m = cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size
    if H % (ps * m) or W % (ps * m):
        raise ValueError(f"image {H}x{W} is not a multiple of patch_size * merge_size = {ps * m}")
    bh, bw = H // (ps * m), W // (ps * m)
    n = bh * bw * m * m
    idx = np.empty((n, C, ps * ps), np.uint16)  # byte + 256 * channel, in patch order
    idx[...] = u8.reshape(bh, m, ps, bw, m, ps, C).transpose(0, 3, 1, 4, 6, 2, 5).reshape(n, C, ps * ps)
    idx += (np.arange(C, dtype=np.uint16) * 256)[None, :, None]
    one = np.take(_normalise_lut(tuple(cfg.mean), tuple(cfg.std)), idx)  # (n, C, ps*ps) float32
    out = np.empty((n, C, ts, ps * ps), np.float32)
    out[...] = one[:, :, None, :]  # the image repeated to temporal_patch_size frames
    return out.reshape(n, C * ts * ps * ps), np.array([1, H // ps, W // ps], dtype=np.int64)


def mrope_positions(tokens: np.ndarray, image_id: int, grids: np.ndarray, merge_size: int) -> np.ndarray:
    """3D (t, h, w) rotary positions ``(n, 3)`` of one document, as TorchTitan's collator builds
    them: text tokens count up on all three axes; an image's placeholder run gets its merged
    grid coordinates offset by the position where it starts; the text after it resumes at the
    largest position so far + 1.

    >>> tokens = np.array([7, 9, 9, 8])           # text, a 1 x 2 merged image (2 tokens), text
    >>> mrope_positions(tokens, 9, np.array([[1, 2, 4]]), 2).tolist()
    [[0, 0, 0], [1, 1, 1], [1, 1, 2], [3, 3, 3]]
    """
    n = len(tokens)
    out = np.empty((n, 3), dtype=np.int64)
    is_img = tokens == image_id
    cur, i, k = 0, 0, 0
    while i < n:
        if is_img[i] and k < len(grids):
            t, gh, gw = (int(v) for v in grids[k])
            lh, lw = gh // merge_size, gw // merge_size
            cnt = min(t * lh * lw, n - i)
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
            grid = np.stack([tt.ravel(), hh.ravel(), ww.ravel()], axis=1)[:cnt] + cur
            out[i : i + cnt] = grid
            cur = int(grid.max()) + 1
            i += cnt
            k += 1
        else:
            j = i + 1
            while j < n and not is_img[j]:
                j += 1
            out[i:j] = (np.arange(j - i, dtype=np.int64) + cur)[:, None]
            cur += j - i
            i = j
    return out


class LayoutSpan(NamedTuple):
    """One piece of an image-text sample's token sequence: ``kind`` is "bos", "text", "image"
    (a vision block: ``<|vision_start|>``, placeholders, ``<|vision_end|>``) or "eos";
    ``segment`` its index among the record's segments (-1 for BOS/EOS); tokens ``start:stop``."""

    kind: str
    segment: int
    start: int
    stop: int


def sample_layout(lengths: Sequence[tuple[str, int]], *, bos: bool, eos: bool) -> list[LayoutSpan]:
    """The token layout of one image-text sample, the one rule that :class:`FetchVision` builds
    samples by and provenance reads them back with: [BOS], then each segment in record order
    (a caption's text tokens, or an image's vision block), then [EOS].

    ``lengths[j]`` is ``("text", tokens)`` or ``("image", tokens of the block, start and end
    included)`` for segment ``j``.

    >>> [tuple(s) for s in sample_layout([("image", 6), ("text", 3)], bos=True, eos=True)]
    [('bos', -1, 0, 1), ('image', 0, 1, 7), ('text', 1, 7, 10), ('eos', -1, 10, 11)]
    """
    out: list[LayoutSpan] = []
    pos = 0
    if bos:
        out.append(LayoutSpan("bos", -1, 0, 1))
        pos = 1
    for j, (kind, n) in enumerate(lengths):
        if kind not in ("text", "image"):
            raise ValueError(f"a sample segment is 'text' or 'image', got {kind!r}")
        out.append(LayoutSpan(kind, j, pos, pos + int(n)))
        pos += int(n)
    if eos:
        out.append(LayoutSpan("eos", -1, pos, pos + 1))
    return out


class MMDoc(NamedTuple):
    """One sample for :class:`zephon.nodes.MMPack`: tokens with placeholder runs, the
    concatenated patches of its images, their grids, optional MRoPE positions.

    A text document of a mixed recipe is an ``MMDoc`` without images; ``offset`` is where its
    ``tokens`` start in the whole document (a long document planned as several parts), so the
    packer can cite token ranges of the document (provenance).

    >>> import numpy as np
    >>> from zephon.nodes.worksource import WorkItem
    >>> doc = MMDoc(np.arange(5, dtype=np.int32), 0, WorkItem(0, 1, 7, 0, 0))
    >>> doc.num_images, doc.provenance
    (0, 'dataset #0, shard #1, record 7 (epoch 0)')
    """

    tokens: np.ndarray  # int32 (n,)
    dataset: int
    item: WorkItem
    pixel_values: np.ndarray | None = None  # float32 (patches, patch_dim), images in order
    grid_thw: np.ndarray | None = None  # int64 (images, 3)
    mrope: np.ndarray | None = None  # int64 (n, 3)
    skipped: str | None = None
    offset: int = 0  # index of tokens[0] in the whole document's tokens (parts of long text documents)

    @property
    def num_images(self) -> int:
        """How many images the sample has (0 for text)."""
        return 0 if self.grid_thw is None else int(len(self.grid_thw))

    @property
    def provenance(self) -> str:
        """A short human-readable origin (dataset, shard, record, epoch) for error messages."""
        return self.item.provenance


class FetchVision(ProcessLocal):
    """``items -> [MMDoc]`` for a recipe mixing text and image-text datasets.

    ``kinds[d]`` is "text", "image_text" or "interleaved"; ``special`` maps ``image``,
    ``video``, ``vision_start``, ``vision_end`` to token ids; ``row_len`` (seq_len + 1) bounds a
    sample: one with images that is longer is cut after its last image if possible, else
    skipped (counted, the same on every world size). Picklable; cached per process.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        kinds: Sequence[str],
        tokenizer: Any,
        vision: VisionConfig,
        special: dict[str, int],
        *,
        on_error: Sequence[str] | None = None,
        row_len: int,
    ) -> None:
        self.datasets = list(datasets)
        self.kinds = list(kinds)
        self.tokenizer = tokenizer
        self.vision = vision
        self.special = dict(special)
        self.on_error = list(on_error or ["raise"] * len(self.datasets))
        self.row_len = int(row_len)
        self.text = FetchTokenize(self.datasets, tokenizer, self.on_error, align=self.row_len)
        self._special_ids = np.array([self.special[k] for k in SPECIAL_NAMES], dtype=np.int64)
        ProcessLocal.__init__(self)

    # -- per record ---------------------------------------------------------------------------
    def _bad(self, it: WorkItem, rec: Any, reason: str) -> MMDoc:
        """Apply on_error to a bad record: raise (naming dataset, file, key) or a counted skip."""
        file = getattr(rec, "file", None)
        loc = getattr(rec, "locator", None)
        if self.on_error[it.dataset] == "raise":
            name = self.datasets[it.dataset].name
            raise DataError(reason, dataset=name, file=file, locator=loc, fix=skip_hint(name))
        return MMDoc(np.zeros(0, np.int32), it.dataset, it, skipped=f"{reason} ({file}, {loc})")

    def _skip(self, it: WorkItem, reason: str) -> MMDoc:
        return MMDoc(np.zeros(0, np.int32), it.dataset, it, skipped=reason)

    def __call__(self, items: list[WorkItem]) -> list[MMDoc]:
        out: list[MMDoc | None] = [None] * len(items)
        text_idx = [i for i, it in enumerate(items) if self.kinds[it.dataset] == "text"]
        if text_idx:
            for i, doc in zip(text_idx, self.text([items[i] for i in text_idx])):
                out[i] = MMDoc(doc.tokens, doc.dataset, doc.item, skipped=doc.skipped, offset=doc.offset)
        mm_idx = [i for i, it in enumerate(items) if self.kinds[it.dataset] != "text"]
        if not mm_idx:
            return out  # type: ignore[return-value]
        records: dict[int, Any] = {}
        order = sorted(mm_idx, key=lambda i: (items[i].dataset, items[i].shard))
        for (d, s), group in itertools.groupby(order, key=lambda i: (items[i].dataset, items[i].shard)):
            idx = list(group)
            for i, rec in zip(idx, self.datasets[d].read(s, [items[i].record for i in idx])):
                records[i] = rec
        # decode images, collect text segments (one tokenizer call for the chunk)
        texts: list[str] = []
        prepared: dict[int, list[Any]] = {}
        for i in mm_idx:
            it, rec = items[i], records[i]
            if isinstance(rec, BadRecord):
                out[i] = self._bad(it, rec, rec.reason)
                continue
            segs: list[Any] = []
            try:
                for j, seg in enumerate(rec.segments):
                    if isinstance(seg, str):
                        segs.append(("t", len(texts)))
                        texts.append(seg)
                    else:
                        try:
                            segs.append(("i", preprocess_patches(seg, self.vision)))
                        except ImageError as e:
                            n_img = sum(1 for x in rec.segments[:j] if not isinstance(x, str))
                            raise ImageError(f"{e} (image #{n_img + 1} of the sample)") from None
            except ImageError as e:
                out[i] = self._bad(it, rec, str(e))
                continue
            prepared[i] = segs
        encoded = self.tokenizer.encode_content(texts) if texts else []
        for i, segs in prepared.items():
            out[i] = self._assemble(items[i], records[i], segs, encoded)
        return out  # type: ignore[return-value]

    def _assemble(self, it: WorkItem, rec: Any, segs: list[Any], encoded: list[np.ndarray]) -> MMDoc:
        v, sp, tok = self.vision, self.special, self.tokenizer
        m2 = v.merge_size * v.merge_size
        lengths: list[tuple[str, int]] = []
        patches, grids = [], []
        for kind, val in segs:
            if kind == "t":
                ids = encoded[val]
                if ids.size and np.isin(ids, self._special_ids).any():
                    return self._bad(
                        it,
                        rec,
                        "the text contains an image/vision placeholder token; it would "
                        "misalign images and placeholders",
                    )
                lengths.append(("text", len(ids)))
            else:
                p, g = val
                lengths.append(("image", int(g.prod()) // m2 + 2))
                patches.append(p)
                grids.append(g)
        if len(grids) > v.max_images_per_batch or (v.max_images_per_row and len(grids) > v.max_images_per_row):
            limit = "max_images_per_batch" if len(grids) > v.max_images_per_batch else "max_images_per_row"
            return self._skip(it, f"sample has {len(grids)} images, more than [vision].{limit}")
        layout = sample_layout(lengths, bos=tok.add_bos, eos=tok.add_eos)
        n = layout[-1].stop if layout else 0
        tokens = np.empty(n, np.int32)
        for span in layout:
            if span.kind == "text":
                tokens[span.start : span.stop] = encoded[segs[span.segment][1]]
            elif span.kind == "image":
                tokens[span.start] = sp["vision_start"]
                tokens[span.start + 1 : span.stop - 1] = sp["image"]
                tokens[span.stop - 1] = sp["vision_end"]
            else:
                tokens[span.start] = tok.bos_id if span.kind == "bos" else tok.eos_id
        if n > self.row_len:
            last_image_end = max((s.stop for s in layout if s.kind == "image"), default=0)
            if last_image_end > self.row_len:
                return self._skip(
                    it,
                    f"sample too long: {n} tokens with images ending at token {last_image_end}, "
                    f"more than seq_len + 1 = {self.row_len}; raise seq_len or lower [vision].max_pixels",
                )
            tokens = tokens[: self.row_len]  # cut the text after the last image
        if len(patches) == 1:
            pix = patches[0]  # no copy for the common one-image sample
        else:
            pix = np.concatenate(patches) if patches else np.zeros((0, v.patch_dim), np.float32)
        grid = np.stack(grids) if grids else np.zeros((0, 3), np.int64)
        mrope = mrope_positions(tokens, sp["image"], grid, v.merge_size) if v.mrope else None
        return MMDoc(tokens, it.dataset, it, pix, grid, mrope)

    def __repr__(self) -> str:
        return f"FetchVision(datasets={[d.name for d in self.datasets]}, kinds={self.kinds}, vision={self.vision})"
