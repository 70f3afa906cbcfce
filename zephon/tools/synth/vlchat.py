"""Synthetic vision-language chat records (conversations whose user turns hold images) and their
writers in the three forms zephon reads as ``kind = "chat"``: WebDataset tar, Parquet, JSON Lines.

Record ``i`` depends only on ``(seed, form, i)``, drawn like every synthetic corpus here
(:mod:`.words`), the images drawn by :mod:`.images` (sizes, modes RGB/L/RGBA/P, JPEG/PNG/WebP).
Why such variety: the readers must keep the image order the conversation refers to, so the
records have several images, images in later turns, and no image at all.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from typing import Any

from .chat import _text
from .images import _draw_image
from .words import _Stream
from .writers import _atomic_target

__all__ = [
    "VL_FORMS",
    "generate_vl_conversations",
    "make_vl_chat_corpus",
    "write_vl_chat_jsonl",
    "write_vl_chat_parquet",
    "write_vl_chat_wds",
]

#: conversation forms: "messages" (content parts ``{"type": "image"}``), "sharegpt" (LLaVA's
#: ``{"from", "value"}`` with ``<image>`` markers)
VL_FORMS = ("messages", "sharegpt")
_VL_KEY = 0x71C4A7
_VL_VERSION = 1  # bump when the generated records change on purpose
_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def _image_turns(s: _Stream, turns: int, max_images: int) -> list[int]:
    """The user turn of each image, in order: none now and then, mostly one image in the first
    turn, sometimes several, sometimes one in a later turn."""
    if s.chance(1, 10):
        return []
    n = 1 if s.chance(3, 5) else 1 + s.below(max(1, max_images))
    return sorted(0 if turns == 1 or s.chance(3, 4) else s.below(turns) for _ in range(n))


def _user_turn(form: str, text: str, k: int) -> dict[str, Any]:
    if form == "sharegpt":
        return {"from": "human", "value": "<image>\n" * k + text}
    return {"role": "user", "content": [{"type": "image"}] * k + [{"type": "text", "text": text}]}


def generate_vl_conversations(
    n: int, seed: int, *, max_images: int = 3, form: str = "messages", min_side: int = 24, max_side: int = 96
) -> list[dict[str, Any]]:
    """``n`` deterministic records ``{"conversation": [messages], "images": [encoded bytes]}``:
    1 to 4 user/assistant exchanges, an optional system prompt, up to ``max_images`` images
    (the images' order is the order the conversation refers to them).

    >>> recs = generate_vl_conversations(6, seed=0)
    >>> [len(r["images"]) for r in recs], recs[0]["conversation"][0]["content"][0]
    ([2, 2, 1, 1, 3, 1], {'type': 'image'})
    >>> sg = generate_vl_conversations(1, seed=0, form="sharegpt")[0]["conversation"]
    >>> sg[0]["from"], sg[0]["value"].startswith("<image>\\n")
    ('human', True)
    >>> generate_vl_conversations(3, seed=1) == generate_vl_conversations(3, seed=1)
    True
    """
    if form not in VL_FORMS:
        raise ValueError(f"form must be one of {VL_FORMS}, got {form!r}")
    out = []
    for i in range(int(n)):
        s = _Stream(int(seed), _VL_KEY, _VL_VERSION, i)
        turns = 1 + s.below(4)
        at = _image_turns(s, turns, max_images)
        images = [_draw_image(s, min_side, max_side)[0] for _ in at]
        msgs: list[dict[str, Any]] = []
        if s.chance(1, 4):
            msgs.append({"role": "system", "content": _text(s, 2)})
        for t in range(turns):
            msgs.append(_user_turn(form, _text(s, 3), at.count(t)))
            msgs.append({"role": "assistant", "content": _text(s, 4)})
        if form == "sharegpt":
            msgs = [m if "from" in m else {"from": _ROLE[m["role"]], "value": m["content"]} for m in msgs]
        out.append({"conversation": msgs, "images": images})
    return out


def _ext(data: bytes) -> str:
    """An encoded image's file extension, from its magic bytes."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return "bin"


def write_vl_chat_wds(path: str | os.PathLike, records: list[dict[str, Any]]) -> str:
    """A WebDataset-style tar: per record ``{key}.json`` (the conversation) and its images, one
    as ``{key}.{ext}``, several as ``{key}.0.{ext}``, ``{key}.1.{ext}``, ... Reproducible bytes.

    >>> import os, tarfile, tempfile
    >>> p = write_vl_chat_wds(os.path.join(tempfile.mkdtemp(), "a.tar"), generate_vl_conversations(2, 0))
    >>> tarfile.open(p).getnames()[:3]
    ['00000000.json', '00000000.0.png', '00000000.1.webp']
    """
    path, tmp = _atomic_target(path)

    def add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(data), 0, 0o644, 0, 0, "", ""
        tf.addfile(ti, io.BytesIO(data))

    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i, rec in enumerate(records):
            key = f"{i:08d}"
            add(tf, f"{key}.json", json.dumps(rec["conversation"], ensure_ascii=False).encode("utf-8"))
            imgs = rec["images"]
            for j, img in enumerate(imgs):
                add(tf, f"{key}.{_ext(img)}" if len(imgs) == 1 else f"{key}.{j}.{_ext(img)}", img)
    os.replace(tmp, path)
    return path


def write_vl_chat_parquet(
    path: str | os.PathLike,
    records: list[dict[str, Any]],
    row_group_size: int = 16,
    hf_struct: bool = False,
    as_json: bool = False,
    text_field: str = "messages",
    image_field: str = "images",
) -> str:
    """Parquet with a conversation column (a list of message structs, every ``content`` a list
    of parts so the column has one type; JSON text with ``as_json``) and an image column (a list
    of binary, or of Hugging Face ``{bytes, path}`` structs with ``hf_struct``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, tmp = _atomic_target(path)
    if as_json:
        conv = pa.array([json.dumps(r["conversation"], ensure_ascii=False) for r in records], type=pa.string())
    else:
        parts = lambda c: c if isinstance(c, list) else [{"type": "text", "text": c}]  # noqa: E731
        conv = pa.array(
            [
                [{**m, "content": parts(m["content"])} if "content" in m else m for m in r["conversation"]]
                for r in records
            ]
        )
    if hf_struct:
        item = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        imgs = pa.array([[{"bytes": b, "path": None} for b in r["images"]] for r in records], type=pa.list_(item))
    else:
        imgs = pa.array([r["images"] for r in records], type=pa.list_(pa.binary()))
    # page checksums: zephon verifies them on read, so a corrupted page is refused, not trained on
    table = pa.table({text_field: conv, image_field: imgs})
    pq.write_table(table, tmp, row_group_size=max(1, int(row_group_size)), write_page_checksum=True)
    os.replace(tmp, path)
    return path


def write_vl_chat_jsonl(
    folder: str | os.PathLike,
    records: list[dict[str, Any]],
    form: str = "messages",
    name: str = "chat.jsonl",
    inline: bool = False,
) -> str:
    """``folder/name``: one record a line, its images as files in ``folder/images/`` named by
    relative paths. ``form = "messages"``: ``{"messages": [...], "images": [paths]}`` (with
    ``inline``, the paths in the image content parts instead); ``"sharegpt"``: LLaVA's
    ``{"id", "image": path or [paths], "conversations": [...]}`` (read it with ``image_field =
    "image"``). Returns the JSONL file's path."""
    if form not in VL_FORMS:
        raise ValueError(f"form must be one of {VL_FORMS}, got {form!r}")
    folder = os.fspath(folder)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    stem = os.path.splitext(name)[0]
    lines = []
    for i, rec in enumerate(records):
        paths = []
        for j, img in enumerate(rec["images"]):
            rel = f"images/{stem}-{i:06d}-{j}.{_ext(img)}"
            with open(os.path.join(folder, rel), "wb") as f:
                f.write(img)
            paths.append(rel)
        conv = rec["conversation"]
        if form == "sharegpt":
            obj: dict[str, Any] = {"id": f"{stem}-{i:06d}"}
            if paths:
                obj["image"] = paths[0] if len(paths) == 1 else paths
            obj["conversations"] = conv
        elif inline:
            left = iter(paths)
            obj = {"messages": [_inline(m, left) for m in conv]}
        else:
            obj = {"messages": conv, "images": paths}
        lines.append(json.dumps(obj, ensure_ascii=False) + "\n")
    path, tmp = _atomic_target(os.path.join(folder, name))
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(lines)
    os.replace(tmp, path)
    return path


def _inline(msg: dict[str, Any], paths: Any) -> dict[str, Any]:
    """A message whose image content parts carry the next paths (``{"type": "image", "path": p}``)."""
    content = msg.get("content")
    if not isinstance(content, list):
        return msg
    return {**msg, "content": [{**p, "path": next(paths)} if p.get("type") == "image" else p for p in content]}


def make_vl_chat_corpus(
    root: str | os.PathLike, seed: int = 0, n_wds: int = 32, n_parquet: int = 32, n_jsonl: int = 32
) -> dict[str, str]:
    """Vision-language chat data under ``root``, every dataset read with ``kind = "chat"``;
    returns ``{name: glob}``:

    - ``chat_wds``: 2 tar shards (messages form: a dataset's records have one form);
    - ``chat_parquet``: 2 Parquet shards (message structs + binary images; JSON text + Hugging
      Face image structs);
    - ``chat_jsonl``: 2 JSON Lines files (an ``images`` list; paths in the content parts);
    - ``chat_llava``: 1 JSON Lines file in LLaVA's form (read with ``image_field = "image"``).

    >>> import tempfile
    >>> sorted(make_vl_chat_corpus(tempfile.mkdtemp(), n_wds=4, n_parquet=4, n_jsonl=4))
    ['chat_jsonl', 'chat_llava', 'chat_parquet', 'chat_wds']
    """
    root = os.fspath(root)
    half = lambda k: k // 2  # noqa: E731
    wds = generate_vl_conversations(n_wds, seed)
    write_vl_chat_wds(os.path.join(root, "chat_wds", "vl-0000.tar"), wds[: half(n_wds)])
    write_vl_chat_wds(os.path.join(root, "chat_wds", "vl-0001.tar"), wds[half(n_wds) :])
    pq = generate_vl_conversations(n_parquet, seed + 1)
    write_vl_chat_parquet(os.path.join(root, "chat_parquet", "vl-0000.parquet"), pq[: half(n_parquet)], 8)
    write_vl_chat_parquet(
        os.path.join(root, "chat_parquet", "vl-0001.parquet"), pq[half(n_parquet) :], 8, hf_struct=True, as_json=True
    )
    js = generate_vl_conversations(n_jsonl, seed + 2)
    write_vl_chat_jsonl(os.path.join(root, "chat_jsonl"), js[: half(n_jsonl)], name="vl-0000.jsonl")
    write_vl_chat_jsonl(os.path.join(root, "chat_jsonl"), js[half(n_jsonl) :], name="vl-0001.jsonl", inline=True)
    llava = generate_vl_conversations(n_jsonl, seed + 3, form="sharegpt")
    write_vl_chat_jsonl(os.path.join(root, "chat_llava"), llava, form="sharegpt", name="llava.jsonl")
    return {
        "chat_wds": os.path.join(root, "chat_wds", "*.tar"),
        "chat_parquet": os.path.join(root, "chat_parquet", "*.parquet"),
        "chat_jsonl": os.path.join(root, "chat_jsonl", "*.jsonl"),
        "chat_llava": os.path.join(root, "chat_llava", "*.jsonl"),
    }
