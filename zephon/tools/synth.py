"""Deterministic synthetic corpora for the demo, the tests and the benchmarks.

``generate_documents(style, n, seed)`` returns the same strings, byte for byte, on every run,
machine and numpy version: every draw comes from the raw 64-bit output of a PCG64 bit
generator keyed by ``SeedSequence([seed, style key, doc index])`` (both have a stability
guarantee in numpy), turned into numbers with integer arithmetic and plain IEEE float
operations only. No ``numpy.random.Generator`` distributions (their algorithms may change
between numpy versions), no ``hash()``, no set or dict-of-set ordering.

Document ``i`` depends only on ``(style, seed, i)``: ``generate_documents(s, 50, k)`` is a
prefix of ``generate_documents(s, 100, k)``.

Styles:
- ``"web"``: prose from a Zipf-distributed English-like vocabulary; log-normal lengths, median
  ~150 words, ~2% long documents of 2,000-8,000 words; optional title, paragraphs.
- ``"code"``: Python-like modules (imports, functions, classes, indentation, literals,
  operators); clearly more tokens per byte than prose.
- ``"books"``: long paragraphs with dialogue, median ~800 words, some chapters of many
  thousand words.

Writers: :func:`write_jsonl` (plain, gzip or zstd), :func:`write_parquet`,
:func:`write_text_lines` (one document per line), :func:`write_text_files` (one file each).
:func:`make_demo_corpus` writes a three-dataset mixture and returns a glob per dataset.

This module imports nothing from the rest of zephon.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import keyword
import math
import os
from functools import lru_cache
from itertools import accumulate

import numpy as np

__all__ = [
    "STYLES",
    "generate_documents",
    "generate_image_text",
    "generate_interleaved",
    "make_demo_corpus",
    "make_vision_corpus",
    "write_image_parquet",
    "write_interleaved_parquet",
    "write_jsonl",
    "write_parquet",
    "write_text_files",
    "write_text_lines",
    "write_wds",
]

STYLES = ("web", "code", "books")
_VOCAB_SEED = 0x5EED_70C4B  # fixed: the vocabulary never depends on the user's seed
_GEN_VERSION = 1  # bump when the generated text changes on purpose (and re-pin the test hash)


# ----------------------------------------------------------------------------- random stream
class _Stream:
    """Draws built only from PCG64's raw 64-bit outputs (stable across numpy versions)."""

    __slots__ = ("_bg", "_buf", "_pos", "_words", "_wpos")

    def __init__(self, *key: int) -> None:
        self._bg = np.random.PCG64(np.random.SeedSequence([int(k) for k in key]))
        self._buf: list[int] = []
        self._pos = 0
        self._words: list[str] = []
        self._wpos = 0

    def raw(self, n: int) -> np.ndarray:
        return self._bg.random_raw(n)

    def u64(self) -> int:
        if self._pos >= len(self._buf):
            self._buf = self._bg.random_raw(256).tolist()
            self._pos = 0
        v = self._buf[self._pos]
        self._pos += 1
        return v

    def below(self, k: int) -> int:
        """An integer in [0, k) (modulo bias < 2**-40 for the small k used here)."""
        return self.u64() % k

    def chance(self, num: int, den: int) -> bool:
        return self.u64() % den < num

    def pick(self, seq):
        return seq[self.u64() % len(seq)]

    def uniform(self) -> float:
        return (self.u64() >> 11) * (1.0 / 9007199254740992.0)

    def normal(self) -> float:
        """Irwin-Hall approximation (sum of 12 uniforms - 6): only IEEE additions."""
        s = 0.0
        for _ in range(12):
            s += self.uniform()
        return s - 6.0

    def lognormal_int(self, median: float, sigma: float, lo: int, hi: int) -> int:
        v = median * math.exp(sigma * self.normal())  # rounded to an int right away
        return max(lo, min(hi, int(v + 0.5)))

    def word(self) -> str:
        """A vocabulary word drawn from the Zipf distribution (buffered)."""
        if self._wpos >= len(self._words):
            self._words = _zipf_words(self, 256)
            self._wpos = 0
        w = self._words[self._wpos]
        self._wpos += 1
        return w


def _style_key(style: str) -> int:
    # "zephon.synth/...": the seed string every corpus was made with (the module's old path); never change it
    return int.from_bytes(hashlib.sha256(f"zephon.synth/{style}".encode()).digest()[:4], "little")


# ----------------------------------------------------------------------------- vocabulary
_HEAD = [
    "the",
    "of",
    "and",
    "to",
    "a",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "would",
    "their",
    "we",
    "him",
    "been",
    "has",
    "when",
    "who",
    "will",
    "no",
    "more",
    "if",
    "out",
    "so",
    "up",
    "said",
    "what",
    "its",
    "about",
    "than",
    "into",
    "them",
    "can",
    "only",
    "other",
    "time",
    "new",
    "some",
    "could",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "place",
    "small",
    "found",
    "part",
    "house",
    "water",
    "number",
    "sound",
    "word",
    "home",
    "hand",
    "high",
    "land",
    "light",
    "city",
    "tree",
    "story",
    "river",
    "night",
    "mother",
    "father",
    "school",
    "country",
    "point",
    "answer",
    "study",
    "learn",
    "plant",
    "cover",
    "food",
    "sun",
    "four",
    "thought",
    "keep",
    "eye",
    "let",
    "head",
    "under",
    "story",
    "saw",
    "far",
    "sea",
    "draw",
    "left",
    "late",
    "run",
    "while",
    "press",
    "close",
    "real",
    "few",
    "north",
    "open",
    "seem",
    "together",
    "next",
    "white",
    "children",
    "begin",
    "got",
    "walk",
    "example",
    "ease",
    "paper",
    "often",
    "always",
    "music",
    "those",
    "both",
    "mark",
    "book",
    "letter",
    "until",
    "mile",
    "feet",
    "care",
    "second",
    "group",
    "carry",
    "took",
    "rain",
    "eat",
    "room",
    "friend",
    "began",
    "idea",
    "fish",
    "mountain",
    "stop",
    "once",
    "base",
    "hear",
    "horse",
    "cut",
    "sure",
    "watch",
    "color",
    "face",
    "wood",
    "main",
    "enough",
    "plain",
    "girl",
    "usual",
    "young",
    "ready",
    "above",
    "ever",
    "red",
    "list",
    "though",
    "feel",
    "talk",
    "bird",
    "soon",
    "body",
    "dog",
    "family",
    "direct",
    "pose",
    "leave",
    "song",
    "measure",
    "door",
]

_ONSETS = (
    "",
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "y",
    "z",
    "br",
    "cr",
    "dr",
    "fr",
    "gr",
    "pr",
    "tr",
    "bl",
    "cl",
    "fl",
    "gl",
    "pl",
    "sl",
    "st",
    "sp",
    "sk",
    "sm",
    "sn",
    "sw",
    "ch",
    "sh",
    "th",
    "wh",
    "qu",
    "str",
    "spr",
    "thr",
)
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ea", "ee", "oo", "ou", "ie", "y", "io", "oa")
_CODAS = (
    "",
    "",
    "",
    "",
    "n",
    "r",
    "s",
    "t",
    "l",
    "m",
    "nd",
    "st",
    "ng",
    "nt",
    "rd",
    "ck",
    "sh",
    "ch",
    "th",
    "x",
    "ld",
    "rt",
    "ss",
    "ll",
    "mp",
    "pt",
)
_SUFFIXES = ("ing", "ed", "ly", "tion", "ness", "ment", "er", "est", "able", "ity", "s", "al", "ive")
_VOCAB_SIZE = 30000


@lru_cache(maxsize=1)
def _vocab() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(words as an object array, cumulative integer Zipf weights, words as a list)."""
    s = _Stream(_VOCAB_SEED)
    seen: dict[str, None] = {}
    for w in _HEAD:
        seen.setdefault(w, None)
    head_n = len(seen)
    cands: list[tuple[int, int, str]] = []
    uniq: dict[str, None] = dict(seen)
    i = 0
    while len(uniq) < _VOCAB_SIZE:
        r = s.below(11)
        nsyl = 1 if r < 4 else 2 if r < 8 else 3 if r < 10 else 4
        w = "".join(s.pick(_ONSETS) + s.pick(_VOWELS) + s.pick(_CODAS) for _ in range(nsyl))
        if s.chance(1, 4):
            w += s.pick(_SUFFIXES)
        if 2 <= len(w) <= 16 and w not in uniq:
            uniq[w] = None
            # frequent words tend to be short: order by length plus noise, ties by draw order
            cands.append((len(w) + s.below(6), i, w))
        i += 1
    cands.sort()
    for _, _, w in cands:
        seen[w] = None
    words = list(seen)
    assert len(words) == _VOCAB_SIZE and head_n < 300
    # Zipf-Mandelbrot weights 1/(r + 2.7) in exact integer arithmetic
    weights = [(1 << 44) // (10 * r + 27) for r in range(len(words))]
    cum = np.array(list(accumulate(weights)), dtype=np.uint64)
    return np.array(words, dtype=object), cum, words


def _zipf_words(s: _Stream, n: int) -> list[str]:
    arr, cum, _ = _vocab()
    target = s.raw(n) % cum[-1]
    idx = np.searchsorted(cum, target, side="right")
    return arr[idx].tolist()


# ----------------------------------------------------------------------------- prose
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


# ----------------------------------------------------------------------------- code
_MODULES = (
    "os",
    "sys",
    "json",
    "re",
    "math",
    "time",
    "typing",
    "pathlib",
    "itertools",
    "collections",
    "dataclasses",
    "functools",
    "numpy as np",
    "logging",
)
_BASES = ("object", "Exception", "dict", "Base", "nn.Module", "Protocol")
_OPS = (" + ", " - ", " * ", " // ", " % ", " == ", " != ", " < ", " >= ", " and ", " or ")
_BUILTINS = ("len", "range", "sorted", "list", "dict", "str", "int", "min", "max", "sum", "zip", "enumerate")


def _code_word(s: _Stream) -> str:
    """Identifier parts: one third Zipf-common, two thirds uniform over the vocabulary (code
    names are more diverse than prose, so code has more tokens per byte)."""
    if s.chance(1, 3):
        return s.word()
    return _vocab()[2][s.below(_VOCAB_SIZE)]


def _ident(s: _Stream) -> str:
    name = "_".join(_code_word(s) for _ in range(1 + s.below(3)))
    return name + "_" if keyword.iskeyword(name) else name


def _camel(s: _Stream) -> str:
    return "".join(_code_word(s).capitalize() for _ in range(1 + s.below(3)))


def _atom(s: _Stream, names: list[str]) -> str:
    k = s.below(10)
    if k < 4 and names:
        return s.pick(names)
    if k < 6:
        k = s.below(8)
        if k < 4:
            return str(s.below(256))
        if k < 6:
            return f"{s.below(100)}.{s.below(100)}"
        return f"0x{s.u64() & 0xFFFF:04x}" if k == 6 else f"{1 + s.below(9)}e-{1 + s.below(9)}"
    if k < 8:
        return f'"{s.word()}"' if s.chance(1, 2) else f"'{s.word()}_{s.word()}'"
    if k == 8:
        return "None" if s.chance(1, 2) else s.pick(("True", "False"))
    return f"self.{s.word()}"


def _expr(s: _Stream, names: list[str], depth: int = 0) -> str:
    k = s.below(12) if depth < 2 else 0
    if k < 4:
        return _atom(s, names)
    if k < 6:
        return _expr(s, names, depth + 1) + s.pick(_OPS) + _expr(s, names, depth + 1)
    if k < 8:
        fn = s.pick(_BUILTINS) if s.chance(1, 2) else _ident(s)
        args = ", ".join(_expr(s, names, depth + 1) for _ in range(s.below(3)))
        return f"{fn}({args})"
    if k == 8:
        v = s.pick(names) if names else "x"
        return f"[{v} * {s.below(10)} for {v} in {_atom(s, names)}]"
    if k == 9:
        return f'{{"{s.word()}": {_atom(s, names)}, "{s.word()}": {_atom(s, names)}}}'
    if k == 10:
        return f"{_atom(s, names)}[{s.below(8)}]"
    return f'f"{s.word()} {{{_atom(s, names)}}}"'


def _block(s: _Stream, out: list[str], ind: str, names: list[str], budget: int, depth: int) -> int:
    n = 1 + s.below(5)
    for _ in range(n):
        if budget <= 0:
            break
        k = s.below(14)
        if k < 5:
            v = _ident(s)
            out.append(f"{ind}{v} = {_expr(s, names)}")
            names.append(v)
            budget -= 1
        elif k < 7 and depth < 3:
            v = s.pick(("i", "item", "row", "key", "node", "line", "k"))
            out.append(f"{ind}for {v} in {_expr(s, names, 1)}:")
            names.append(v)
            budget = _block(s, out, ind + "    ", names, budget - 1, depth + 1)
        elif k < 9 and depth < 3:
            out.append(f"{ind}if {_expr(s, names, 1)}:")
            budget = _block(s, out, ind + "    ", names, budget - 1, depth + 1)
            if s.chance(1, 3):
                out.append(f"{ind}else:")
                budget = _block(s, out, ind + "    ", names, budget - 1, depth + 1)
        elif k < 11:
            out.append(f"{ind}# {' '.join(s.word() for _ in range(2 + s.below(8)))}")
            budget -= 1
        elif k < 13:
            obj = s.pick(names) if names else "self"
            out.append(f"{ind}{obj}.{s.word()}({_expr(s, names, 1)})")
            budget -= 1
        else:
            out.append(f'{ind}raise ValueError(f"{s.word()} {{{_atom(s, names)}!r}}")')
            budget -= 1
    return budget


def _function(s: _Stream, out: list[str], ind: str, method: bool, budget: int) -> int:
    params = [_ident(s) for _ in range(s.below(4))]
    sig = ", ".join(
        (["self"] if method else [])
        + [p + (f": {s.pick(('int', 'str', 'float', 'list', 'dict'))}" if s.chance(1, 2) else "") for p in params]
    )
    ret = f" -> {s.pick(('int', 'str', 'bool', 'None', 'list[str]', 'dict'))}" if s.chance(1, 2) else ""
    out.append(f"{ind}def {_ident(s)}({sig}){ret}:")
    if s.chance(1, 2):
        out.append(f'{ind}    """{" ".join(s.word() for _ in range(3 + s.below(10))).capitalize()}."""')
    names = list(params)
    budget = _block(s, out, ind + "    ", names, budget, 1)
    out.append(f"{ind}    return {_expr(s, names)}")
    return budget - 2


def _code_doc(s: _Stream) -> str:
    budget = s.lognormal_int(30.0, 0.8, 4, 2000)
    out: list[str] = []
    for _ in range(s.below(5)):
        m = s.pick(_MODULES)
        out.append(f"import {m}" if s.chance(1, 2) or " as " in m else f"from {m} import {_ident(s)}, {_camel(s)}")
    if out:
        out.append("")
    if s.chance(1, 3):
        out.append(f"{_ident(s).upper()} = {s.below(4096)}")
        out.append("")
    while budget > 0:
        if s.chance(1, 3):
            out.append("")
            out.append(f"class {_camel(s)}({s.pick(_BASES)}):")
            if s.chance(1, 2):
                out.append(f'    """{" ".join(s.word() for _ in range(4 + s.below(8))).capitalize()}."""')
            for _ in range(1 + s.below(3)):
                out.append("")
                budget = _function(s, out, "    ", True, min(budget, 12))
        else:
            out.append("")
            budget = _function(s, out, "", False, min(budget, 15))
        out.append("")
    return "\n".join(out).strip("\n") + "\n"


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


# ----------------------------------------------------------------------------- writers
def _atomic_target(path: str | os.PathLike) -> tuple[str, str]:
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    return path, path + f".tmp{os.getpid()}"


def write_jsonl(
    path: str | os.PathLike, docs: list[str], text_field: str = "text", compression: str | None = None
) -> str:
    """One JSON object per line: ``{text_field: doc, "id": i}``. ``compression``: None, "gz"
    (gzip, mtime 0 so the bytes are reproducible) or "zst" (zstandard).

    >>> import os, tempfile
    >>> path = write_jsonl(os.path.join(tempfile.mkdtemp(), "a.jsonl"), ["one", "two"])
    >>> open(path).read().splitlines()[1]
    '{"text": "two", "id": 1}'
    """
    path, tmp = _atomic_target(path)
    payload = "".join(
        json.dumps({text_field: d, "id": i}, ensure_ascii=False) + "\n" for i, d in enumerate(docs)
    ).encode("utf-8")
    if compression is None:
        data = payload
    elif compression in ("gz", "gzip"):
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as g:
            g.write(payload)
        data = buf.getvalue()
    elif compression in ("zst", "zstd"):
        try:
            import zstandard
        except ImportError as e:  # pragma: no cover - zstandard is installed here
            raise ImportError("write_jsonl(compression='zst') needs the 'zstandard' package") from e
        data = zstandard.ZstdCompressor(level=3).compress(payload)
    else:
        raise ValueError(f"compression must be None, 'gz' or 'zst', got {compression!r}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def write_parquet(
    path: str | os.PathLike, docs: list[str], text_field: str = "text", row_group_size: int = 1000
) -> str:
    """A Parquet file with columns ``text_field`` (string) and ``id`` (int64), split into row
    groups of ``row_group_size`` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, tmp = _atomic_target(path)
    table = pa.table({text_field: pa.array(docs, type=pa.string()), "id": pa.array(range(len(docs)), type=pa.int64())})
    # page checksums: zephon verifies them on read, so a corrupted page is refused, not trained on
    pq.write_table(table, tmp, row_group_size=max(1, int(row_group_size)), write_page_checksum=True)
    os.replace(tmp, path)
    return path


def write_text_lines(path: str | os.PathLike, docs: list[str]) -> str:
    """One document per line; newlines (and carriage returns) inside a document become spaces."""
    path, tmp = _atomic_target(path)
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(d.replace("\r\n", " ").replace("\n", " ").replace("\r", " "))
            f.write("\n")
    os.replace(tmp, path)
    return path


def write_text_files(directory: str | os.PathLike, docs: list[str], prefix: str = "doc") -> list[str]:
    """One UTF-8 file per document: ``{prefix}_{i:06d}.txt``. Returns the paths."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for i, d in enumerate(docs):
        p = os.path.join(directory, f"{prefix}_{i:06d}.txt")
        with open(p, "w", encoding="utf-8", newline="") as f:
            f.write(d)
        paths.append(p)
    return paths


# ----------------------------------------------------------------------------- demo corpus
_MARKER = ".zephon_demo.json"


def _demo_plan(seed: int, scale: float) -> dict:
    def n(base: int) -> int:
        return max(1, int(round(base * scale)))

    return {
        "web": {"style": "web", "docs": n(2400), "shards": 4, "format": "jsonl", "seed": seed * 3 + 0},
        "code": {
            "style": "code",
            "docs": n(2400),
            "shards": 3,
            "format": "parquet",
            "seed": seed * 3 + 1,
            "row_group_size": max(1, n(2400) // 3 // 4),
        },
        "books": {"style": "books", "docs": n(320), "shards": 2, "format": "text_lines", "seed": seed * 3 + 2},
    }


def make_demo_corpus(root: str | os.PathLike, seed: int = 0, scale: float = 1.0) -> dict[str, str]:
    """Write the demo mixture under ``root`` and return ``{dataset: glob pattern}``:

    - ``web/``: JSONL shards (``web-0000.jsonl`` ...), field ``text``;
    - ``code/``: Parquet shards with several row groups each, column ``text``;
    - ``books/``: text files, one document per line.

    About 7 MB at ``scale=1.0``. Idempotent: a marker file records the parameters, and a call
    with the same ``(seed, scale)`` whose files all exist writes nothing.
    """
    root = os.fspath(root)
    if int(seed) < 0 or not scale > 0:
        raise ValueError(f"seed must be >= 0 and scale > 0, got seed={seed}, scale={scale}")
    seed = int(seed)
    scale = float(scale)
    plan = _demo_plan(seed, scale)
    patterns = {
        "web": os.path.join(root, "web", "*.jsonl"),
        "code": os.path.join(root, "code", "*.parquet"),
        "books": os.path.join(root, "books", "*.txt"),
    }
    params = {"version": _GEN_VERSION, "seed": seed, "scale": scale, "plan": plan}
    marker = os.path.join(root, _MARKER)
    if os.path.exists(marker):
        try:
            with open(marker, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, ValueError):
            old = {}
        if old.get("params") == params and all(os.path.exists(os.path.join(root, p)) for p in old.get("files", [])):
            return patterns
        # different parameters (or damaged): remove what the old marker says we wrote
        for p in old.get("files", []):
            fp = os.path.join(root, p)
            if os.path.isfile(fp):
                os.remove(fp)
        os.remove(marker)

    files: list[str] = []
    for name, spec in plan.items():
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        docs = generate_documents(spec["style"], spec["docs"], spec["seed"])
        k = spec["shards"]
        bounds = [len(docs) * j // k for j in range(k + 1)]
        for j in range(k):
            part = docs[bounds[j] : bounds[j + 1]]
            if spec["format"] == "jsonl":
                rel = f"{name}/{name}-{j:04d}.jsonl"
                write_jsonl(os.path.join(root, rel), part)
            elif spec["format"] == "parquet":
                rel = f"{name}/{name}-{j:04d}.parquet"
                write_parquet(os.path.join(root, rel), part, row_group_size=spec["row_group_size"])
            else:
                rel = f"{name}/{name}-{j:04d}.txt"
                write_text_lines(os.path.join(root, rel), part)
            files.append(rel)
    tmp = marker + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"params": params, "files": files}, f, indent=1, sort_keys=True)
    os.replace(tmp, marker)
    return patterns


# ----------------------------------------------------------------------------- image-text corpora
IMAGE_FORMATS = ("jpeg", "png", "webp")
_IMG_EXT = {"jpeg": "jpg", "png": "png", "webp": "webp"}
_IMG_VERSION = 1  # bump when the generated images change on purpose


def _caption(s: _Stream, lo: int = 4, span: int = 20) -> str:
    n = lo + s.below(span)
    words = [s.word() for _ in range(n)]
    words[0] = words[0].capitalize()
    return " ".join(words) + "."


def _draw_image(s: _Stream, min_side: int, max_side: int) -> tuple[bytes, str]:
    """One small drawn image, encoded: (bytes, extension). Sizes, modes, formats and EXIF
    orientations vary; every draw comes from ``s``."""
    from PIL import Image, ImageDraw

    w = min_side + s.below(max_side - min_side + 1)
    h = min_side + s.below(max_side - min_side + 1)
    fmt = IMAGE_FORMATS[s.below(3)]
    mode = ("RGB", "RGB", "L", "RGBA", "P")[s.below(5)]
    if fmt == "jpeg" and mode in ("RGBA", "P"):
        mode = "RGB"
    bg = tuple(s.below(256) for _ in range(3))
    img = Image.new("RGB", (w, h), bg)
    d = ImageDraw.Draw(img)
    for _ in range(2 + s.below(4)):
        x0, y0 = s.below(w), s.below(h)
        x1, y1 = x0 + 1 + s.below(w), y0 + 1 + s.below(h)
        col = tuple(s.below(256) for _ in range(3))
        (d.rectangle if s.below(2) else d.ellipse)([x0, y0, x1, y1], fill=col)
    if mode == "L":
        img = img.convert("L")
    elif mode == "RGBA":
        img = img.convert("RGBA")
        img.putalpha(Image.new("L", (w, h), 128 + s.below(128)))
    elif mode == "P":
        img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    buf = io.BytesIO()
    if fmt == "jpeg":
        kw: dict = {"quality": 85}
        if s.below(3) == 0:  # EXIF orientation: the pixels are stored rotated
            exif = Image.Exif()
            exif[0x0112] = (3, 6, 8)[s.below(3)]
            kw["exif"] = exif.tobytes()
        img.save(buf, format="JPEG", **kw)
    elif fmt == "png":
        img.save(buf, format="PNG", optimize=False, compress_level=6)
    else:
        img.save(buf, format="WEBP", quality=80, method=4)
    return buf.getvalue(), _IMG_EXT[fmt]


def generate_image_text(n: int, seed: int, *, min_side: int = 24, max_side: int = 96) -> list[dict]:
    """``n`` deterministic image-caption samples: ``{"key", "image" (encoded bytes), "ext",
    "caption"}``. Formats JPEG/PNG/WebP, modes RGB/L/RGBA/P, some JPEGs with an EXIF
    orientation; sample ``i`` depends only on ``(seed, i)`` (and the Pillow codecs).

    >>> s = generate_image_text(2, seed=0)[0]
    >>> s["key"], s["ext"], s["caption"]
    ('00000000', 'jpg', 'Vou zorcri to sneet at has of ress of her than in stair.')
    """
    key = _style_key("image_text")
    out = []
    for i in range(int(n)):
        s = _Stream(int(seed), key, _IMG_VERSION, i)
        data, ext = _draw_image(s, min_side, max_side)
        out.append({"key": f"{i:08d}", "image": data, "ext": ext, "caption": _caption(s)})
    return out


def generate_interleaved(
    n: int, seed: int, *, min_side: int = 24, max_side: int = 96, max_images: int = 3
) -> list[dict]:
    """``n`` OBELICS-style documents ``{"texts": [str|None], "images": [bytes|None]}``: at each
    position exactly one of the two is set; 1..max_images images among 1..4 text segments.

    >>> doc = generate_interleaved(1, seed=0)[0]
    >>> [("text" if t is not None else "image") for t in doc["texts"]]
    ['image', 'text']
    """
    key = _style_key("interleaved")
    out = []
    for i in range(int(n)):
        s = _Stream(int(seed), key, _IMG_VERSION, i)
        n_img = 1 + s.below(max_images)
        n_txt = 1 + s.below(4)
        slots = ["t"] * n_txt + ["i"] * n_img
        for j in range(len(slots) - 1, 0, -1):  # Fisher-Yates with our own draws
            k = s.below(j + 1)
            slots[j], slots[k] = slots[k], slots[j]
        texts: list = []
        images: list = []
        for kind in slots:
            if kind == "t":
                texts.append(_caption(s, 6, 30))
                images.append(None)
            else:
                texts.append(None)
                images.append(_draw_image(s, min_side, max_side)[0])
        out.append({"texts": texts, "images": images})
    return out


def write_wds(path: str | os.PathLike, samples: list[dict], caption: str = "txt", text_field: str = "caption") -> str:
    """A WebDataset-style tar: per sample ``{key}.{ext}`` (the image, if not None) and
    ``{key}.txt`` (or ``{key}.json`` with ``{text_field: caption}``; omitted if None).
    Reproducible bytes (mtime 0, uid 0)."""
    import tarfile

    path, tmp = _atomic_target(path)

    def add(tf, name: str, data: bytes) -> None:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(data), 0, 0o644, 0, 0, "", ""
        tf.addfile(ti, io.BytesIO(data))

    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tf:
        for smp in samples:
            if smp.get("image") is not None:
                add(tf, f"{smp['key']}.{smp.get('ext', 'jpg')}", smp["image"])
            if smp.get("caption") is not None:
                if caption == "json":
                    add(tf, f"{smp['key']}.json", json.dumps({text_field: smp["caption"]}).encode())
                else:
                    add(tf, f"{smp['key']}.txt", smp["caption"].encode("utf-8"))
    os.replace(tmp, path)
    return path


def write_image_parquet(
    path: str | os.PathLike,
    samples: list[dict],
    image_field: str = "image",
    text_field: str = "caption",
    row_group_size: int = 64,
    hf_struct: bool = False,
) -> str:
    """Parquet with an image column (binary, or Hugging Face's ``{bytes, path}`` struct with
    ``hf_struct``) and a caption column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, tmp = _atomic_target(path)
    imgs = [smp.get("image") for smp in samples]
    if hf_struct:
        col = pa.array(
            [None if b is None else {"bytes": b, "path": None} for b in imgs],
            type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
        )
    else:
        col = pa.array(imgs, type=pa.binary())
    table = pa.table(
        {image_field: col, text_field: pa.array([smp.get("caption") for smp in samples], type=pa.string())}
    )
    # page checksums: zephon verifies them on read, so a corrupted page is refused, not trained on
    pq.write_table(table, tmp, row_group_size=max(1, int(row_group_size)), write_page_checksum=True)
    os.replace(tmp, path)
    return path


def write_interleaved_parquet(path: str | os.PathLike, docs: list[dict], row_group_size: int = 32) -> str:
    """OBELICS-style Parquet: columns ``texts`` (list<string>) and ``images`` (list<binary>)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, tmp = _atomic_target(path)
    table = pa.table(
        {
            "texts": pa.array([d["texts"] for d in docs], type=pa.list_(pa.string())),
            "images": pa.array([d["images"] for d in docs], type=pa.list_(pa.binary())),
        }
    )
    # page checksums: zephon verifies them on read, so a corrupted page is refused, not trained on
    pq.write_table(table, tmp, row_group_size=max(1, int(row_group_size)), write_page_checksum=True)
    os.replace(tmp, path)
    return path


def make_vision_corpus(
    root: str | os.PathLike, seed: int = 0, n_wds: int = 96, n_parquet: int = 64, n_interleaved: int = 32
) -> dict[str, str]:
    """Image-text data under ``root``: ``wds/`` (2 tar shards, .txt and .json captions),
    ``pairs/`` (2 Parquet shards, image bytes + caption), ``interleaved/`` (1 Parquet shard).
    Returns ``{name: glob}``."""
    root = os.fspath(root)
    samples = generate_image_text(n_wds + n_parquet, seed)
    half = n_wds // 2
    write_wds(os.path.join(root, "wds", "wds-0000.tar"), samples[:half], caption="txt")
    write_wds(os.path.join(root, "wds", "wds-0001.tar"), samples[half:n_wds], caption="json")
    rest = samples[n_wds:]
    write_image_parquet(os.path.join(root, "pairs", "pairs-0000.parquet"), rest[: len(rest) // 2], row_group_size=16)
    write_image_parquet(
        os.path.join(root, "pairs", "pairs-0001.parquet"), rest[len(rest) // 2 :], row_group_size=16, hf_struct=True
    )
    write_interleaved_parquet(
        os.path.join(root, "interleaved", "obelics-0000.parquet"),
        generate_interleaved(n_interleaved, seed + 1),
        row_group_size=8,
    )
    return {
        "wds": os.path.join(root, "wds", "*.tar"),
        "pairs": os.path.join(root, "pairs", "*.parquet"),
        "interleaved": os.path.join(root, "interleaved", "*.parquet"),
    }


if __name__ == "__main__":  # pragma: no cover - manual look at the output
    import sys

    style = sys.argv[1] if len(sys.argv) > 1 else "web"
    for doc in generate_documents(style, 2, 0):
        print(doc[:1500])
        print("=" * 80)
