"""What an image-text read returns (:class:`MMRecord`), the image header probe that lets
indexing count image tokens exactly without decoding pixels (:func:`image_header_size`), and
an image-text index as its format readers see it (:class:`ImageTextStore`)."""

from __future__ import annotations

import io
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .cache import ShardStore
from .errors import DataError
from .resolve import ShardSpec
from .retry import retried_io, transient
from .shardcopy import NodeCopies

__all__ = ["ImageTextStore", "MMRecord", "image_header_size", "value_crc"]

T = TypeVar("T")


def value_crc(v: Any, crc: int = 0) -> int:
    """CRC-32 of a cell's value (bytes, text, None, lists and dicts of them) in one canonical
    encoding (type, length, bytes): what an image-text Parquet read is checked against.

    >>> value_crc([b"ab", None]) == value_crc([b"ab", None]), value_crc(["ab"]) == value_crc([b"ab"])
    (True, False)
    """
    if v is None:
        return zlib.crc32(b"N", crc)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return zlib.crc32(v, zlib.crc32(b"B%d:" % len(v), crc))
    if isinstance(v, str):
        b = v.encode("utf-8", "surrogatepass")
        return zlib.crc32(b, zlib.crc32(b"S%d:" % len(b), crc))
    if isinstance(v, dict):
        crc = zlib.crc32(b"D%d:" % len(v), crc)
        for k in sorted(v, key=str):
            crc = value_crc(v[k], value_crc(str(k), crc))
        return crc
    if isinstance(v, (list, tuple)):
        crc = zlib.crc32(b"L%d:" % len(v), crc)
        for x in v:
            crc = value_crc(x, crc)
        return crc
    return zlib.crc32(repr(v).encode(), zlib.crc32(b"R", crc))


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


class ImageTextStore(NodeCopies, ShardStore):
    """An image-text index as its format readers (:mod:`.wds`, :mod:`.mm_parquet`) see it: the
    shard store, the dataset's fields, errors naming the shard's file, and remote shards read from
    their copies in the node shard cache (:class:`~.shardcopy.NodeCopies`; the base of
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

    def _changed_error(self, s: int, locator: str | None = None, what: str | None = None) -> DataError:
        """The bytes read for ``locator`` are not the ones indexed (their CRC-32 differs), or
        ``what`` changed (a remote object downloaded into the node cache)."""
        return self._err(
            s,
            what
            or "the bytes read are not the ones indexed: the file changed since it was indexed (its size and "
            "modification time may be unchanged, or the index cache is stale)",
            "Do not modify or replace shard files during a run; if it was replaced on purpose, restart so that "
            "it is indexed again (a checkpoint taken on the old content cannot resume on the new).",
            locator,
        )

    def _retrying(self, s: int, doing: str, fn: Callable[[], T]) -> T:
        """``fn()`` (an operation on shard s's file); for a remote file, transient faults (5xx,
        dropped connections, stalls) are retried with backoff inside ``$ZEPHON_IO_RETRY_S``, then
        raised as a DataError naming the URL, as the text readers do."""
        if self._specs[s].local:
            return fn()
        return retried_io(fn, doing, lambda what, fix: self._err(s, what, fix))

    def _transient(self, e: BaseException) -> bool:
        """Whether ``e`` is a storage fault worth retrying (then it is raised as it is)."""
        return transient(e) is not None
