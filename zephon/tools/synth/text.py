"""``generate_documents``: the text styles behind one deterministic entry point."""

from __future__ import annotations

from .prose import _books_doc, _web_doc
from .pycode import _code_doc
from .words import _Stream, _style_key

STYLES = ("web", "code", "books")
_GEN_VERSION = 1  # bump when the generated text changes on purpose (and re-pin the test hash)

_GENERATORS = {"web": _web_doc, "code": _code_doc, "books": _books_doc}


def generate_documents(style: str, n: int, seed: int) -> list[str]:
    """``n`` synthetic documents of ``style`` ("web", "code" or "books"), deterministic in
    ``(style, seed, index)``.

    >>> docs = generate_documents("web", 3, seed=0)
    >>> [len(d) for d in docs], generate_documents("web", 2, seed=0) == docs[:2]
    ([2489, 988, 3457], True)
    """
    if style not in _GENERATORS:
        raise ValueError(f"unknown style {style!r}; expected one of {sorted(_GENERATORS)}")
    if int(n) < 0 or int(seed) < 0:
        raise ValueError(f"n and seed must be non-negative integers, got n={n}, seed={seed}")
    gen = _GENERATORS[style]
    key = _style_key(style)
    return [gen(_Stream(int(seed), key, _GEN_VERSION, i)) for i in range(int(n))]
