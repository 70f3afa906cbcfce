"""The random stream every draw comes from, and the Zipf vocabulary it draws words from.

Draws use only PCG64's raw 64-bit outputs and integer or plain IEEE float arithmetic, so the
same key gives the same draws on every machine and numpy version. The 30,000-word vocabulary
starts with the common English words of ``head_words.txt`` (package data) and is filled with
pronounceable made-up words; it never depends on the user's seed.
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache
from importlib import resources
from itertools import accumulate

import numpy as np

_VOCAB_SEED = 0x5EED_70C4B  # fixed: the vocabulary never depends on the user's seed


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
    return int.from_bytes(hashlib.sha256(f"zephon.synth/{style}".encode()).digest()[:4], "little")


# ----------------------------------------------------------------------------- vocabulary


def _head_words() -> list[str]:
    """The most frequent words, in rank order (one a line in ``head_words.txt``)."""
    text = resources.files(__package__).joinpath("head_words.txt").read_text(encoding="utf-8")
    return text.split()


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
    for w in _head_words():
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
