"""Synthetic conversations (the HF/OpenAI ``messages`` form) for the chat tests, demo and notebook.

Conversation ``i`` depends only on ``(seed, i)``, drawn like every synthetic corpus here
(:mod:`.words`): an optional system prompt, 1 to 4 user/assistant exchanges of Zipf words, and
now and then an assistant tool call with its tool result.
"""

from __future__ import annotations

from typing import Any

from .words import _Stream

_CHAT_KEY = 0xC4A7


def _sentence(s: _Stream, lo: int, span: int) -> str:
    words = [s.word() for _ in range(lo + s.below(span))]
    return " ".join(words).capitalize() + s.pick([".", "?", "!", "."])


def _text(s: _Stream, sentences: int) -> str:
    return " ".join(_sentence(s, 3, 10) for _ in range(1 + s.below(sentences)))


def generate_conversations(n: int, seed: int, *, max_turns: int = 4, tools: bool = True) -> list[list[dict[str, Any]]]:
    """``n`` conversations (lists of ``{"role", "content"}`` messages, assistant ``tool_calls``).

    >>> conv = generate_conversations(3, seed=0)[1]
    >>> conv[-1]["role"], generate_conversations(3, seed=0) == generate_conversations(3, seed=0)
    ('assistant', True)
    """
    out = []
    for i in range(n):
        s = _Stream(seed, _CHAT_KEY, i)
        msgs: list[dict[str, Any]] = []
        if s.chance(1, 3):
            msgs.append({"role": "system", "content": _text(s, 2)})
        for _ in range(1 + s.below(max_turns)):
            msgs.append({"role": "user", "content": _text(s, 3)})
            if tools and s.chance(1, 6):
                args = {"query": s.word(), "limit": 1 + s.below(9)}
                call = {"type": "function", "function": {"name": "search", "arguments": args}}
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
                msgs.append({"role": "tool", "content": _text(s, 2)})
            msgs.append({"role": "assistant", "content": _text(s, 5)})
        out.append(msgs)
    return out
