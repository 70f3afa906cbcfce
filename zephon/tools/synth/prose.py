"""The two prose styles: ``"web"`` (short Zipf prose, titles, lists) and ``"books"`` (long
paragraphs with dialogue)."""

from __future__ import annotations

from .words import _Stream, _zipf_words

_END = (".", ".", ".", ".", ".", ".", "?", "!")
_MONTHS = ("January", "March", "April", "June", "July", "September", "October", "December")


def _number(s: _Stream) -> str:
    k = s.below(6)
    if k == 0:
        return str(1800 + s.below(230))
    if k == 1:
        return f"{s.below(100)}.{s.below(10)}%"
    if k == 2:
        return f"{s.below(1000):,}".replace(",", "")
    if k == 3:
        return f"{_MONTHS[s.below(len(_MONTHS))]} {1 + s.below(28)}"
    if k == 4:
        return f"${1 + s.below(999)}"
    return str(2 + s.below(20))


def _sentence(s: _Stream, sent: list[str], dialogue: bool) -> str:
    n = len(sent)
    for _ in range(2):  # a proper noun or a number now and then
        if s.chance(1, 6):
            j = s.below(len(sent))
            sent[j] = sent[j].capitalize() if s.chance(2, 3) else _number(s)
    if n > 7 and s.chance(1, 2):
        j = 2 + s.below(n - 4)
        sent[j] = sent[j] + (";" if s.chance(1, 10) else ",")
    sent[0] = sent[0].capitalize()
    text = " ".join(sent)
    if dialogue and s.chance(1, 5):
        return f"\u201c{text},\u201d {s.pick(('she', 'he', 'they', 'I'))} {s.pick(('said', 'asked', 'replied', 'whispered'))}."
    if s.chance(1, 40):
        return f"{text} ({s.word()} {s.word()})."
    return text + _END[s.below(len(_END))]


def _prose(
    s: _Stream, nwords: int, sent_lo: int, sent_span: int, par_lo: int, par_span: int, dialogue: bool
) -> list[str]:
    words = _zipf_words(s, nwords)
    paragraphs: list[str] = []
    pos = 0
    while pos < nwords:
        k = par_lo + s.below(par_span)
        sents = []
        while pos < nwords and k > 0:
            end = min(nwords, pos + sent_lo + s.below(sent_span))
            sents.append(_sentence(s, words[pos:end], dialogue))
            pos = end
            k -= 1
        paragraphs.append(" ".join(sents))
    return paragraphs


def _web_doc(s: _Stream) -> str:
    if s.chance(1, 50):
        n = 2000 + s.below(6001)
    else:
        n = s.lognormal_int(150.0, 0.9, 8, 20000)
    parts: list[str] = []
    if s.chance(1, 2):
        title = [s.word().capitalize() for _ in range(3 + s.below(6))]
        parts.append(" ".join(title))
    paragraphs = _prose(s, n, 5, 20, 1, 6, dialogue=False)
    if s.chance(1, 6) and len(paragraphs) > 1:
        items = [f"- {s.word().capitalize()} {s.word()} {s.word()}" for _ in range(2 + s.below(5))]
        paragraphs.insert(1 + s.below(len(paragraphs) - 1), "\n".join(items))
    parts.extend(paragraphs)
    return "\n\n".join(parts)


_ROMAN = ("I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX", "X", "XI", "XII")


def _books_doc(s: _Stream) -> str:
    n = s.lognormal_int(800.0, 0.7, 60, 30000)
    parts: list[str] = []
    if s.chance(1, 3):
        parts.append(f"Chapter {_ROMAN[s.below(len(_ROMAN))]}")
    parts.extend(_prose(s, n, 8, 28, 4, 10, dialogue=True))
    return "\n\n".join(parts)
