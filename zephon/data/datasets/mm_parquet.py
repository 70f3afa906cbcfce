"""Image-text samples in Parquet (format ``"parquet"``): an image column (``image_field``;
binary, or Hugging Face's ``{bytes, path}`` struct) and a caption column (``text_field``); and
interleaved documents (kind ``"interleaved"``, OBELICS-style): rows with a list of texts and a
list of images of equal length, at each position one of the two set; and vision-language chat
records (kind ``"chat"``): a conversation column (``text_field``; JSON text or a list of message
structs) and an image column (``image_field``; a list of images, or one; :mod:`.chat_records`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .chat_records import chat_row
from .errors import BadRecord, DataError
from .samples import ImageTextStore, MMRecord, image_header_size, value_crc

__all__ = ["MMParquetReader"]


class MMParquetReader:
    """Indexing and reading the Parquet shards of an image-text index ``ix``."""

    def __init__(self, ix: ImageTextStore) -> None:
        self.ix = ix

    def _parquet(self, s: int) -> Any:
        """Shard s as a ParquetFile: a remote shard's node-cache copy (opened by path, inside its
        hold: an entry evicted later stays readable through the open file) where the cache takes it."""
        import pyarrow.parquet as pq

        sp = self.ix._specs[s]
        try:
            with self.ix._local_copy(s) as copy:
                # pages written with a CRC are verified: a corrupted page raises instead of being used
                src = sp.fspath if sp.local else copy if copy is not None else sp.fs.open(sp.fspath, "rb")
                return pq.ParquetFile(src, page_checksum_verification=True)
        except Exception as e:
            if self.ix._transient(e) or isinstance(e, DataError):
                raise  # retried by the caller
            raise self.ix._err(s, f"not a valid Parquet file: {e}", "Re-download or rewrite the file.") from None

    def _group(self, s: int, rg: int) -> Any:
        """Row group ``rg`` of shard s (its image and text columns), read with retries and
        checked against its indexed CRC-32: a corrupt node-cache copy is dropped and fetched
        again, a file changed since it was indexed is refused."""
        import pyarrow as pa

        ix = self.ix
        want = int(ix._shard(s)["crcs"][rg])

        def read() -> tuple[Any, int]:
            try:
                t = self._parquet(s).read_row_group(rg, columns=[ix.image_field, ix.text_field])
            except (pa.ArrowException, OSError) as e:
                if ix._transient(e) or ix._node_cache(s) is None:
                    raise
                return e, -1  # a page of the node-cache copy failed its CRC: the copy is dropped, read again
            return t, _group_crc(t, ix.image_field, ix.text_field)

        def load() -> Any:
            t, crc = ix._intact(s, lambda: ix._retrying(s, "reading", read), lambda got: got[1] == want)
            if isinstance(t, BaseException):
                raise ix._err(s, f"cannot read row group {rg} ({t})", "Re-download or rewrite the file.")
            if crc != want:
                groups = ix._shard(s)["groups"]
                raise ix._changed_error(s, f"row group {rg} (rows {int(groups[rg])}..{int(groups[rg + 1]) - 1})")
            return t

        return ix._caches["groups"].get((s, rg), load)

    def _columns(self, s: int, pf: Any) -> tuple[str, str]:
        names = pf.schema_arrow.names
        for col in (self.ix.image_field, self.ix.text_field):
            if col not in names:
                key = "image_field" if col == self.ix.image_field else "text_field"
                raise self.ix._err(
                    s,
                    f"column '{col}' not found (columns: {', '.join(map(repr, names[:20]))})",
                    f"Set {key} = \"<column>\" for dataset '{self.ix.name}' in the recipe.",
                )
        return self.ix.image_field, self.ix.text_field

    @staticmethod
    def _image_bytes(v: Any) -> bytes | None:
        if isinstance(v, dict):  # Hugging Face Image feature
            v = v.get("bytes")
        if v is None:
            return None
        return bytes(v)

    def _record_from_row(self, img: Any, txt: Any) -> tuple[tuple[Any, ...] | None, str | None]:
        """(segments, None) or (None, reason)."""
        if self.ix.kind == "chat":
            return chat_row(img, txt, self.ix.image_field)
        if self.ix.kind == "interleaved":
            if not isinstance(txt, list) or not isinstance(img, list):
                return None, f"'{self.ix.text_field}' and '{self.ix.image_field}' must both be lists"
            if len(txt) != len(img):
                return None, f"'{self.ix.text_field}' has {len(txt)} entries but '{self.ix.image_field}' has {len(img)}"
            segs: list[Any] = [seg for _, seg in self._interleaved(img, txt)]
            if not any(isinstance(x, bytes) for x in segs) and not any(isinstance(x, str) and x.strip() for x in segs):
                return None, "the document has neither text nor images"
            return tuple(segs), None
        b = self._image_bytes(img)
        if b is None:
            return None, f"the image ('{self.ix.image_field}') is null"
        if not isinstance(txt, str):
            return None, f"the caption ('{self.ix.text_field}') is {'null' if txt is None else type(txt).__name__}"
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

    def build(self, s: int) -> dict[str, np.ndarray]:
        """Row-group boundaries, each row's text bytes and its images' header sizes."""
        pf = self._parquet(s)
        ic, tc = self._columns(s, pf)
        md = pf.metadata
        counts, lengths, n_img, ws, hs, crcs = [], [], [], [], [], []
        for rg in range(md.num_row_groups):
            t = pf.read_row_group(rg, columns=[ic, tc])
            counts.append(t.num_rows)
            crcs.append(_group_crc(t, ic, tc))  # the read unit's CRC-32, checked on every read
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
            "crcs": np.array(crcs, np.int64),
        }

    def read(self, s: int, idx: np.ndarray) -> list[Any]:
        """Rows ``idx``, each row group read once (and cached)."""
        import pyarrow as pa

        groups = self.ix._shard(s)["groups"]
        rg_of = np.searchsorted(groups, idx, side="right") - 1
        out: list[Any] = [None] * idx.size
        disp = self.ix._specs[s].display
        for rg in np.unique(rg_of).tolist():
            t = self._group(s, rg)
            ks = np.flatnonzero(rg_of == rg)
            take = pa.array(idx[ks] - groups[rg])
            imgs = t.column(self.ix.image_field).take(take).to_pylist()
            txts = t.column(self.ix.text_field).take(take).to_pylist()
            for k, img, txt in zip(ks.tolist(), imgs, txts):
                segs, bad = self._record_from_row(img, txt)
                loc = f"row {int(idx[k])}"
                out[k] = (
                    MMRecord(segs, disp, loc)
                    if bad is None and segs is not None
                    else BadRecord(self.ix.name, disp, loc, bad or "unreadable")
                )
        return out

    def locate(self, s: int, record: int) -> dict[str, Any]:
        """``locator`` (``row N``, 0-based) and ``row``."""
        return {"locator": f"row {record}", "row": int(record)}

    def damaged(self, s: int) -> list[tuple[int, str]]:
        """None: a Parquet shard's damage is an error, not a region of records."""
        return []

    def sources(self, s: int, record: int) -> list[dict[str, Any]]:
        """The column, row and list entry of each segment (reads the row)."""
        ix = self.ix
        groups = ix._shard(s)["groups"]
        rg = int(np.searchsorted(groups, record, side="right") - 1)
        t = self._group(s, rg)
        k = int(record - groups[rg])
        img, txt = t.column(ix.image_field)[k].as_py(), t.column(ix.text_field)[k].as_py()
        row = int(record)

        def src(kind: str, j: int | None, value: Any) -> dict[str, Any]:
            col = ix.image_field if kind == "image" else ix.text_field
            field = "bytes" if kind == "image" and isinstance(value, dict) else None
            return {"kind": kind, "column": col, "row": row, "list_index": j, "field": field, "file_bytes": None}

        if ix.kind == "chat":  # the conversation, then each image (its list entry; None: a single image)
            many = isinstance(img, (list, tuple))
            images = (img if many else [img]) if img is not None else []
            return [src("text", None, txt)] + [src("image", j if many else None, v) for j, v in enumerate(images)]
        if ix.kind == "interleaved":
            if not isinstance(txt, list) or not isinstance(img, list):
                return []
            return [
                src("image" if isinstance(seg, bytes) else "text", j, img[j] if isinstance(seg, bytes) else txt[j])
                for j, seg in self._interleaved(img, txt)
            ]
        return [src("image", None, img), src("text", None, txt)]


def _group_crc(t: Any, image_field: str, text_field: str) -> int:
    """CRC-32 of a row group's image and text cells, row by row (:func:`value_crc`)."""
    crc = 0
    for img, txt in zip(t.column(image_field).to_pylist(), t.column(text_field).to_pylist()):
        crc = value_crc(txt, value_crc(img, crc))
    return crc
