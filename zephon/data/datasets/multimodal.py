"""Image-text datasets: per-shard metadata (record counts, text sizes, image sizes) and reads.

Kinds and formats:

* ``image_text`` in WebDataset-style ``.tar`` shards (format ``"wds"``): members sharing a key
  (the file name up to its first dot) form one sample: an image (any extension Pillow
  opens: ``.jpg``, ``.png``, ``.webp``, ``.gif``, ``.tif``, ...) and a caption (``.txt``, or ``.json`` with the caption under ``text_field``).
  Indexing records every member's byte offset in the tar, so a read is one ``pread`` per
  member: no tar scan at read time.
* ``image_text`` in Parquet (format ``"parquet"``): an image column (``image_field``; binary,
  or Hugging Face's ``{bytes, path}`` struct) and a text column (``text_field``).
* ``interleaved`` in Parquet: OBELICS-style rows with a list of texts (``text_field``, default
  ``texts``) and a list of images (``image_field``, default ``images``) of equal length; at
  each position one of the two is set.
* ``chat`` (vision-language conversations): a record is one conversation and its images; its
  segments are the conversation as JSON text (what :func:`zephon.data.chat.parse_conversation`
  reads), then the images in the order the conversation refers to them. In tar shards
  (:mod:`.wds_chat`: ``key.json`` and ``key.0.jpg``, ``key.1.png``, ...), Parquet (a
  conversation column ``text_field``, default ``messages``, and a list of images
  ``image_field``, default ``images``) or JSON Lines (:mod:`.mm_jsonl`: a conversation object a
  line, image files beside it).

Indexing also reads every image's *header* (width, height and EXIF orientation: no pixel
decoding), so the WorkSource can plan by exact image-token counts. Metadata is cached like the
text index's (one ``.npz`` per shard, keyed by URL, size and mtime).

``read(shard, indices)`` returns :class:`MMRecord` (segments: ``str`` text or ``bytes`` image,
in document order) or :class:`BadRecord` (a caption without an image, a missing field, ...);
image *content* problems are found by the decoder (``zephon.nodes.images``).

Each format is its own module (:mod:`.wds`, :mod:`.wds_chat`, :mod:`.mm_parquet`,
:mod:`.mm_jsonl`); this one is the index that
dispatches to them, and the shared parts live in :mod:`.cache` and :mod:`.resolve`.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .cache import fingerprint, write_npz
from .errors import DataError
from .index import DEFAULT_MAX_RECORD_BYTES
from .mm_jsonl import MMJsonlReader
from .mm_parquet import MMParquetReader
from .resolve import MM_FORMATS, ShardMeta, ShardSpec, mm_shard_specs, open_cache_dir, pick_mm_format, resolve_files
from .samples import ImageTextStore, MMRecord, image_header_size
from .wds import IMAGE_EXTS, TAR_IMAGES, WdsReader
from .wds_chat import WdsChatReader

__all__ = [
    "IMAGE_EXTS",
    "KINDS",
    "MM_FORMATS",
    "MM_KINDS",
    "MMRecord",
    "MultimodalIndex",
    "image_header_size",
    "index_multimodal",
]

KINDS = ("text", "image_text", "interleaved")
#: the kinds :func:`index_multimodal` reads ("chat": vision-language conversations with images)
MM_KINDS = ("chat", "image_text", "interleaved")
_Reader = WdsReader | MMParquetReader | MMJsonlReader
# 2: tar member names (provenance); 3: damaged tar regions as records; 4: CRC-32 per read unit
_CACHE_VERSION = 4


class MultimodalIndex(ImageTextStore):
    """Metadata of one image-text dataset's shards plus thread-safe random-access reads.

    ``record_bytes(s)`` is the text size of each record (bytes); :meth:`image_sizes` gives the
    images' header sizes, from which the recipe computes exact image-token counts.
    :meth:`locate` and :meth:`sources` say where a record and each of its segments are stored
    (provenance).

    >>> import io, os, tarfile, tempfile
    >>> from PIL import Image
    >>> root, png = tempfile.mkdtemp(), io.BytesIO()
    >>> Image.new("RGB", (32, 24)).save(png, "PNG")
    >>> with tarfile.open(os.path.join(root, "shard-0.tar"), "w") as tar:    # a WebDataset shard
    ...     for key, caption in (("a", "a red square"), ("b", "two cats")):
    ...         for name, data in ((f"{key}.png", png.getvalue()), (f"{key}.txt", caption.encode())):
    ...             info = tarfile.TarInfo(name)
    ...             info.size = len(data)
    ...             tar.addfile(info, io.BytesIO(data))
    >>> ix = index_multimodal("pairs", os.path.join(root, "*.tar"), cache_dir=root)
    >>> ix.num_records, ix.record_bytes(0).tolist(), ix.image_sizes(0)[1].tolist()
    (2, [12, 8], [32, 32])
    >>> rec = ix.read(0, [1])[0]
    >>> type(rec.segments[0]).__name__, rec.segments[1], rec.locator
    ('bytes', 'two cats', "key 'b'")
    >>> [(s["kind"], s["member"]) for s in ix.sources(0, 1)]
    [('image', 'b.png'), ('text', 'b.txt')]
    """

    CACHES = {"groups": 4}  # parquet (shard, row group) -> table of the image and text columns

    def __init__(
        self,
        name: str,
        kind: str,
        format: str,
        text_field: str,
        image_field: str,
        specs: list[ShardSpec],
        cache_dir: str | None,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        tar_images: str = "pillow",
    ) -> None:
        self.name, self.kind, self.format = name, kind, format
        self.image_exts = TAR_IMAGES[tar_images]
        self.max_record_bytes = int(max_record_bytes)  # larger samples read back as BadRecord, unread
        self.text_field, self.image_field = text_field, image_field
        self._specs = specs
        self.cache_dir = cache_dir
        self._arrays: dict[int, dict[str, np.ndarray]] = {}
        self._cached: dict[int, bool] = {}  # whether a shard's arrays are in the cache folder
        self._init_runtime()
        for s in range(len(specs)):
            self._arrays[s], self._cached[s] = self._prepare(s)
        self._set_shards(
            [
                ShardMeta(sp.display, int(len(self._arrays[s]["lengths"])), sp.size, sp.version)
                for s, sp in enumerate(specs)
            ]
        )
        self.fingerprint = fingerprint(self.shards, kind, format, text_field, image_field)

    def _init_runtime(self) -> None:
        super()._init_runtime()
        self._reader: _Reader
        if self.format == "wds":
            self._reader = WdsChatReader(self) if self.kind == "chat" else WdsReader(self)
        else:
            self._reader = MMParquetReader(self) if self.format == "parquet" else MMJsonlReader(self)

    def __getstate__(self) -> dict:
        st = super().__getstate__()
        del st["_reader"]
        return st

    def __repr__(self) -> str:
        return (
            f"MultimodalIndex(name={self.name!r}, kind={self.kind!r}, format={self.format!r}, "
            f"shards={len(self.shards)}, num_records={self.num_records})"
        )

    # -- metadata ------------------------------------------------------------------------------
    def record_bytes(self, shard: int) -> np.ndarray:
        """int64 text byte size of every record of ``shard``."""
        return self._shard(shard)["lengths"]

    def image_sizes(self, shard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(images per record, widths, heights): widths/heights flattened in record order;
        0 where the header could not be read."""
        a = self._shard(shard)
        return a["n_img"], a["img_w"], a["img_h"]

    def damaged(self, shard: int) -> list[tuple[int, str]]:
        """The damaged regions of a tar shard: ``(record, reason)`` for each placeholder record
        (empty for intact shards and for Parquet)."""
        return self._reader.damaged(shard)

    # -- cache ---------------------------------------------------------------------------------
    def _cache_path(self, s: int) -> str | None:
        if not self.cache_dir:
            return None
        sp = self._specs[s]
        fields: list[Any] = [self.kind, self.format, self.text_field, self.image_field]
        if self.format == "wds":  # which tar members are images (by data version, Pillow's version)
            fields.append(list(self.image_exts))
        blob = json.dumps(["mm", _CACHE_VERSION, sp.url, *fields, sp.size, sp.version])
        return os.path.join(self.cache_dir, "mm-" + hashlib.sha256(blob.encode()).hexdigest() + ".npz")

    def _load_cached(self, s: int) -> dict[str, np.ndarray] | None:
        path = self._cache_path(s)
        if path is not None and os.path.exists(path):
            try:
                with np.load(path, allow_pickle=False) as z:
                    return {k: z[k] for k in z.files}
            except Exception:
                pass  # corrupt cache: rebuild
        return None

    def _build_arrays(self, s: int) -> dict[str, np.ndarray]:
        return self._reader.build(s)

    def _store(self, s: int, arrays: dict[str, np.ndarray]) -> bool:
        path = self._cache_path(s)
        if path is None or self.cache_dir is None:
            return False
        try:
            write_npz(self.cache_dir, path, arrays, prefix=os.path.basename(path) + ".")  # named as zephon's
            return True
        except OSError as e:
            warnings.warn(f"zephon: cannot write the index cache in {self.cache_dir!r} ({e})", stacklevel=3)
            return False

    def _reload(self, s: int) -> dict[str, np.ndarray]:
        a, self._cached[s] = self._prepare(s)
        if len(a["lengths"]) != self.shards[s].num_records:
            raise self._err(
                s,
                "the file changed since it was indexed",
                "Do not modify shard files during a run; restart so that it is re-indexed.",
            )
        return a

    # -- provenance ----------------------------------------------------------------------------
    def locate(self, shard: int, record: int) -> dict[str, Any]:
        """Where a record lives, from the index alone (no read): ``file``, ``locator`` (``key
        'k'`` for tar shards, ``row N`` 0-based for Parquet, ``line N`` for JSON Lines), and
        ``key`` (tar), ``row`` or ``line``.

        See :meth:`sources` for where each of its segments' bytes are."""
        if not 0 <= shard < len(self.shards):
            raise IndexError(f"dataset '{self.name}': shard {shard} out of range ({len(self.shards)} shards)")
        if not 0 <= record < self.shards[shard].num_records:
            raise IndexError(
                f"dataset '{self.name}': record {record} out of range for shard {shard} "
                f"({self.shards[shard].num_records} records)"
            )
        return {"file": self._specs[shard].display, **self._reader.locate(shard, record)}

    def sources(self, shard: int, record: int) -> list[dict[str, Any]]:
        """Where each segment of a record (in :attr:`MMRecord.segments` order) is stored: one dict
        per segment with ``kind`` ("text" / "image") and

        * tar shards: ``member`` (the tar member's name), ``file_bytes`` (its ``[start, stop)``
          byte range in the tar file: re-read those bytes to get the image file or the caption
          file) and ``field`` (the JSON field of a ``.json`` caption, else None);
        * Parquet: ``column``, ``row`` (0-based in the file), ``list_index`` (the entry of an
          interleaved row's list column, else None) and ``field`` (``"bytes"`` for a Hugging
          Face image struct, else None); ``file_bytes`` is None (Parquet cells are not
          contiguous file bytes);
        * JSON Lines (chat): the line (``line``, ``file_bytes``), then each image file
          (``path``, ``ref``: the path as the record writes it, ``file_bytes``: the whole file).

        Parquet sources read the row (to find the list entries); tar sources do not read."""
        self.locate(shard, record)  # range checks
        return self._reader.sources(shard, record)

    # -- reads ---------------------------------------------------------------------------------
    def read(self, shard: int, indices: Sequence[int]) -> list[Any]:
        """Records ``indices`` of ``shard`` (MMRecord or BadRecord), in the order given."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return []
        n = self.shards[shard].num_records
        if int(idx.min()) < 0 or int(idx.max()) >= n:
            raise IndexError(f"dataset '{self.name}': record index out of range for shard {shard} ({n} records)")
        return self._reader.read(shard, idx)


def index_multimodal(
    name: str,
    path: Any,
    *,
    kind: str = "image_text",
    format: str = "auto",
    text_field: str | None = None,
    image_field: str | None = None,
    cache_dir: str | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    on_error: str = "raise",
    same_file: str = "each",
    tar_images: str = "pillow",
) -> MultimodalIndex:
    """Find the shards of an image-text dataset and build (or load cached) per-shard metadata.

    A tar shard with a garbled header, cut short, or with data after its end-of-archive marker
    raises a :class:`DataError` naming the file and the byte position; with ``on_error =
    "skip"`` each damaged region is indexed as one record that reads back as a
    :class:`BadRecord` (a counted skip), and reading resumes at the next valid header. A sample
    above ``max_record_bytes`` (image and caption together) reads back as a BadRecord, unread.
    ``same_file = "once"`` reads a file reached through several paths (symlinks) once.
    ``tar_images``: which tar members are images, "pillow" (every extension Pillow opens; data
    version 2) or "classic" (``.jpg``/``.jpeg``/``.png``/``.webp``; data version 1).

    ``kind = "chat"``: vision-language conversations (tar, Parquet or JSON Lines; see the module
    docstring); a record reads back as the conversation's JSON text, then its images:

    >>> import io, json, os, tempfile
    >>> from PIL import Image
    >>> root = tempfile.mkdtemp(); os.mkdir(os.path.join(root, "img"))
    >>> Image.new("RGB", (40, 30)).save(os.path.join(root, "img", "cat.png"))
    >>> line = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
    ...                      {"role": "assistant", "content": "A cat."}], "images": ["img/cat.png"]}
    >>> with open(os.path.join(root, "chat.jsonl"), "w") as f:
    ...     _ = f.write(json.dumps(line) + "\\n")
    >>> ix = index_multimodal("vl", os.path.join(root, "*.jsonl"), kind="chat", cache_dir=root)
    >>> ix.image_sizes(0)[0].tolist(), ix.image_sizes(0)[1].tolist(), ix.image_sizes(0)[2].tolist()
    ([1], [40], [30])
    >>> rec = ix.read(0, [0])[0]
    >>> json.loads(rec.segments[0]) == line, rec.segments[1][:4], rec.locator
    (True, b'\\x89PNG', 'line 1')
    """
    if on_error not in ("raise", "skip"):
        raise DataError(f"unknown on_error {on_error!r}", dataset=name, fix='Use on_error = "raise" or "skip".')
    if tar_images not in TAR_IMAGES:
        raise DataError(f"unknown tar_images {tar_images!r}", dataset=name, fix=f"Use one of {sorted(TAR_IMAGES)}.")
    if kind not in MM_KINDS:
        raise DataError(f"unknown kind {kind!r}", dataset=name, fix=f"Use kind = one of {', '.join(MM_KINDS)}.")
    files = resolve_files(name, path, "auto")
    fmt = _kind_format(name, kind, pick_mm_format(name, files, format))
    if text_field is None:
        text_field = {"interleaved": "texts", "chat": "messages"}.get(kind, "caption")
    if image_field is None:
        image_field = "image" if kind == "image_text" else "images"
    cache_dir = open_cache_dir(cache_dir, warn=False)
    ix = MultimodalIndex(
        name,
        kind,
        fmt,
        text_field,
        image_field,
        mm_shard_specs(files, same_file),
        cache_dir,
        max_record_bytes,
        tar_images,
    )
    if on_error == "raise":
        for s in range(len(ix.shards)):
            bad = ix.damaged(s)
            if bad:
                raise DataError(
                    bad[0][1] + (f" ({len(bad)} damaged regions in this shard)" if len(bad) > 1 else ""),
                    dataset=name,
                    file=ix.shards[s].path,
                    fix="Re-create or re-copy the shard, remove it from the dataset's path list, or set "
                    f"on_error = \"skip\" for dataset '{name}' to skip each damaged region as one counted bad record.",
                )
    return ix


def _kind_format(name: str, kind: str, fmt: str) -> str:
    """``fmt``, refused where the kind is not read from it (interleaved: Parquet only; JSON
    Lines: chat records only)."""
    if kind == "interleaved" and fmt != "parquet":
        raise DataError(
            "interleaved documents are read from Parquet only",
            dataset=name,
            fix='Store them as Parquet rows with list columns (texts, images), format = "parquet".',
        )
    if fmt == "jsonl" and kind != "chat":
        raise DataError(
            f"{kind} samples are not read from JSON Lines (only chat records are)",
            dataset=name,
            fix='Store them as tar (format = "wds") or Parquet shards, or set kind = "chat" for conversations.',
        )
    return fmt
