"""Vision-language chat records in WebDataset-style tar shards (kind ``"chat"``, format ``"wds"``).

Members sharing a key form one record: ``key.json`` is the conversation (the whole JSON value),
and the key's images are ``key.0.jpg``, ``key.1.png``, ... in natural numeric order, or a single
``key.jpg`` (image 0). Mixing the two spellings in one key, a gap or a duplicate in the numbering,
or a missing or repeated ``key.json`` is a bad record naming the members: the image order is the
one the conversation refers to them in, so a guessed order would pair text with the wrong image.

As for image-text tars (:mod:`.wds`), indexing books every member's byte range and CRC-32 and
each image's header size; a read is one ``pread`` per member, checked against the CRCs.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import numpy as np

from .chat_records import conversation_json
from .errors import BadRecord
from .samples import MMRecord, image_header_size
from .wds import WdsReader

__all__ = ["WdsChatReader", "chat_member_role"]

_Member = tuple[int, int, str, str]  # (offset, size, image number ("" if none) or "json", name)


def chat_member_role(name: str, image_exts: tuple[str, ...]) -> tuple[str, str, str] | None:
    """``(key, "conv" | "image", tag)`` of a chat tar member, or None for a member that is not
    part of a record; an image's tag is its number (``""`` for an unnumbered ``key.jpg``).

    >>> exts = ("jpg", "png")
    >>> chat_member_role("d/k.json", exts), chat_member_role("k.12.PNG", exts), chat_member_role("k.jpg", exts)
    (('d/k', 'conv', 'json'), ('k', 'image', '12'), ('k', 'image', ''))
    >>> chat_member_role("k.txt", exts), chat_member_role("k.x.jpg", exts)
    (None, None)
    """
    d, _, base = name.rpartition("/")
    if base.startswith(".") or "." not in base:
        return None
    stem, rest = base.split(".", 1)
    key, rest = (f"{d}/{stem}" if d else stem), rest.lower()
    if rest == "json":
        return key, "conv", "json"
    if rest in image_exts:
        return key, "image", ""
    num, dot, ext = rest.partition(".")
    if dot and num.isdigit() and num.isascii() and ext in image_exts:
        return key, "image", num
    return None


def _names(ms: list[_Member]) -> str:
    return ", ".join(m[3] for m in ms)


def order_images(key: str, convs: list[_Member], imgs: list[_Member]) -> tuple[list[_Member], str]:
    """A record's images in conversation order, and what is wrong with its members ("" if nothing).

    >>> m = lambda tag, name: (0, 1, tag, name)
    >>> order_images("k", [m("json", "k.json")], [m("10", "k.10.png"), m("2", "k.2.jpg")])[1]
    'the image numbering has a gap: no image 0 (members k.2.jpg, k.10.png)'
    """
    imgs = sorted(imgs, key=lambda m: (int(m[2] or 0), m[3]))
    numbered = [m for m in imgs if m[2]]
    if not convs:
        return imgs, f"the record has no conversation member ('{key}.json'; members {_names(imgs)})"
    if len(convs) > 1:
        return imgs, f"the record has {len(convs)} conversation members named '{convs[0][3]}'"
    if numbered and len(numbered) < len(imgs):
        return imgs, f"the record mixes numbered and unnumbered images (members {_names(imgs)}); use one spelling"
    if len(imgs) > 1 and not numbered:
        return (
            imgs,
            f"the record has several unnumbered images (members {_names(imgs)}); number them {key}.0.<ext>, ...",
        )
    nums = [int(m[2]) for m in numbered]
    for j, n in enumerate(nums):
        if j and n == nums[j - 1]:
            same = [m for m in numbered if int(m[2]) == n]
            return imgs, f"image number {n} appears {len(same)} times (members {_names(same)})"
    missing = sorted(set(range(len(nums))) - set(nums))
    if missing:
        return imgs, f"the image numbering has a gap: no image {missing[0]} (members {_names(imgs)})"
    return imgs, ""


class WdsChatReader(WdsReader):
    """Indexing and reading the chat records of tar shards of a chat index ``ix``."""

    def _role(self, name: str) -> tuple[str, str, str] | None:
        return chat_member_role(name, self.ix.image_exts)

    def _keep(self, got: dict[str, Any], slot: str, member: _Member) -> None:
        got.setdefault(slot, []).append(member)

    def build(self, s: int) -> dict[str, np.ndarray]:
        """Per record: the conversation member's range, CRC-32 and name, the problem with its
        members ("" if none) and its images; per image (flat, in record order): range, CRC-32,
        name and header size."""
        f = self._open(s)
        try:
            order, members = self._members(s, f)
        finally:
            f.close()
        n = len(order)
        a = {k: np.full(n, -1, np.int64) for k in ("txt_off", "txt_len", "txt_crc", "damage", "damage_end")}
        a["damage_kind"], a["n_img"] = np.zeros(n, np.int64), np.zeros(n, np.int64)
        cols: dict[str, list[Any]] = {k: [] for k in ("img_off", "img_len", "img_crc", "img_w", "img_h", "img_name")}
        keys, txt_names, problems = [""] * n, [""] * n, [""] * n
        for i, key in enumerate(order):
            got = members[key]
            if "damage" in got:
                at, kind, until = got["damage"]
                a["damage"][i], a["damage_kind"][i], a["damage_end"][i] = at, kind, until
                keys[i] = f"<damaged tar region at byte {at}>"
                continue
            keys[i] = key
            convs = got.get("conv", [])
            imgs, problems[i] = order_images(key, convs, got.get("image", []))
            if convs:
                off, size, _, txt_names[i] = convs[0]
                a["txt_off"][i], a["txt_len"][i] = off, size
                a["txt_crc"][i] = zlib.crc32(self._read_range(s, off, size))
            a["n_img"][i] = len(imgs)
            for off, size, _, name in imgs:
                data = self._read_range(s, off, size)
                w, h = image_header_size(data)
                for k, v in zip(cols, (off, size, zlib.crc32(data), w, h, name)):
                    cols[k].append(v)
        for k, v in cols.items():
            if k != "img_name":
                a[k] = np.array(v, np.int64)
        for k, v in (("keys", keys), ("txt_name", txt_names), ("problem", problems), ("img_name", cols["img_name"])):
            a[k] = np.array(v, dtype=np.str_) if v else np.zeros(0, dtype="<U1")
        a["lengths"] = np.maximum(a["txt_len"], 0)
        a["img_first"] = np.concatenate([[0], np.cumsum(a["n_img"])]).astype(np.int64)
        return a

    def _spans(self, a: dict[str, np.ndarray], i: int) -> tuple[list[tuple[int, int]], list[int], list[str]]:
        """Record i's members: ``(offset, length)``, CRC-32 and name of the conversation, then of each image."""
        j0, j1 = int(a["img_first"][i]), int(a["img_first"][i + 1])
        spans = [(int(a["txt_off"][i]), int(a["txt_len"][i]))]
        spans += [(int(o), int(n)) for o, n in zip(a["img_off"][j0:j1], a["img_len"][j0:j1])]
        crcs = [int(a["txt_crc"][i]), *map(int, a["img_crc"][j0:j1])]
        return spans, crcs, [str(a["txt_name"][i]), *map(str, a["img_name"][j0:j1])]

    def _bad(self, s: int, i: int) -> str | None:
        """Why record i is bad from the index alone (a damaged region, its members, its size), or None."""
        a = self.ix._shard(s)
        if a["damage"][i] >= 0:
            return self.damage_reason(s, i)
        if a["problem"][i]:
            return str(a["problem"][i])
        total = sum(n for _, n in self._spans(a, i)[0])
        if total > self.ix.max_record_bytes:
            return self.oversized(total)
        return None

    def read(self, s: int, idx: np.ndarray) -> list[Any]:
        """Records ``idx``: one ``pread`` per member, checked against the indexed CRC-32s."""
        a = self.ix._shard(s)
        disp = self.ix._specs[s].display
        out: list[Any] = []
        for i in idx.tolist():
            loc = f"key '{a['keys'][i]}'" if a["damage"][i] < 0 else f"byte {int(a['damage'][i])}"
            bad = self._bad(s, i)
            if bad is not None:
                out.append(BadRecord(self.ix.name, disp, loc, bad))
                continue
            spans, crcs, names = self._spans(a, i)
            ok = functools.partial(_crcs_match, crcs)
            got = self.ix._intact(s, functools.partial(self._read_spans, s, spans), ok)
            if not ok(got):
                raise self.ix._changed_error(s, loc)
            text, why = conversation_json(got[0])
            if text is None:
                out.append(BadRecord(self.ix.name, disp, loc, f"member '{names[0]}': {why}"))
                continue
            out.append(MMRecord((text, *got[1:]), disp, loc))
        return out

    def sources(self, s: int, record: int) -> list[dict[str, Any]]:
        """The conversation member, then each image member: name and byte range (no read)."""
        a = self.ix._shard(s)
        if a["damage"][record] >= 0:
            return []
        spans, _, names = self._spans(a, record)
        return [
            {"kind": "text" if j == 0 else "image", "member": name, "file_bytes": (off, off + n), "field": None}
            for j, ((off, n), name) in enumerate(zip(spans, names))
            if n >= 0
        ]


def _crcs_match(want: list[int], got: list[bytes]) -> bool:
    return [zlib.crc32(b) for b in got] == want
