"""A record's conversation, read and checked: what the chat renderer (:mod:`.chat`) is given.

Why a module of its own: reading a record as a conversation (its form, roles renamed and checked,
turns in order, a system prompt put first) is what every chat encoder and the token estimates do
before any template is involved; :mod:`.chat` renders what this returns. A conversation is a list
of messages in the form Hugging Face and OpenAI use (``{"role", "content"}``, assistant
``tool_calls``, ``tool`` results, an optional leading ``system``), or the ShareGPT form
(``{"from", "value"}``, roles mapped by :data:`~zephon.data.chatroles.SHAREGPT_ROLES`); a record
may also be an object ``{"messages": [...], "tools": [...]}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from zephon.data.chatroles import ROLES, SHAREGPT_ROLES, may_follow, role_refusal

__all__ = ["CHAT_FORMATS", "ConversationError", "message_strings", "parse_conversation", "render_limit"]

#: how a record holds its conversation: OpenAI / HF ``messages`` or ShareGPT ``conversations``
CHAT_FORMATS = ("messages", "sharegpt")


class ConversationError(ValueError):
    """A conversation that cannot be trained on; the message says which message and why."""


def render_limit(conv: dict[str, Any]) -> int:
    """The most characters a conversation may render to: 1 Mi plus 64 per character of its
    fields (a template repeats a message a few times at most; one that multiplies it is a bomb).

    >>> render_limit({"messages": [{"role": "user", "content": "hi"}]})
    1049664
    """
    chars = sum(len(t) for m in conv["messages"] for _, t in message_strings(m))
    chars += sum(len(t) for _, t in message_strings(conv.get("tools") or []))
    return (1 << 20) + 64 * chars


def message_strings(value: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """Every string in a message or the tools (keys included), with the path of its field.

    >>> list(message_strings({"name": "x", "tool_calls": [{"id": "c1"}]}))
    [('name', 'name'), ('name', 'x'), ('tool_calls', 'tool_calls'), ('tool_calls[0].id', 'id'), ('tool_calls[0].id', 'c1')]
    """
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            sub = f"{key}.{k}" if key else str(k)
            yield sub, str(k)
            yield from message_strings(v, sub)
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            yield from message_strings(v, f"{key}[{j}]")


def _roles_of(
    raw: list[Any],
    fmt: str,
    roles: Sequence[str] = ROLES,
    rename: Mapping[str, str] | None = None,
    known: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """The messages with their roles renamed (``rename`` first; a ShareGPT ``from`` then by
    :data:`SHAREGPT_ROLES`, or as it is) and each one of the accepted ``roles``."""
    rename = dict(rename or {})
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ConversationError(f"message {i} is {type(m).__name__}, not an object")
        if fmt == "sharegpt":
            names = SHAREGPT_ROLES | rename
            who = m.get("from")
            role = names.get(who, who) if isinstance(who, str) else None
            if role not in roles:
                known_names = [*sorted(names), *(r for r in roles if r not in names)]
                raise ConversationError(role_refusal(i, "'from'", who, known_names, known))
            out.append({"role": role, "content": m.get("value")})
            continue
        role = m.get("role")
        role = rename.get(role, role) if isinstance(role, str) else role
        if role not in roles:
            raise ConversationError(role_refusal(i, "role", m.get("role"), roles, known))
        out.append({k: v for k, v in m.items() if v is not None} | {"role": role})
    return out


def _check_turns(msgs: list[dict[str, Any]], parts: bool = False) -> None:
    """System first only; then user, assistant (tool results after an assistant's tool calls; a
    template's own roles where :func:`~zephon.data.chatroles.may_follow` says).
    ``parts``: a content may be a list of content parts (checked by :mod:`.chatimages`)."""
    prev = None
    for i, m in enumerate(msgs):
        role = m["role"]
        content = m.get("content")
        if isinstance(content, list) and not parts:
            raise ConversationError(
                f"message {i} ({role}) has a list of content blocks; text chat needs a string (a dataset whose "
                "conversations hold images sets image_field: vision-language chat)"
            )
        if content is not None and not isinstance(content, (str, list) if parts else str):
            raise ConversationError(f"message {i} ({role}) content is {type(content).__name__}, not a string")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise ConversationError(f"message {i} ({role}) has no content")
        if not may_follow(role, prev, msgs[i - 1] if i else None):
            after = f"after a {prev} message" if prev else "first"
            raise ConversationError(f"message {i} ({role}) comes {after}: turns must alternate user, assistant")
        prev = role
    if not any(m["role"] == "assistant" for m in msgs):
        raise ConversationError("the conversation has no assistant turn (nothing to train on)")


def parse_conversation(
    value: Any,
    fmt: str = "messages",
    system_prompt: str | None = None,
    *,
    parts: bool = False,
    roles: Sequence[str] = ROLES,
    rename: Mapping[str, str] | None = None,
    known: Sequence[str] = (),
) -> dict[str, Any]:
    """``{"messages": [...], "tools": [...] | None}`` from a record's value (a list of messages,
    a JSON text of one, or an object with ``messages`` / ``conversations`` and ``tools``),
    checked: accepted ``roles`` (a renderer's :attr:`ChatRenderer.roles` to accept its template's
    own), alternating turns, at least one assistant turn. ``rename`` maps the record's roles
    first (a ShareGPT ``from``, or a ``role``); ``known``: the template's roles, named when a role
    is refused (one of them not accepted is refused naming ``data_version = 6``). ``system_prompt``
    is put first when the conversation has no system message. ``parts``: contents may be lists of
    content parts (vision-language chat: :func:`zephon.data.chatimages.parse_vl_conversation`).

    >>> parse_conversation([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}], "sharegpt")["messages"]
    [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'yo'}]
    >>> parse_conversation([{"role": "user", "content": "hi"}])
    Traceback (most recent call last):
    ...
    zephon.data.conversation.ConversationError: the conversation has no assistant turn (nothing to train on)
    """
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConversationError(f"invalid JSON: {e}") from None
    tools = None
    if isinstance(value, dict):
        tools = value.get("tools")
        value = value.get("messages", value.get("conversations"))
    if not isinstance(value, list) or not value:
        raise ConversationError("the conversation is not a non-empty list of messages")
    msgs = _roles_of(value, fmt, roles, rename, known)
    if system_prompt is not None and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    _check_turns(msgs, parts)
    return {"messages": msgs, "tools": tools or None}
