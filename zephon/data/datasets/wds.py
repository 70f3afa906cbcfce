"""WebDataset-style tar shards of image-text samples (format ``"wds"``).

Members sharing a key (the file name up to its first dot) form one sample: an image and a
caption (``.txt``, or ``.json`` with the caption under ``text_field``); which member extensions
count as which is :func:`tar_member_role`. Indexing records every member's byte offset in the
tar, so a read is one ``pread`` per member: no tar scan at read time. A garbled header, a file
cut short, or data after the end-of-archive marker is indexed as a placeholder record (a
damaged region) that reads back as a :class:`~zephon.data.datasets.errors.BadRecord`.
"""

from __future__ import annotations

import functools
import json
import os
import tarfile
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import BadRecord
from .samples import MMRecord, image_header_size
from .shardbytes import ShardBytes

__all__ = ["CLASSIC_IMAGE_EXTS", "IMAGE_EXTS", "TAR_IMAGES", "TEXT_EXTS", "WdsReader", "tar_member_role"]


def _pillow_image_exts() -> tuple[str, ...]:
    """Every file extension Pillow's own plugins can open (``PIL.Image.registered_extensions()``
    of formats with an opener), lower case, sorted: derived, not a hand list, so a tar member
    Pillow can decode (``.gif``, ``.tif``, ``.bmp``, ...) is an image exactly when a Parquet
    image column would decode it. Plugins registered by other packages are left out, so the
    set (and so a tar's samples) depends on the Pillow version only."""
    from PIL import Image

    Image.init()
    out = set()
    for ext, fmt in Image.registered_extensions().items():
        opener = Image.OPEN.get(fmt)
        if opener is not None and str(getattr(opener[0], "__module__", "")).startswith("PIL."):
            out.add(ext.lower().lstrip("."))
    return tuple(sorted(out))


#: tar member extensions (lower case, after the key's first dot) read as a sample's image: every
#: extension Pillow can open (see :func:`_pillow_image_exts`)
IMAGE_EXTS = _pillow_image_exts()
#: the tar image extensions of data version 1 (a recipe's tar shards keep their samples, and a
#: skip recipe the samples it skips, under ``data_version = 1``)
CLASSIC_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
#: which tar members are images, by name: "classic" (data version 1), "pillow" (version 2)
TAR_IMAGES = {"classic": CLASSIC_IMAGE_EXTS, "pillow": IMAGE_EXTS}
#: tar member extensions read as a sample's caption (``json``: the caption is under text_field)
TEXT_EXTS = ("txt", "json")
_BLOCK = 512
# what a damaged tar region is, in its record's BadRecord (the array "damage_kind")
_GARBLED, _TRUNCATED, _TRAILING = 1, 2, 3


def _crcs_are(want: list[int], got: list[bytes]) -> bool:
    return list(map(zlib.crc32, got)) == want


def _listed(exts: tuple[str, ...]) -> str:
    return "/".join("." + e for e in exts)


def tar_member_role(name: str, image_exts: tuple[str, ...] = IMAGE_EXTS) -> tuple[str, str, str] | None:
    """``(sample key, "image" | "text", extension)`` of a tar member's name, or None for a
    member that is not part of a sample (hidden, without an extension, or another kind);
    ``image_exts``: the extensions read as images (:data:`TAR_IMAGES`).

    >>> tar_member_role("shard/0001.JPG"), tar_member_role("0001.json"), tar_member_role("0001.cls")
    (('shard/0001', 'image', 'jpg'), ('0001', 'text', 'json'), None)
    >>> tar_member_role("0001.gif"), tar_member_role("0001.gif", CLASSIC_IMAGE_EXTS)
    (('0001', 'image', 'gif'), None)
    """
    d, _, base = name.rpartition("/")
    if base.startswith(".") or "." not in base:
        return None
    stem, ext = base.split(".", 1)
    ext = ext.lower()
    slot = "image" if ext in image_exts else "text" if ext in TEXT_EXTS else None
    if slot is None:
        return None
    return (f"{d}/{stem}" if d else stem), slot, ext


def _resync(f: Any, start: int) -> int | None:
    """The offset of the first valid tar header at or after ``start`` (512-byte aligned),
    or None: where reading resumes after a garbled header."""
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


def _after_run(f: Any, end: int, size: int) -> tuple[int, int, int | None] | None:
    """What follows a run of members that ends at byte ``end``: None for a well-formed end of
    archive, else the damaged region ``(at, kind, next valid header or None)``."""
    if end >= size:  # no end-of-archive marker after the last member
        return size, _TRUNCATED, None
    if size - end < _BLOCK:  # the file ends inside a header block
        return end, _TRUNCATED, None
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
            return None  # a well-formed end
        return at, _TRAILING, _resync(f, end + -(-zeros // _BLOCK) * _BLOCK)
    # a header that tarfile could not read: skip to the next valid one
    return end, _GARBLED, _resync(f, end + _BLOCK)


class WdsReader(ShardBytes):
    """Indexing and reading the tar shards of an image-text index ``ix``."""

    def _read_run(self, s: int, f: Any, pos: int, size: int, add: Callable[[Any], None]) -> tuple[int, bool]:
        """The members from byte ``pos`` until ``tarfile`` stops, each file member given to ``add``:
        ``(end, cut)``, where the run ends and whether a member runs past the end of the file."""
        f.seek(pos)
        try:
            tf = tarfile.open(fileobj=f, mode="r:")
        except tarfile.ReadError as e:
            if pos == 0:
                raise self.ix._err(
                    s,
                    f"not a valid tar file (corrupt or truncated?): {e}",
                    "Re-create or re-copy the shard, or remove it from the dataset's path list.",
                ) from None
            return pos, False
        last_end = pos
        try:
            for m in tf:
                if m.offset_data + m.size > size:  # its data runs past the end of the file
                    return last_end, True
                last_end = m.offset_data + -(-m.size // _BLOCK) * _BLOCK
                if m.isfile():
                    add(m)
        except (tarfile.ReadError, EOFError):
            return last_end, True
        except tarfile.TarError as e:
            raise self.ix._err(
                s,
                f"not a valid tar file (corrupt?): {e}",
                "Re-create or re-copy the shard, or remove it from the dataset's path list.",
            ) from None
        return max(tf.offset, last_end), False

    def _role(self, name: str) -> tuple[str, str, str] | None:
        """``(key, slot, tag)`` of a tar member, or None for one that is not part of a sample."""
        return tar_member_role(name, self.ix.image_exts)

    def _keep(self, got: dict[str, Any], slot: str, member: tuple[int, int, str, str]) -> None:
        """Book ``member`` (offset, size, tag, name) in its sample ``got``: the first of each slot."""
        got.setdefault(slot, member)

    def _members(self, s: int, f: Any) -> tuple[list[Any], dict[Any, dict[str, Any]]]:
        """Every sample of a tar shard in file order, and the damaged regions between them.

        A garbled header, a file cut short, or data after the end-of-archive marker would make
        ``tarfile`` end the archive early without a word; here each is a placeholder record
        (its key a tuple ``("damage", byte)``) that reads back as a :class:`BadRecord` naming the
        byte position, and reading resumes at the next valid header."""
        order: list[Any] = []
        members: dict[Any, dict[str, Any]] = {}
        f.seek(0, os.SEEK_END)
        size = f.tell()

        def add(m: tarfile.TarInfo) -> None:
            role = self._role(m.name)
            if role is None:
                return
            key, slot, ext = role
            if key not in members:
                members[key] = {}
                order.append(key)
            self._keep(members[key], slot, (m.offset_data, m.size, ext, m.name))

        pos = 0
        while True:
            end, cut = self._read_run(s, f, pos, size, add)
            gap = (end, _TRUNCATED, None) if cut else _after_run(f, end, size)
            if gap is None:
                return order, members
            at, kind, nxt = gap
            key = ("damage", at)
            order.append(key)
            members[key] = {"damage": (at, kind, size if nxt is None else nxt)}
            if nxt is None:
                return order, members
            pos = nxt

    def build(self, s: int) -> dict[str, np.ndarray]:
        """Every sample's member offsets and lengths, names and image header sizes; damaged
        regions as placeholder records."""
        f = self._open(s)
        try:
            order, members = self._members(s, f)
        finally:
            f.close()
        n = len(order)
        a = {k: np.full(n, -1, np.int64) for k in ("img_off", "img_len", "txt_off", "txt_len", "damage", "damage_end")}
        a["txt_json"] = np.zeros(n, np.int64)
        # CRC-32 of each member's bytes, checked on every read (size and mtime are not identity)
        a["img_crc"], a["txt_crc"] = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
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
                data = self._read_range(s, got["image"][0], got["image"][1])
                a["img_crc"][i] = zlib.crc32(data)
                w, h = image_header_size(data[: 1 << 16])
                if (w, h) == (0, 0) and got["image"][1] > (1 << 16):
                    w, h = image_header_size(data)
                widths.append(w)
                heights.append(h)
            if "text" in got:
                a["txt_off"][i], a["txt_len"][i] = got["text"][0], got["text"][1]
                a["txt_json"][i] = 1 if got["text"][2] == "json" else 0
                a["txt_crc"][i] = zlib.crc32(self._read_range(s, got["text"][0], got["text"][1]))
        a["keys"] = np.array(keys, dtype=np.str_) if keys else np.zeros(0, dtype="<U1")
        for k, v in names.items():
            a[k] = np.array(v, dtype=np.str_) if v else np.zeros(0, dtype="<U1")
        a["lengths"] = np.maximum(a["txt_len"], 0)
        a["n_img"] = (a["img_len"] >= 0).astype(np.int64)
        a["img_w"], a["img_h"] = np.array(widths, np.int64), np.array(heights, np.int64)
        return a

    def _image_kinds(self) -> str:
        exts = self.ix.image_exts
        if exts == CLASSIC_IMAGE_EXTS:
            return f"{_listed(exts)}; data version 2 reads every extension Pillow opens"
        return f"a member Pillow can open: {_listed(exts[:8])}, ..."

    def damaged(self, shard: int) -> list[tuple[int, str]]:
        """The damaged regions of a tar shard: ``(record, reason)`` for each placeholder record
        (empty for intact shards and for Parquet)."""
        a = self.ix._shard(shard)
        if "damage" not in a:
            return []
        return [(int(i), self.damage_reason(shard, int(i))) for i in np.flatnonzero(a["damage"] >= 0)]

    def damage_reason(self, s: int, i: int) -> str:
        """What the damaged region of placeholder record ``i`` is, and what was lost."""
        a = self.ix._shard(s)
        at, kind, until = int(a["damage"][i]), int(a["damage_kind"][i]), int(a["damage_end"][i])
        size = self.ix._specs[s].size
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

    def read(self, s: int, idx: np.ndarray) -> list[Any]:
        """Samples ``idx``: one ``pread`` per member, no tar scan."""
        a = self.ix._shard(s)
        disp = self.ix._specs[s].display
        out: list[Any] = []
        for i in idx.tolist():
            key = str(a["keys"][i])
            loc = f"key '{key}'"
            if "damage" in a and a["damage"][i] >= 0:
                out.append(BadRecord(self.ix.name, disp, f"byte {int(a['damage'][i])}", self.damage_reason(s, i)))
                continue
            total = int(a["img_len"][i]) + max(0, int(a["txt_len"][i]))
            if total > self.ix.max_record_bytes:
                out.append(BadRecord(self.ix.name, disp, loc, self.oversized(total, "sample")))
                continue
            if a["img_len"][i] < 0:
                out.append(
                    BadRecord(
                        self.ix.name,
                        disp,
                        loc,
                        f"the sample has a caption but no image ({self._image_kinds()})",
                    )
                )
                continue
            if a["txt_len"][i] < 0:
                out.append(
                    BadRecord(self.ix.name, disp, loc, f"the sample has an image but no caption ({_listed(TEXT_EXTS)})")
                )
                continue
            spans = [(int(a["img_off"][i]), int(a["img_len"][i])), (int(a["txt_off"][i]), int(a["txt_len"][i]))]
            crcs = [int(a["img_crc"][i]), int(a["txt_crc"][i])]
            got = self.ix._intact(s, functools.partial(self._read_spans, s, spans), functools.partial(_crcs_are, crcs))
            img, raw = got
            if not _crcs_are(crcs, got):
                raise self.ix._changed_error(s, loc)
            try:
                text = raw.decode("utf-8")
                if a["txt_json"][i]:
                    obj = json.loads(text)
                    if not isinstance(obj, dict) or not isinstance(obj.get(self.ix.text_field), str):
                        out.append(
                            BadRecord(
                                self.ix.name, disp, loc, f"the .json caption has no string field '{self.ix.text_field}'"
                            )
                        )
                        continue
                    text = obj[self.ix.text_field]
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                out.append(BadRecord(self.ix.name, disp, loc, f"unreadable caption ({type(e).__name__}: {e})"))
                continue
            out.append(MMRecord((img, text), disp, loc))
        return out

    # -- Parquet -------------------------------------------------------------------------------

    def locate(self, s: int, record: int) -> dict[str, Any]:
        """``locator`` (``key 'k'``) and ``key``."""
        key = str(self.ix._shard(s)["keys"][record])
        return {"locator": f"key '{key}'", "key": key}

    def sources(self, s: int, record: int) -> list[dict[str, Any]]:
        """Each member's name and byte range in the tar (no read)."""
        a = self.ix._shard(s)
        out = []
        for slot, kind in (("img", "image"), ("txt", "text")):
            off, n = int(a[f"{slot}_off"][record]), int(a[f"{slot}_len"][record])
            if n < 0:
                continue
            name = str(a[f"{slot}_name"][record]) if f"{slot}_name" in a else ""
            field = self.ix.text_field if kind == "text" and a["txt_json"][record] else None
            out.append({"kind": kind, "member": name or None, "file_bytes": (off, off + n), "field": field})
        return out
