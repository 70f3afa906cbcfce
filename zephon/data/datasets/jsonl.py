"""JSON Lines shards (format ``"jsonl"``; ``.jsonl``, ``.ndjson``, ``.json``, optionally
``.gz``/``.zst``): one object per non-blank line, the document under ``text_field``.

The index weighs a record by its whole line's byte length (an estimate of the text's size:
computing the exact one would parse every line at indexing time); a read parses only the lines
asked for and says exactly what is wrong with a bad one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial

from .text import LineReader, check_text, utf8_reason

__all__ = ["JsonJsonlReader", "JsonlReader", "parse_jsonl", "parse_jsonl_value"]


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def parse_jsonl(raw: bytes, field: str, empty_ok: bool = False) -> tuple[str | None, str | None]:
    """``(text, None)`` or ``(None, reason)`` for one JSON line: the string under ``field``.

    >>> parse_jsonl(b'{"text": "hi"}', "text"), parse_jsonl(b'{"t": 1}', "text")[1]
    (('hi', None), "missing field 'text' (fields present: 't')")
    """
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, utf8_reason(raw, e, "line")
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg} (column {e.colno})"
    except RecursionError:
        return None, "invalid JSON: nested too deeply"
    if not isinstance(obj, dict):
        return None, f"the line is valid JSON but {_json_type(obj)}, not an object"
    if field not in obj:
        keys = list(obj)[:8]
        shown = ", ".join(repr(k) for k in keys) + (", ..." if len(obj) > 8 else "")
        return None, f"missing field '{field}' (fields present: {shown or 'none'})"
    v = obj[field]
    if v is None:
        return None, f"field '{field}' is null"
    if not isinstance(v, str):
        return None, f"field '{field}' is {_json_type(v)}, not a string"
    bad = check_text(v, f"field '{field}'", empty_ok)
    if bad:
        return None, bad
    # lone surrogates can only come from \\u escapes (raw was valid UTF-8); isascii() is O(1)
    if not v.isascii() and b"\\u" in raw:
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            return None, f"field '{field}' contains an unpaired surrogate escape (\\u{ord(v[e.start]):04x})"
    return v, None


class JsonlReader(LineReader):
    """JSON Lines: a line shard whose records are parsed with :func:`parse_jsonl`."""

    def parser(self) -> Callable[[bytes], tuple[str | None, str | None]]:
        """:func:`parse_jsonl` for the dataset's ``text_field``."""
        return partial(parse_jsonl, field=self.ix.text_field, empty_ok=self.ix.empty_ok)


def parse_jsonl_value(raw: bytes, field: str) -> tuple[str | None, str | None]:
    """``(json_text, None)`` or ``(None, reason)``: the value under ``field``, whatever its type,
    as JSON text (``text_mode = "json"``: chat conversations, structured records).

    >>> parse_jsonl_value(b'{"messages": [{"role": "user"}]}', "messages")
    ('[{"role": "user"}]', None)
    """
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, utf8_reason(raw, e, "line")
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e.msg} (column {e.colno})"
    except RecursionError:
        return None, "invalid JSON: nested too deeply"
    if not isinstance(obj, dict):
        return None, f"the line is valid JSON but {_json_type(obj)}, not an object"
    if obj.get(field) is None:
        return None, f"missing field '{field}'" if field not in obj else f"field '{field}' is null"
    return json.dumps(obj[field], ensure_ascii=False), None


class JsonJsonlReader(LineReader):
    """JSON Lines read with ``text_mode = "json"``: each record is its field's value as JSON text."""

    def parser(self) -> Callable[[bytes], tuple[str | None, str | None]]:
        """:func:`parse_jsonl_value` for the dataset's ``text_field``."""
        return partial(parse_jsonl_value, field=self.ix.text_field)
