"""What an image-text read returns (:class:`MMRecord`), the image header probe that lets
indexing count image tokens exactly without decoding pixels (:func:`image_header_size`), and
an image-text index as its format readers see it (:class:`ImageTextStore`)."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cache import ShardStore
from .errors import DataError
from .resolve import ShardSpec

__all__ = ["ImageTextStore", "MMRecord", "image_header_size"]


@dataclass(frozen=True)
class MMRecord:
    """One sample: text (``str``) and image (``bytes``) segments in document order."""

    segments: tuple[Any, ...]
    file: str
    locator: str  # "key 'abc'" (tar) or "row N" (parquet, 0-based)

    @property
    def num_images(self) -> int:
        """How many of the segments are images.

        >>> MMRecord((b"<png>", "a caption"), "a.tar", "key 'k'").num_images
        1
        """
        return sum(1 for s in self.segments if isinstance(s, (bytes, bytearray)))


def image_header_size(data: bytes) -> tuple[int, int]:
    """(width, height) after EXIF orientation, from the header only; (0, 0) if unreadable.

    Why the header only: indexing a corpus must not decode every image, yet the planner needs
    exact image-token counts.

    >>> import io
    >>> from PIL import Image
    >>> buf = io.BytesIO(); Image.new("RGB", (40, 30)).save(buf, "JPEG")
    >>> image_header_size(buf.getvalue()), image_header_size(b"not an image")
    ((40, 30), (0, 0))
    """
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as im:
                w, h = im.size
                try:
                    orient = im.getexif().get(0x0112, 1)
                except Exception:
                    orient = 1
        if orient in (5, 6, 7, 8):
            w, h = h, w
        return int(w), int(h)
    except Exception:  # Pillow raises many types on bad data (incl. DecompressionBombError)
        return 0, 0


class ImageTextStore(ShardStore):
    """An image-text index as its format readers (:mod:`.wds`, :mod:`.mm_parquet`) see it: the
    shard store, the dataset's fields, and errors naming the shard's file (the base of
    :class:`~zephon.data.datasets.multimodal.MultimodalIndex`)."""

    kind: str
    format: str
    text_field: str
    image_field: str
    #: tar member extensions read as images (see :data:`zephon.data.datasets.wds.TAR_IMAGES`)
    image_exts: tuple[str, ...]
    max_record_bytes: int
    _specs: list[ShardSpec]
    _arrays: dict[int, dict[str, np.ndarray]]

    def _err(self, s: int, reason: str, fix: str) -> DataError:
        return DataError(reason, dataset=self.name, file=self._specs[s].display, fix=fix)
