"""Conversations whose turns hold images: their images as content parts, counted in order.

A vision-language chat record holds one conversation and its images (read by
:class:`~zephon.data.datasets.MultimodalIndex`, kind ``"chat"``). Two spellings of an image in
a message are accepted, the two that data is published in:

* the messages form of the Hugging Face processors: a message's ``content`` is a list of parts,
  ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` (OpenAI's ``"image_url"`` parts
  too); any other key of an image part (``image``, ``path``, ``url``) only says where the
  record's reader found its bytes and is dropped here;
* the LLaVA / ShareGPT form: an ``<image>`` marker (:data:`IMAGE_MARK`) inside a message's text,
  one per image; the text is split at each marker into text and image parts, in place (the text
  around it, line breaks included, is kept as written).

Images are numbered in the order the conversation shows them (message by message, part by
part): image ``j`` of the conversation is the record's image ``j``. A message without images
keeps its text as a string, so a template renders it exactly as in text chat.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .chat import CHAT_TOKENIZER, ConversationError, parse_conversation

__all__ = ["IMAGE_MARK", "VL_CHAT_TOKENIZER", "count_images", "image_parts", "parse_vl_conversation"]

#: a demo/test tokenizer for conversations with images: the chat tokenizer
#: (:data:`~zephon.data.chat.CHAT_TOKENIZER`) plus Qwen-VL's four vision special tokens
#: (``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``: ids 4098-4101),
#: its ``tokenizer_config.json`` holding the shipped "chatml_vl" template
VL_CHAT_TOKENIZER = os.path.join(os.path.dirname(CHAT_TOKENIZER), "vlchat")

#: the marker of an image inside a message's text (the LLaVA / ShareGPT form)
IMAGE_MARK = "<image>"
_IMAGE_TYPES = ("image", "image_url")


def _split_marks(text: str) -> list[dict[str, Any]]:
    """A text with ``<image>`` markers as parts (empty texts between markers left out).

    >>> _split_marks("<image>\\nWhat is it?")
    [{'type': 'image'}, {'type': 'text', 'text': '\\nWhat is it?'}]
    """
    out: list[dict[str, Any]] = []
    for j, piece in enumerate(text.split(IMAGE_MARK)):
        if j:
            out.append({"type": "image"})
        if piece:
            out.append({"type": "text", "text": piece})
    return out


def _parts(i: int, role: str, content: list[Any]) -> list[dict[str, Any]]:
    """A message's list of content parts, checked: text parts with a string (markers split),
    image parts reduced to their type."""
    if not content:
        raise ConversationError(f"message {i} ({role}) has an empty list of content parts")
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _IMAGE_TYPES:
            out.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            out.extend(_split_marks(part["text"]))
        else:
            got = f"type {kind!r}" if isinstance(part, dict) else type(part).__name__
            raise ConversationError(
                f"message {i} ({role}) part {j} is {got}; a part is {{'type': 'text', 'text': ...}} or "
                "{'type': 'image'}"
            )
    return out


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with every image as a content part (module doc); a message without images
    keeps a string content (a list of text parts is joined).

    >>> image_parts([{"role": "user", "content": "<image>Hi"}])[0]["content"]
    [{'type': 'image'}, {'type': 'text', 'text': 'Hi'}]
    >>> image_parts([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])[0]["content"]
    'Hi'
    """
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str):
            parts = _split_marks(content) if IMAGE_MARK in content else None
        elif isinstance(content, list):
            parts = _parts(i, m["role"], content)
        else:
            parts = None
        if parts is not None and not any(p["type"] == "image" for p in parts):
            parts = None if isinstance(content, str) else "".join(p["text"] for p in parts)  # type: ignore[assignment]
        out.append(m if parts is None else {**m, "content": parts})
    return out


def count_images(messages: list[dict[str, Any]]) -> int:
    """How many image parts the messages hold (after :func:`image_parts`).

    >>> count_images([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}])
    2
    """
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image"
    )


def parse_vl_conversation(
    value: Any, fmt: str = "messages", system_prompt: str | None = None, field: str | None = None, **roles: Any
) -> dict[str, Any]:
    """:func:`~zephon.data.chat.parse_conversation` for a conversation with images: checked the
    same way (``roles``: its role arguments), its images as content parts (module doc);
    ``images`` says how many it shows. ``field``: where a record object holds its messages when
    not under ``messages`` / ``conversations`` (the dataset's ``text_field``).

    >>> conv = parse_vl_conversation([{"from": "human", "value": "<image>\\nWhat?"}, {"from": "gpt", "value": "A cat."}],
    ...                              "sharegpt")
    >>> conv["images"], conv["messages"][0]["content"]
    (1, [{'type': 'image'}, {'type': 'text', 'text': '\\nWhat?'}])
    """
    obj = value
    if isinstance(value, (str, bytes)):
        try:
            obj = json.loads(value)
        except ValueError:
            obj = None  # parse_conversation says why
    if isinstance(obj, dict):
        keys = [k for k in (field, "messages", "conversations") if k and k in obj]
        if not keys:
            raise ConversationError(
                f"the record has no conversation under {field or 'messages'!r} (its keys: "
                f"{', '.join(map(repr, list(obj)[:8]))}); name its field with the dataset's text_field"
            )
        value = {"messages": obj[keys[0]], "tools": obj.get("tools")}
    conv = parse_conversation(value, fmt, system_prompt, parts=True, **roles)
    msgs = image_parts(conv["messages"])
    return {**conv, "messages": msgs, "images": count_images(msgs)}
