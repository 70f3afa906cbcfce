"""Vision-language chat records in JSON Lines (kind ``"chat"``, format ``"jsonl"``): one
conversation object a line, its images as files next to it.

Two forms are common: LLaVA's ``{"image": "coco/x.jpg", "conversations": [{"from": "human",
"value": "<image>\\n..."}, ...]}`` (set ``image_field = "image"``) and the messages form
``{"messages": [...], "images": ["a.png", "b.jpg"]}``. The image paths are under ``image_field``
(a path or a list of paths); where a line has no such field, they are the ``path`` (or string
``image``) of the messages' ``{"type": "image"}`` content parts, in order. A relative path is
taken from the JSONL file's folder, and may not leave it (``..``); an absolute one is allowed for
a local dataset. The record's text segment is the whole line (JSON text that
:func:`zephon.data.chat.parse_conversation` reads).

Indexing books each line's byte range and CRC-32, and each image file's size, CRC-32 and header
size (a missing file: 0 x 0, and the record reads back as a BadRecord naming the path). Why the
image CRC: an image file rewritten after indexing would otherwise pair the conversation with
other pixels without a word. Whole-file compressed JSONL (``.gz``, ``.zst``) is refused: records
are read by byte range.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
import zlib
from typing import Any

import numpy as np

from ._scan import SMALL_STREAM, LineScanner, line_number, scan_small
from .errors import BadRecord, DataError
from .samples import MMRecord, image_header_size
from .shardbytes import ShardBytes

__all__ = ["MMJsonlReader", "image_refs"]

_COMPRESSED = (".gz", ".zst", ".zstd")


def _content_refs(obj: dict[str, Any]) -> tuple[list[str] | None, str | None]:
    """The paths of the ``{"type": "image"}`` content parts of a record's messages, in order."""
    msgs = obj.get("messages", obj.get("conversations"))
    out: list[str] = []
    for m, msg in enumerate(msgs if isinstance(msgs, list) else []):
        content = msg.get("content") if isinstance(msg, dict) else None
        for p, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict) or part.get("type") != "image":
                continue
            ref = part.get("path", part.get("image"))
            if not isinstance(ref, str) or not ref:
                return None, f"content part {p} of message {m} is an image without a path ('path' or 'image')"
            out.append(ref)
    return out, None


def image_refs(obj: Any, field: str) -> tuple[list[str] | None, str | None]:
    """``(paths, None)`` or ``(None, reason)``: a JSON Lines record's image paths as written, in
    order: ``obj[field]`` (a path or a list of paths; null: none), else its messages' image
    content parts.

    >>> image_refs({"image": "a.jpg", "conversations": []}, "image")
    (['a.jpg'], None)
    >>> image_refs({"messages": [{"role": "user", "content": [{"type": "image", "path": "b.png"}]}]}, "images")
    (['b.png'], None)
    >>> image_refs({"images": ["a.png", 3]}, "images")[1]
    "entry 1 of 'images' is int, not a path"
    """
    if not isinstance(obj, dict):
        return None, "the line is not a JSON object"
    if field not in obj:
        return _content_refs(obj)
    v = obj[field]
    refs = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(refs, list):
        return None, f"'{field}' is {type(v).__name__}, not a path or a list of paths"
    for j, r in enumerate(refs):
        if not isinstance(r, str) or not r:
            return None, f"entry {j} of '{field}' is {type(r).__name__ if r != '' else 'empty'}, not a path"
    return list(refs), None


class MMJsonlReader(ShardBytes):
    """Indexing and reading the JSON Lines shards of a chat index ``ix``."""

    def _resolve(self, s: int, ref: str) -> tuple[str | None, str | None]:
        """``(path on the shard's file system, None)`` or ``(None, reason)`` of an image path as written."""
        sp = self.ix._specs[s]
        pm = os.path if sp.local else posixpath
        folder = pm.dirname(sp.fspath)
        if "://" in ref:
            return None, f"the image path '{ref}' is a URL; give a path relative to the JSONL file's folder"
        if pm.isabs(ref):
            if sp.local:
                return pm.normpath(ref), None
            return None, f"the image path '{ref}' is absolute; a remote dataset's paths are relative to its folder"
        scheme, sep, base = folder.rpartition("://")  # an HTTP URL's folder: normalise the part after it
        path = pm.normpath(pm.join(base, ref))
        if pm.relpath(path, base or ".").split(pm.sep)[0] == "..":
            return None, f"the image path '{ref}' leaves the dataset folder '{folder}' (..)"
        return scheme + sep + path, None

    def _image(self, s: int, path: str) -> bytes | None:
        """The bytes of an image file on shard s's file system, or None where it does not exist."""
        sp = self.ix._specs[s]
        if sp.local:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                return None
            except OSError as e:
                raise self.ix._err(s, f"cannot read the image '{path}' ({type(e).__name__}: {e})", _PERM) from None

        def fetch() -> bytes | None:
            try:
                return sp.fs.cat_file(path)
            except FileNotFoundError:
                return None

        return self.ix._retrying(s, f"reading the image '{path}'", fetch)

    def _display(self, s: int, path: str) -> str:
        sp = self.ix._specs[s]
        return path if sp.local else sp.fs.unstrip_protocol(path)

    def _lines(self, s: int) -> tuple[bytes, dict[str, np.ndarray]]:
        """Shard s's bytes and its non-blank lines (:class:`~._scan.LineScanner`'s arrays)."""
        sp = self.ix._specs[s]
        if sp.fspath.lower().endswith(_COMPRESSED):
            raise self.ix._err(
                s,
                "chat records in JSON Lines are read by byte range, so the file may not be compressed",
                "Decompress it (e.g. gunzip / unzstd) and point the dataset at the .jsonl file.",
            )
        f = self._open(s)
        try:
            data = f.read()
        except OSError as e:
            raise self._io_error(s, e) from None
        finally:
            f.close()
        if len(data) <= SMALL_STREAM:
            return data, scan_small(data)
        sc = LineScanner()
        sc.feed(data)
        return data, sc.finish()

    def build(self, s: int) -> dict[str, np.ndarray]:
        """Per line: byte range, CRC-32, what is wrong with it ("" if nothing) and its image count;
        per image (flat, in record order): the path, its size (-1: missing), CRC-32 and header size."""
        data, a = self._lines(s)
        n = len(a["offsets"])
        problems = [""] * n
        n_img = np.zeros(n, np.int64)
        cols: dict[str, list[Any]] = {k: [] for k in ("img_len", "img_crc", "img_w", "img_h", "img_path", "img_ref")}
        for i, (off, size) in enumerate(zip(a["offsets"].tolist(), a["lengths"].tolist())):
            try:
                obj = json.loads(data[off : off + size].decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                problems[i] = f"the line is not JSON text ({type(e).__name__}: {str(e)[:200]})"
                continue
            refs, why = image_refs(obj, self.ix.image_field)
            resolved = [self._resolve(s, ref) for ref in refs or []]
            why = why or next((bad for path, bad in resolved if path is None), None)
            if refs is None or why:
                problems[i] = why or ""
                continue
            n_img[i] = len(refs)
            for ref, (path, _) in zip(refs, resolved):
                path = path or ""
                img = self._image(s, path)
                w, h = image_header_size(img) if img is not None else (0, 0)
                got = (-1, -1) if img is None else (len(img), zlib.crc32(img))
                for k, v in zip(cols, (*got, w, h, path, ref)):
                    cols[k].append(v)
        for k, v in cols.items():
            a[k] = np.array(v, dtype=np.str_ if k in ("img_path", "img_ref") else np.int64)
            if not v and k in ("img_path", "img_ref"):
                a[k] = np.zeros(0, dtype="<U1")
        a["crcs"] = a["crcs"].astype(np.int64)
        a["problem"] = np.array(problems, dtype=np.str_) if problems else np.zeros(0, dtype="<U1")
        a["n_img"] = n_img
        a["img_first"] = np.concatenate([[0], np.cumsum(n_img)]).astype(np.int64)
        return a

    def _line(self, s: int, record: int) -> int:
        a = self.ix._shard(s)
        return line_number(a["gap_rec"], a["gap_cum"], record)

    def locate(self, s: int, record: int) -> dict[str, Any]:
        """``locator`` (``line N``, 1-based physical line) and ``line``."""
        line = self._line(s, record)
        return {"locator": f"line {line}", "line": line}

    def damaged(self, s: int) -> list[tuple[int, str]]:
        """None: a JSON Lines shard has no damaged regions (a bad line is a bad record)."""
        return []

    def _bad(self, s: int, i: int) -> str | None:
        """Why record i is bad from the index alone (its line, a missing image, its size), or None."""
        a = self.ix._shard(s)
        if a["problem"][i]:
            return str(a["problem"][i])
        j0, j1 = int(a["img_first"][i]), int(a["img_first"][i + 1])
        for j in range(j0, j1):
            if a["img_len"][j] < 0:
                path = self._display(s, str(a["img_path"][j]))
                return f"image {j - j0} ('{a['img_ref'][j]}') not found: no file '{path}'"
        total = int(a["lengths"][i]) + int(a["img_len"][j0:j1].sum())
        if total > self.ix.max_record_bytes:
            return self.oversized(total)
        return None

    def read(self, s: int, idx: np.ndarray) -> list[Any]:
        """Records ``idx``: the lines by byte range and each image file, checked against their CRC-32s."""
        a = self.ix._shard(s)
        disp = self.ix._specs[s].display
        out: list[Any] = [None] * idx.size
        todo = [(k, i) for k, i in enumerate(idx.tolist()) if not self._set_bad(s, i, k, out)]
        spans = [(int(a["offsets"][i]), int(a["lengths"][i])) for _, i in todo]
        crcs = [int(a["crcs"][i]) for _, i in todo]
        ok = functools.partial(_crcs_match, crcs)
        lines = self.ix._intact(s, functools.partial(self._read_spans, s, spans), ok)
        if not ok(lines):
            raise self.ix._changed_error(s, ", ".join(f"line {self._line(s, i)}" for _, i in todo[:3]))
        for (k, i), raw in zip(todo, lines):
            j0, j1 = int(a["img_first"][i]), int(a["img_first"][i + 1])
            images = []
            for j in range(j0, j1):
                img = self._image(s, str(a["img_path"][j]))
                if img is None or zlib.crc32(img) != int(a["img_crc"][j]) or len(img) != int(a["img_len"][j]):
                    raise self._image_changed(s, i, str(a["img_path"][j]), img is None)
                images.append(img)
            out[k] = MMRecord((raw.decode("utf-8"), *images), disp, f"line {self._line(s, i)}")
        return out

    def _set_bad(self, s: int, i: int, k: int, out: list[Any]) -> bool:
        """Put record i's BadRecord at ``out[k]`` where the index says it is bad."""
        bad = self._bad(s, i)
        if bad is not None:
            out[k] = BadRecord(self.ix.name, self.ix._specs[s].display, f"line {self._line(s, i)}", bad)
        return bad is not None

    def _image_changed(self, s: int, i: int, path: str, gone: bool) -> DataError:
        what = "was removed" if gone else "changed"
        return self.ix._err(
            s,
            f"the image '{self._display(s, path)}' {what} since the dataset was indexed",
            "Do not modify image files during a run; if they changed on purpose, touch the JSONL file (or delete "
            "its index cache) so that it is indexed again.",
            f"line {self._line(s, i)}",
        )

    def sources(self, s: int, record: int) -> list[dict[str, Any]]:
        """The line (its byte range in the file), then each image file (its path; no read)."""
        a = self.ix._shard(s)
        off, n = int(a["offsets"][record]), int(a["lengths"][record])
        out = [{"kind": "text", "line": self._line(s, record), "file_bytes": (off, off + n), "field": None}]
        j0, j1 = int(a["img_first"][record]), int(a["img_first"][record + 1])
        for j in range(j0, j1):
            size = int(a["img_len"][j])
            out.append(
                {
                    "kind": "image",
                    "path": self._display(s, str(a["img_path"][j])),
                    "ref": str(a["img_ref"][j]),
                    "file_bytes": (0, size) if size >= 0 else None,
                    "field": None,
                }
            )
        return out


_PERM = "Check the image file's permissions."


def _crcs_match(want: list[int], got: list[bytes]) -> bool:
    return [zlib.crc32(b) for b in got] == want
