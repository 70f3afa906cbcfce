"""Per-image steps, plain functions any loader can call: decode (:func:`decode_pixels`, one rule
for every mode and bit depth), resize (:func:`smart_resize`), normalise and patchify into
TorchTitan's patch layout (:func:`preprocess_patches`), with the image settings of a recipe's
``[vision]`` section (:class:`VisionConfig`). :mod:`zephon.nodes.vision` runs them on the mapper.

Every step is deterministic integer or IEEE float32 arithmetic in one library (Pillow's bicubic
resampling, numpy's elementwise float32 ops), so the bytes do not depend on threads, processes or
runs. A bad image (corrupt, truncated, zero pixels, above ``max_image_pixels``, checked from the
header *before* decoding) raises :class:`ImageError`.
"""

from __future__ import annotations

import functools
import io
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DECODE_RULES",
    "ImageError",
    "VisionConfig",
    "decode_image",
    "decode_pixels",
    "patchify",
    "preprocess_image",
    "preprocess_patches",
    "smart_resize",
]

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

    def check(self) -> None:
        """Refuse settings no image can meet: an image fits at least one merged patch, and
        ``min_pixels <= max_pixels`` (ValueError naming the key and the fix)."""
        factor = self.factor
        if self.max_pixels < factor * factor:
            raise ValueError(
                f"[vision].max_pixels = {self.max_pixels} is below one merged patch ({factor}x{factor} = "
                f"{factor * factor} pixels for patch_size {self.patch_size} x merge_size {self.merge_size}); "
                "raise max_pixels"
            )
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"[vision].min_pixels = {self.min_pixels} is above max_pixels = {self.max_pixels}; lower min_pixels"
            )

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
    zephon.nodes.images.ImageError: the image is above max_image_pixels (40x30 = 1200 pixels > 1000; a decompression bomb or an absurd size)
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
