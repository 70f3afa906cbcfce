"""``kind = "image_size"``: keep an image-text sample whose every image, as decoded (EXIF
orientation applied), has its shorter side at least ``min_side`` and its longer side at most
``max_side`` pixels. Read from the image's header, before any pixel is decoded; an image that
cannot be read is left to the encoder, which reports it under the dataset's ``on_error``."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

from PIL import Image

from .rule import FilterVerdict, Record, RuleStage, rule_class

__all__ = ["ImageSizeRule", "decoded_size"]

#: EXIF orientations that swap width and height (transposed or rotated by 90 degrees)
_SWAPPED = (5, 6, 7, 8)


def decoded_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` of encoded image ``data`` as decoded (EXIF orientation applied); None
    when Pillow cannot read its header."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            im = Image.open(io.BytesIO(data))
            w, h = im.size
            turned = im.getexif().get(0x0112) in _SWAPPED
    except Exception:
        return None
    return (h, w) if turned else (w, h)


@rule_class("image_size")
class ImageSizeRule(RuleStage):
    """``params``: ``min_side`` and/or ``max_side`` (pixels)."""

    needs_text = False

    def __call__(self, rec: Record, count_tokens: Callable[[str], int] = len) -> FilterVerdict | None:
        lo, hi = self.params.get("min_side", 0), self.params.get("max_side")
        for seg in getattr(rec.value, "segments", ()):
            if isinstance(seg, str):
                continue
            size = decoded_size(seg)
            if size is None:
                continue  # the encoder reports it
            if min(size) < lo or (hi is not None and max(size) > hi):
                return FilterVerdict(self.name)
        return None
