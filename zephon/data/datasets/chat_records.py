"""Vision-language chat records (kind ``"chat"`` of :class:`~.multimodal.MultimodalIndex`): one
conversation and its images. What every format's reader shares: the conversation as JSON text
(what :func:`zephon.data.chat.parse_conversation` accepts), and a Parquet row's image cell as a
list of image bytes.

Why JSON text and not parsed messages: the record's size (the planner's weight) is the text's
UTF-8 size, the same on every reader, and the chat encoder parses it once, in one place.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["cell_images", "chat_row", "conversation_json"]


def _drop_none(v: Any) -> Any:
    """A dict without its None-valued keys (Arrow structs fill absent fields with None)."""
    return {k: x for k, x in v.items() if x is not None} if isinstance(v, dict) else v


def _clean_messages(msgs: Any) -> Any:
    """Messages (and their content parts) without None-valued keys."""
    if not isinstance(msgs, list):
        return msgs
    out = []
    for m in msgs:
        m = _drop_none(m)
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": [_drop_none(p) for p in m["content"]]}
        out.append(m)
    return out


def _shape_reason(obj: Any) -> str | None:
    """Why a parsed JSON value is not a conversation (a list of messages, or an object), or None."""
    if isinstance(obj, (list, dict)):
        return None
    kind = "null" if obj is None else type(obj).__name__
    return f"the conversation is a JSON {kind}, not a list of messages or an object with 'messages'"


def conversation_json(value: Any) -> tuple[str | None, str | None]:
    """``(json_text, None)`` or ``(None, reason)``: a stored conversation as JSON text.

    A string (or UTF-8 bytes) is kept as it is once it parses; a list or object (an Arrow
    list of message structs) is written with :func:`json.dumps`, None-valued keys of messages
    and content parts dropped.

    >>> conversation_json([{"role": "user", "content": [{"type": "image", "text": None}]}])
    ('[{"role": "user", "content": [{"type": "image"}]}]', None)
    >>> conversation_json('{"messages": []}'), conversation_json("nope")[1]
    (('{"messages": []}', None), 'the conversation is not JSON: Expecting value (column 1)')
    """
    if value is None:
        return None, "the conversation is null"
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            return None, f"the conversation is not UTF-8 text (byte {e.start})"
    if isinstance(value, str):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            return None, f"the conversation is not JSON: {e.msg} (column {e.colno})"
        except RecursionError:
            return None, "the conversation is not JSON: nested too deeply"
        bad = _shape_reason(obj)
        return (None, bad) if bad else (value, None)
    bad = _shape_reason(value)
    if bad:
        return None, bad
    if isinstance(value, dict):
        value = {k: _clean_messages(v) if k in ("messages", "conversations") else v for k, v in value.items()}
    else:
        value = _clean_messages(value)
    try:
        return json.dumps(value, ensure_ascii=False), None
    except (TypeError, ValueError) as e:
        return None, f"the conversation cannot be written as JSON ({e})"


def cell_images(value: Any, field: str) -> tuple[list[bytes] | None, str | None]:
    """``(images, None)`` or ``(None, reason)``: a Parquet image cell (a list of binary or of
    Hugging Face ``{bytes, path}`` structs, or one of them) as image bytes in order; null or an
    empty list is no image. The reason names the list entry.

    >>> cell_images([b"a", {"bytes": b"b", "path": None}], "images"), cell_images(None, "images")
    (([b'a', b'b'], None), ([], None))
    >>> cell_images([b"a", None], "images")[1]
    "image 1 of 'images' is null"
    """
    if value is None:
        return [], None
    one = not isinstance(value, (list, tuple))
    out: list[bytes] = []
    for j, v in enumerate([value] if one else value):
        what = f"the image '{field}'" if one else f"image {j} of '{field}'"
        path = None
        if isinstance(v, dict):  # Hugging Face Image feature
            path, v = v.get("path"), v.get("bytes")
        if isinstance(v, (bytes, bytearray, memoryview)):
            out.append(bytes(v))
            continue
        if v is None and path:
            return None, f"{what} has no bytes, only the path {path!r} (images are read from the bytes)"
        if v is None:
            return None, f"{what} is null"
        return None, f"{what} is {type(v).__name__}, not image bytes"
    return out, None


def chat_row(img: Any, txt: Any, image_field: str) -> tuple[tuple[Any, ...] | None, str | None]:
    """A Parquet row's ``(segments, None)`` (the conversation's JSON text, then its images) or
    ``(None, reason)``."""
    text, bad = conversation_json(txt)
    if text is None:
        return None, bad
    images, bad = cell_images(img, image_field)
    if images is None:
        return None, bad
    return (text, *images), None
