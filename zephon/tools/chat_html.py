"""A packed conversation in HTML: the tokens trained on plain, the others hatched, each image
drawn in place of its placeholder run (what :class:`zephon.tools.display.BatchView` shows of a
chat dataset's segment)."""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["conversation_html"]

#: the look of a token run not trained on (label -100): hatched
UNTRAINED_STYLE = "background:repeating-linear-gradient(45deg,transparent,transparent 3px,#d1d5db 3px,#d1d5db 5px)"


def conversation_html(
    ids: np.ndarray,
    trained: np.ndarray,
    span: tuple[int, int],
    images: Mapping[int, tuple[int, str]],
    decode: Callable[[Any], str],
    max_chars: int,
) -> str:
    """Tokens ``span`` of a row (``ids``; ``trained[t]``: token t is a target) as HTML: each run of
    trained / untrained tokens decoded on its own, each image's HTML in place of its block
    (``images[start] = (stop, html)``: the block's row positions), text cut after ``max_chars``.

    >>> html_ = conversation_html(np.array([1, 2, 3]), np.array([False, True, True]), (0, 3), {}, str, 100)
    >>> html_.count("zp-untrained"), html_.count("zp-trained")
    (1, 1)
    """
    parts, t, hi, budget = [], span[0], span[1], max_chars
    while t < hi:
        if t in images:
            t, shown = images[t]
            parts.append(shown)
            continue
        stop = min([b for b in images if t < b < hi] + [hi])
        stop = t + 1 + int(np.argmax(np.append(trained[t + 1 : stop] != trained[t], True)))
        text = decode(ids[t:stop]) if budget > 0 else ""
        budget -= len(text)
        text = html.escape(text if budget >= 0 else text[: len(text) + budget] + "…")
        if trained[t]:
            parts.append(f'<span class="zp-trained">{text}</span>')
        elif text:
            parts.append(
                f'<span class="zp-untrained" title="not trained on (label -100)" style="{UNTRAINED_STYLE}">{text}</span>'
            )
        t = stop
    return "".join(parts)
