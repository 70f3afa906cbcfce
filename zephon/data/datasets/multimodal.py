"""Image-text datasets: per-shard metadata (record counts, text sizes, image sizes) and reads.

Kinds and formats:

* ``image_text`` in WebDataset-style ``.tar`` shards (format ``"wds"``): members sharing a key
  (the file name up to its first dot) form one sample: an image (``.jpg``/``.jpeg``/``.png``/
  ``.webp``) and a caption (``.txt``, or ``.json`` with the caption under ``text_field``).
  Indexing records every member's byte offset in the tar, so a read is one ``pread`` per
  member: no tar scan at read time.
* ``image_text`` in Parquet (format ``"parquet"``): an image column (``image_field``; binary,
  or Hugging Face's ``{bytes, path}`` struct) and a text column (``text_field``).
* ``interleaved`` in Parquet: OBELICS-style rows with a list of texts (``text_field``, default
  ``texts``) and a list of images (``image_field``, default ``images``) of equal length; at
  each position one of the two is set.

Indexing also reads every image's *header* (width, height and EXIF orientation: no pixel
decoding), so the WorkSource can plan by exact image-token counts. Metadata is cached like the
text index's (one ``.npz`` per shard, keyed by URL, size and mtime).

``read(shard, indices)`` returns :class:`MMRecord` (segments: ``str`` text or ``bytes`` image,
in document order) or :class:`BadRecord` (a caption without an image, a missing field, ...);
image *content* problems are found by the decoder (``zephon.nodes.vision``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._scan import LRU
from .errors import BadRecord, DataError
from .index import DEFAULT_MAX_RECORD_BYTES, ShardMeta, resolve_files

__all__ = ["IMAGE_EXTS", "KINDS", "MM_FORMATS", "MMRecord", "MultimodalIndex", "image_header_size", "index_multimodal"]

KINDS = ("text", "image_text", "interleaved")
MM_FORMATS = ("wds", "parquet")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
TEXT_EXTS = ("txt", "json")
_CACHE_VERSION = 3  # 2: tar member names (provenance); 3: damaged tar regions as records
_BLOCK = 512
# what a damaged tar region is, in its record's BadRecord (the array "damage_kind")
_GARBLED, _TRUNCATED, _TRAILING = 1, 2, 3


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


def _pick_format(name: str, files, fmt: str) -> str:
    exts = set()
    for _fs, fp, _info, _forced in files:
        low = fp.lower()
        exts.add("wds" if low.endswith(".tar") else "parquet" if low.endswith(".parquet") else low.rsplit(".", 1)[-1])
    if fmt == "auto":
        if len(exts) != 1 or next(iter(exts)) not in MM_FORMATS:
            raise DataError(
                f"cannot infer the image-text format from the file extensions {sorted(exts)}",
                dataset=name,
                fix='Use .tar (WebDataset) or .parquet shards, or set format = "wds" / "parquet" for this dataset.',
            )
        return next(iter(exts))
    if fmt not in MM_FORMATS:
        raise DataError(
            f"format {fmt!r} is not an image-text format",
            dataset=name,
            fix='Set format = "wds" (tar shards) or "parquet" (or "auto") for this dataset.',
        )
    return fmt


class MultimodalIndex:
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

    def __init__(
        self,
        name: str,
        kind: str,
        format: str,
        text_field: str,
        image_field: str,
        files: list[tuple[Any, str, str, int, str]],
        cache_dir: str | None,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        self.name, self.kind, self.format = name, kind, format
        self.max_record_bytes = int(max_record_bytes)  # larger samples read back as BadRecord, unread
        self.text_field, self.image_field = text_field, image_field
        self._files = files  # (fs, fspath, display, size, version)
        self.cache_dir = cache_dir
        self._arrays: dict[int, dict[str, np.ndarray]] = {}
        self._cached: dict[int, bool] = {}  # whether a shard's arrays are in the cache folder
        self._init_runtime()
        for s in range(len(files)):
            self._arrays[s], self._cached[s] = self._prepare(s)
        self.shards = [ShardMeta(f[2], int(len(self._arrays[s]["lengths"])), f[3], f[4]) for s, f in enumerate(files)]
        self._offsets = np.zeros(len(self.shards) + 1, np.int64)
        np.cumsum([m.num_records for m in self.shards], out=self._offsets[1:])
        self.num_records = int(self._offsets[-1])
        rows = [[m.path, m.size_bytes, m.version, kind, format, text_field, image_field] for m in self.shards]
        self.fingerprint = hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()

    def _init_runtime(self) -> None:
        self._lock = threading.RLock()
        self._groups = LRU(4)

    # -- pickling: a small handle; arrays in the cache folder reload lazily where unpickled -----
    def __getstate__(self) -> dict:
        # Why: process workers get the work function (and this index) with every task; the
        # member table of a tar corpus is hundreds of KB (648 KB measured for 3,200 pairs)
        st = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_groups")}
        st["_arrays"] = {s: a for s, a in self._arrays.items() if not self._cached.get(s)}
        return st

    def __setstate__(self, st: dict) -> None:
        self.__dict__.update(st)
        self._init_runtime()

    def __repr__(self) -> str:
        return (
            f"MultimodalIndex(name={self.name!r}, kind={self.kind!r}, format={self.format!r}, "
            f"shards={len(self.shards)}, num_records={self.num_records})"
        )

    # -- metadata ------------------------------------------------------------------------------
    def shard_offsets(self) -> np.ndarray:
        """int64 ``[shards + 1]``: the global index of each shard's first record, then the total."""
        return self._offsets.copy()

    def record_bytes(self, shard: int) -> np.ndarray:
        """int64 text byte size of every record of ``shard``."""
        return self._shard(shard)["lengths"]

    def image_sizes(self, shard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(images per record, widths, heights): widths/heights flattened in record order;
        0 where the header could not be read."""
        a = self._shard(shard)
        return a["n_img"], a["img_w"], a["img_h"]

    # -- cache ---------------------------------------------------------------------------------
    def _cache_path(self, s: int) -> str | None:
        if not self.cache_dir:
            return None
        fs, fp, disp, size, version = self._files[s]
        blob = json.dumps(
            [
                "mm",
                _CACHE_VERSION,
                fs.unstrip_protocol(fp),
                self.kind,
                self.format,
                self.text_field,
                self.image_field,
                size,
                version,
            ]
        )
        return os.path.join(self.cache_dir, "mm-" + hashlib.sha256(blob.encode()).hexdigest() + ".npz")

    def _shard(self, s: int) -> dict[str, np.ndarray]:
        """Shard ``s``'s index arrays (reloaded from the cache folder in an unpickled copy)."""
        a = self._arrays.get(s)
        if a is not None:
            return a
        with self._lock:
            a = self._arrays.get(s)
            if a is None:
                a, self._cached[s] = self._prepare(s)
                if len(a["lengths"]) != self.shards[s].num_records:
                    raise self._err(
                        s,
                        "the file changed since it was indexed",
                        "Do not modify shard files during a run; restart so that it is re-indexed.",
                    )
                self._arrays[s] = a
            return a

    def _prepare(self, s: int) -> tuple[dict[str, np.ndarray], bool]:
        """(index arrays of shard ``s``, whether they are in the cache folder)."""
        path = self._cache_path(s)
        if path is not None and os.path.exists(path):
            try:
                with np.load(path, allow_pickle=False) as z:
                    return {k: z[k] for k in z.files}, True
            except Exception:
                pass  # corrupt cache: rebuild
        arrays = self._index_wds(s) if self.format == "wds" else self._index_parquet(s)
        if path is not None:
            try:
                fd, tmp = tempfile.mkstemp(dir=self.cache_dir, suffix=".tmp")
                with os.fdopen(fd, "wb") as f:
                    np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
                os.replace(tmp, path)
                return arrays, True
            except OSError as e:
                warnings.warn(f"zephon: cannot write the index cache in {self.cache_dir!r} ({e})", stacklevel=3)
        return arrays, False

    def _err(self, s: int, reason: str, fix: str) -> DataError:
        return DataError(reason, dataset=self.name, file=self._files[s][2], fix=fix)

    def _open(self, s: int):
        fs, fp = self._files[s][0], self._files[s][1]
        try:
            return fs.open(fp, "rb")
        except OSError as e:
            raise self._err(
                s, f"cannot open the file ({type(e).__name__}: {e})", "Check the path and its permissions."
            ) from None

    def _read_range(self, s: int, off: int, n: int) -> bytes:
        fs, fp = self._files[s][0], self._files[s][1]
        from fsspec.implementations.local import LocalFileSystem

        try:
            if isinstance(fs, LocalFileSystem):
                st = os.stat(fp)
                if st.st_size != self._files[s][3] or str(st.st_mtime_ns) != self._files[s][4]:
                    raise self._err(
                        s,
                        "the file changed since it was indexed",
                        "Do not modify shard files during a run; restart so that it is re-indexed.",
                    )
                fd = os.open(fp, os.O_RDONLY)
                try:
                    data = os.pread(fd, n, off)
                finally:
                    os.close(fd)
            else:
                data = fs.cat_file(fp, start=off, end=off + n)
        except OSError as e:
            raise self._err(
                s,
                f"I/O error while reading it ({type(e).__name__}: {e})",
                "Check that the storage is reachable and the file is intact, then retry.",
            ) from None
        if len(data) != n:
            raise self._err(
                s,
                "the file is shorter than its index says (truncated or changed)",
                "Re-copy the shard, or restart so that it is re-indexed.",
            )
        return data

    # -- WebDataset tar ------------------------------------------------------------------------
    def _tar_resync(self, f, start: int) -> int | None:
        """The offset of the first valid tar header at or after ``start`` (512-byte aligned),
        or None: where reading resumes after a garbled header."""
        import tarfile

        pos = start
        step = 1 << 20
        while True:
            f.seek(pos)
            buf = f.read(step)
            n = len(buf) // _BLOCK
            if n == 0:
                return None
            blocks = np.frombuffer(buf, dtype=np.uint8, count=n * _BLOCK).reshape(n, _BLOCK)
            # ustar / GNU / pax headers carry the magic "ustar" at byte 257: test only those
            for i in np.flatnonzero((blocks[:, 257:262] == np.frombuffer(b"ustar", np.uint8)).all(axis=1)).tolist():
                try:
                    tarfile.TarInfo.frombuf(bytes(blocks[i]), "utf-8", "surrogateescape")
                except tarfile.HeaderError:
                    continue
                return pos + i * _BLOCK
            pos += n * _BLOCK

    def _tar_members(self, s: int, f) -> tuple[list[Any], dict[Any, dict[str, Any]]]:
        """Every sample of a tar shard in file order, and the damaged regions between them.

        A garbled header, a file cut short, or data after the end-of-archive marker would make
        ``tarfile`` end the archive early without a word; here each is a placeholder record
        (its key a tuple ``("damage", byte)``) that reads back as a :class:`BadRecord` naming the
        byte position, and reading resumes at the next valid header."""
        import tarfile

        order: list[Any] = []
        members: dict[Any, dict[str, Any]] = {}
        f.seek(0, os.SEEK_END)
        size = f.tell()
        pos = 0

        def damage(at: int, kind: int, until: int) -> None:
            key = ("damage", at)
            order.append(key)
            members[key] = {"damage": (at, kind, until)}

        while True:
            f.seek(pos)
            try:
                tf = tarfile.open(fileobj=f, mode="r:")
            except tarfile.ReadError as e:
                if pos == 0:
                    raise self._err(
                        s,
                        f"not a valid tar file (corrupt or truncated?): {e}",
                        "Re-create or re-copy the shard, or remove it from the dataset's path list.",
                    ) from None
                tf = None
            last_end = pos
            cut = False
            if tf is not None:
                try:
                    for m in tf:
                        if m.offset_data + m.size > size:  # its data runs past the end of the file
                            cut = True
                            break
                        last_end = m.offset_data + -(-m.size // _BLOCK) * _BLOCK
                        if not m.isfile():
                            continue
                        d, _, base = m.name.rpartition("/")
                        if base.startswith(".") or "." not in base:
                            continue
                        stem, ext = base.split(".", 1)
                        key = f"{d}/{stem}" if d else stem
                        ext = ext.lower()
                        slot = "image" if ext in IMAGE_EXTS else "text" if ext in TEXT_EXTS else None
                        if slot is None:
                            continue
                        if key not in members:
                            members[key] = {}
                            order.append(key)
                        members[key].setdefault(slot, (m.offset_data, m.size, ext, m.name))
                except (tarfile.ReadError, EOFError):
                    cut = True
                except tarfile.TarError as e:
                    raise self._err(
                        s,
                        f"not a valid tar file (corrupt?): {e}",
                        "Re-create or re-copy the shard, or remove it from the dataset's path list.",
                    ) from None
                end = last_end if cut else max(tf.offset, last_end)
            else:
                end = pos
            if cut:  # a member's header or data runs past the end of the file
                damage(last_end, _TRUNCATED, size)
                break
            if end >= size:  # no end-of-archive marker after the last member
                damage(size, _TRUNCATED, size)
                break
            if size - end < _BLOCK:  # the file ends inside a header block
                damage(end, _TRUNCATED, size)
                break
            f.seek(end)
            tail = f.read(1 << 16)
            zeros = len(tail) - len(tail.lstrip(b"\0"))
            if zeros >= _BLOCK:  # the end-of-archive marker: only zeros may follow it
                rest, at = tail[zeros:], end + zeros
                while not rest:
                    more = f.read(1 << 20)
                    if not more:
                        break
                    stripped = more.lstrip(b"\0")
                    at += len(more) - len(stripped)
                    rest = stripped
                if not rest:
                    break  # a well-formed end
                nxt = self._tar_resync(f, end + -(-zeros // _BLOCK) * _BLOCK)
                damage(at, _TRAILING, size if nxt is None else nxt)
                if nxt is None:
                    break
                pos = nxt
                continue
            # a header that tarfile could not read: skip to the next valid one
            nxt = self._tar_resync(f, end + _BLOCK)
            damage(end, _GARBLED, size if nxt is None else nxt)
            if nxt is None:
                break
            pos = nxt
        return order, members

    def _index_wds(self, s: int) -> dict[str, np.ndarray]:
        f = self._open(s)
        try:
            order, members = self._tar_members(s, f)
        finally:
            f.close()
        n = len(order)
        a = {k: np.full(n, -1, np.int64) for k in ("img_off", "img_len", "txt_off", "txt_len", "damage", "damage_end")}
        a["txt_json"] = np.zeros(n, np.int64)
        a["damage_kind"] = np.zeros(n, np.int64)
        widths, heights = [], []
        names = {"img_name": [""] * n, "txt_name": [""] * n}
        keys: list[str] = []
        for i, key in enumerate(order):
            got = members[key]
            if "damage" in got:
                at, kind, until = got["damage"]
                a["damage"][i], a["damage_kind"][i], a["damage_end"][i] = at, kind, until
                keys.append(f"<damaged tar region at byte {at}>")
                continue
            keys.append(key)
            for slot in ("image", "text"):
                if slot in got:
                    names["img_name" if slot == "image" else "txt_name"][i] = got[slot][3]
            if "image" in got:
                a["img_off"][i], a["img_len"][i] = got["image"][0], got["image"][1]
                w, h = image_header_size(self._read_range(s, got["image"][0], min(got["image"][1], 1 << 16)))
                if (w, h) == (0, 0) and got["image"][1] > (1 << 16):
                    w, h = image_header_size(self._read_range(s, got["image"][0], got["image"][1]))
                widths.append(w)
                heights.append(h)
            if "text" in got:
                a["txt_off"][i], a["txt_len"][i] = got["text"][0], got["text"][1]
                a["txt_json"][i] = 1 if got["text"][2] == "json" else 0
        a["keys"] = np.array(keys, dtype=np.str_) if keys else np.zeros(0, dtype="<U1")
        for k, v in names.items():
            a[k] = np.array(v, dtype=np.str_) if v else np.zeros(0, dtype="<U1")
        a["lengths"] = np.maximum(a["txt_len"], 0)
        a["n_img"] = (a["img_len"] >= 0).astype(np.int64)
        a["img_w"], a["img_h"] = np.array(widths, np.int64), np.array(heights, np.int64)
        return a

    def damaged(self, shard: int) -> list[tuple[int, str]]:
        """The damaged regions of a tar shard: ``(record, reason)`` for each placeholder record
        (empty for intact shards and for Parquet)."""
        a = self._arrays[shard]
        if "damage" not in a:
            return []
        return [(int(i), self._damage_reason(shard, int(i))) for i in np.flatnonzero(a["damage"] >= 0)]

    def _damage_reason(self, s: int, i: int) -> str:
        a = self._arrays[s]
        at, kind, until = int(a["damage"][i]), int(a["damage_kind"][i]), int(a["damage_end"][i])
        size = self._files[s][3]
        if kind == _GARBLED:
            rest = (
                f"reading resumed at the next valid header, byte {until}"
                if until < size
                else "no valid header follows it"
            )
            return f"garbled tar header at byte {at}: the samples stored from there to byte {until} are lost ({rest})"
        if kind == _TRAILING:
            return f"data after the tar's end-of-archive marker, at byte {at} (samples stored there are not indexed)"
        if at >= size:
            return f"the tar file ends at byte {at} without its end-of-archive marker: it was cut short, samples may be missing"
        return f"the tar file is cut short at byte {at}: the member stored there, and any after it, are missing"

    def _read_wds(self, s: int, idx: np.ndarray) -> list[Any]:
        a = self._shard(s)
        disp = self._files[s][2]
        out: list[Any] = []
        for i in idx.tolist():
            key = str(a["keys"][i])
            loc = f"key '{key}'"
            if "damage" in a and a["damage"][i] >= 0:
                out.append(BadRecord(self.name, disp, f"byte {int(a['damage'][i])}", self._damage_reason(s, i)))
                continue
            total = int(a["img_len"][i]) + max(0, int(a["txt_len"][i]))
            if total > self.max_record_bytes:
                out.append(
                    BadRecord(
                        self.name,
                        disp,
                        loc,
                        f"the sample is {total} bytes, more than max_record_bytes = {self.max_record_bytes} (the "
                        f"per-record size limit); it was not read. Raise max_record_bytes for dataset '{self.name}'",
                    )
                )
                continue
            if a["img_len"][i] < 0:
                out.append(
                    BadRecord(self.name, disp, loc, "the sample has a caption but no image (.jpg/.jpeg/.png/.webp)")
                )
                continue
            if a["txt_len"][i] < 0:
                out.append(BadRecord(self.name, disp, loc, "the sample has an image but no caption (.txt/.json)"))
                continue
            img = self._read_range(s, int(a["img_off"][i]), int(a["img_len"][i]))
            raw = self._read_range(s, int(a["txt_off"][i]), int(a["txt_len"][i]))
            try:
                text = raw.decode("utf-8")
                if a["txt_json"][i]:
                    obj = json.loads(text)
                    if not isinstance(obj, dict) or not isinstance(obj.get(self.text_field), str):
                        out.append(
                            BadRecord(
                                self.name, disp, loc, f"the .json caption has no string field '{self.text_field}'"
                            )
                        )
                        continue
                    text = obj[self.text_field]
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                out.append(BadRecord(self.name, disp, loc, f"unreadable caption ({type(e).__name__}: {e})"))
                continue
            out.append(MMRecord((img, text), disp, loc))
        return out

    # -- Parquet -------------------------------------------------------------------------------
    def _parquet(self, s: int):
        import pyarrow.parquet as pq

        fs, fp = self._files[s][0], self._files[s][1]
        try:
            # pages written with a CRC are verified: a corrupted page raises instead of being used
            return pq.ParquetFile(fs.open(fp, "rb"), page_checksum_verification=True)
        except Exception as e:
            raise self._err(s, f"not a valid Parquet file: {e}", "Re-download or rewrite the file.") from None

    def _columns(self, s: int, pf) -> tuple[str, str]:
        names = pf.schema_arrow.names
        for col in (self.image_field, self.text_field):
            if col not in names:
                key = "image_field" if col == self.image_field else "text_field"
                raise self._err(
                    s,
                    f"column '{col}' not found (columns: {', '.join(map(repr, names[:20]))})",
                    f"Set {key} = \"<column>\" for dataset '{self.name}' in the recipe.",
                )
        return self.image_field, self.text_field

    @staticmethod
    def _image_bytes(v: Any) -> bytes | None:
        if isinstance(v, dict):  # Hugging Face Image feature
            v = v.get("bytes")
        if v is None:
            return None
        return bytes(v)

    def _record_from_row(self, img: Any, txt: Any) -> tuple[tuple[Any, ...] | None, str | None]:
        """(segments, None) or (None, reason)."""
        if self.kind == "interleaved":
            if not isinstance(txt, list) or not isinstance(img, list):
                return None, f"'{self.text_field}' and '{self.image_field}' must both be lists"
            if len(txt) != len(img):
                return None, f"'{self.text_field}' has {len(txt)} entries but '{self.image_field}' has {len(img)}"
            segs: list[Any] = [seg for _, seg in self._interleaved(img, txt)]
            if not any(isinstance(x, bytes) for x in segs) and not any(isinstance(x, str) and x.strip() for x in segs):
                return None, "the document has neither text nor images"
            return tuple(segs), None
        b = self._image_bytes(img)
        if b is None:
            return None, f"the image ('{self.image_field}') is null"
        if not isinstance(txt, str):
            return None, f"the caption ('{self.text_field}') is {'null' if txt is None else type(txt).__name__}"
        return (b, txt), None

    def _interleaved(self, img: list[Any], txt: list[Any]) -> list[tuple[int, Any]]:
        """(list index, segment) of an interleaved row's kept entries: the image where one is
        set, else the text where it is a string."""
        out: list[tuple[int, Any]] = []
        for j, (t, im) in enumerate(zip(txt, img)):
            b = self._image_bytes(im)
            if b is not None:
                out.append((j, b))
            elif isinstance(t, str):
                out.append((j, t))
        return out

    def _index_parquet(self, s: int) -> dict[str, np.ndarray]:
        pf = self._parquet(s)
        ic, tc = self._columns(s, pf)
        md = pf.metadata
        counts, lengths, n_img, ws, hs = [], [], [], [], []
        for rg in range(md.num_row_groups):
            t = pf.read_row_group(rg, columns=[ic, tc])
            counts.append(t.num_rows)
            for img, txt in zip(t.column(ic).to_pylist(), t.column(tc).to_pylist()):
                segs, _bad = self._record_from_row(img, txt)
                segs = segs or ()
                lengths.append(sum(len(x.encode("utf-8")) for x in segs if isinstance(x, str)))
                k = 0
                for x in segs:
                    if isinstance(x, bytes):
                        w, h = image_header_size(x)
                        ws.append(w)
                        hs.append(h)
                        k += 1
                n_img.append(k)
        groups = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=groups[1:])
        return {
            "groups": groups,
            "lengths": np.array(lengths, np.int64),
            "n_img": np.array(n_img, np.int64),
            "img_w": np.array(ws, np.int64),
            "img_h": np.array(hs, np.int64),
        }

    def _read_parquet(self, s: int, idx: np.ndarray) -> list[Any]:
        import pyarrow as pa

        groups = self._shard(s)["groups"]
        rg_of = np.searchsorted(groups, idx, side="right") - 1
        out: list[Any] = [None] * idx.size
        disp = self._files[s][2]
        for rg in np.unique(rg_of).tolist():

            def load(rg=rg):
                pf = self._parquet(s)
                return pf.read_row_group(rg, columns=[self.image_field, self.text_field])

            t = self._groups.get((s, rg), load)
            ks = np.flatnonzero(rg_of == rg)
            take = pa.array(idx[ks] - groups[rg])
            imgs = t.column(self.image_field).take(take).to_pylist()
            txts = t.column(self.text_field).take(take).to_pylist()
            for k, img, txt in zip(ks.tolist(), imgs, txts):
                segs, bad = self._record_from_row(img, txt)
                loc = f"row {int(idx[k])}"
                out[k] = (
                    MMRecord(segs, disp, loc)
                    if bad is None and segs is not None
                    else BadRecord(self.name, disp, loc, bad or "unreadable")
                )
        return out

    # -- provenance ----------------------------------------------------------------------------
    def locate(self, shard: int, record: int) -> dict[str, Any]:
        """Where a record lives, from the index alone (no read): ``file``, ``locator`` (``key
        'k'`` for tar shards, ``row N`` 0-based for Parquet), and ``key`` (tar) or ``row``.

        See :meth:`sources` for where each of its segments' bytes are."""
        if not 0 <= shard < len(self.shards):
            raise IndexError(f"dataset '{self.name}': shard {shard} out of range ({len(self.shards)} shards)")
        if not 0 <= record < self.shards[shard].num_records:
            raise IndexError(
                f"dataset '{self.name}': record {record} out of range for shard {shard} "
                f"({self.shards[shard].num_records} records)"
            )
        out: dict[str, Any] = {"file": self._files[shard][2]}
        if self.format == "wds":
            key = str(self._shard(shard)["keys"][record])
            out.update(locator=f"key '{key}'", key=key)
        else:
            out.update(locator=f"row {record}", row=int(record))
        return out

    def sources(self, shard: int, record: int) -> list[dict[str, Any]]:
        """Where each segment of a record (in :attr:`MMRecord.segments` order) is stored: one dict
        per segment with ``kind`` ("text" / "image") and

        * tar shards: ``member`` (the tar member's name), ``file_bytes`` (its ``[start, stop)``
          byte range in the tar file: re-read those bytes to get the image file or the caption
          file) and ``field`` (the JSON field of a ``.json`` caption, else None);
        * Parquet: ``column``, ``row`` (0-based in the file), ``list_index`` (the entry of an
          interleaved row's list column, else None) and ``field`` (``"bytes"`` for a Hugging
          Face image struct, else None); ``file_bytes`` is None (Parquet cells are not
          contiguous file bytes).

        Parquet sources read the row (to find the list entries); tar sources do not read."""
        loc = self.locate(shard, record)
        if self.format == "wds":
            a = self._shard(shard)
            out = []
            for slot, kind in (("img", "image"), ("txt", "text")):
                off, n = int(a[f"{slot}_off"][record]), int(a[f"{slot}_len"][record])
                if n < 0:
                    continue
                name = str(a[f"{slot}_name"][record]) if f"{slot}_name" in a else ""
                field = self.text_field if kind == "text" and a["txt_json"][record] else None
                out.append({"kind": kind, "member": name or None, "file_bytes": (off, off + n), "field": field})
            return out
        groups = self._shard(shard)["groups"]
        rg = int(np.searchsorted(groups, record, side="right") - 1)
        t = self._groups.get(
            (shard, rg), lambda: self._parquet(shard).read_row_group(rg, columns=[self.image_field, self.text_field])
        )
        k = int(record - groups[rg])
        img, txt = t.column(self.image_field)[k].as_py(), t.column(self.text_field)[k].as_py()
        row = int(loc["row"])

        def src(kind: str, j: int | None, value: Any) -> dict[str, Any]:
            col = self.image_field if kind == "image" else self.text_field
            field = "bytes" if kind == "image" and isinstance(value, dict) else None
            return {"kind": kind, "column": col, "row": row, "list_index": j, "field": field, "file_bytes": None}

        if self.kind == "interleaved":
            if not isinstance(txt, list) or not isinstance(img, list):
                return []
            return [
                src("image" if isinstance(seg, bytes) else "text", j, img[j] if isinstance(seg, bytes) else txt[j])
                for j, seg in self._interleaved(img, txt)
            ]
        return [src("image", None, img), src("text", None, txt)]

    # -- reads ---------------------------------------------------------------------------------
    def read(self, shard: int, indices: Sequence[int]) -> list[Any]:
        """Records ``indices`` of ``shard`` (MMRecord or BadRecord), in the order given."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return []
        n = self.shards[shard].num_records
        if int(idx.min()) < 0 or int(idx.max()) >= n:
            raise IndexError(f"dataset '{self.name}': record index out of range for shard {shard} ({n} records)")
        if self.format == "wds":
            return self._read_wds(shard, idx)
        return self._read_parquet(shard, idx)


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
) -> MultimodalIndex:
    """Find the shards of an image-text dataset and build (or load cached) per-shard metadata.

    A tar shard with a garbled header, cut short, or with data after its end-of-archive marker
    raises a :class:`DataError` naming the file and the byte position; with ``on_error =
    "skip"`` each damaged region is indexed as one record that reads back as a
    :class:`BadRecord` (a counted skip), and reading resumes at the next valid header. A sample
    above ``max_record_bytes`` (image and caption together) reads back as a BadRecord, unread."""
    if on_error not in ("raise", "skip"):
        raise DataError(f"unknown on_error {on_error!r}", dataset=name, fix='Use on_error = "raise" or "skip".')
    if kind not in ("image_text", "interleaved"):
        raise DataError(f"unknown kind {kind!r}", dataset=name, fix='Use kind = "image_text" or "interleaved".')
    files = resolve_files(name, path, "auto")
    fmt = _pick_format(name, files, format)
    if kind == "interleaved" and fmt != "parquet":
        raise DataError(
            "interleaved documents are read from Parquet only",
            dataset=name,
            fix='Store them as Parquet rows with list columns (texts, images), format = "parquet".',
        )
    if text_field is None:
        text_field = "texts" if kind == "interleaved" else "caption"
    if image_field is None:
        image_field = "images" if kind == "interleaved" else "image"
    from fsspec.implementations.local import LocalFileSystem

    specs = {}
    for fs, fp, info, _forced in files:
        local = isinstance(fs, LocalFileSystem)
        disp = fp if local else fs.unstrip_protocol(fp)
        if local:
            st = os.stat(fp)
            size, version = int(st.st_size), str(st.st_mtime_ns)
        else:
            size, version = int(info.get("size") or -1), str(info.get("mtime") or info.get("ETag") or "")
        specs[disp] = (fs, fp, disp, size, version)
    if cache_dir is None:
        cache_dir = os.environ.get("ZEPHON_CACHE_DIR") or os.path.join(
            os.path.expanduser("~"), ".cache", "zephon", "index"
        )
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError:
        cache_dir = None
    ix = MultimodalIndex(
        name, kind, fmt, text_field, image_field, [specs[k] for k in sorted(specs)], cache_dir, max_record_bytes
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
