"""O(1)-memory seeded bijections of ``range(n)`` (an index shuffle, as in Grain).

A balanced Feistel network on the smallest even number of bits covering ``n``, with
cycle-walking to stay inside ``[0, n)``. Nothing proportional to ``n`` is ever stored, so a
WorkSource can permute a billion-record corpus per epoch and any lane can compute the record
at any position directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["IndexPermutation"]

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


def _feistel_each(x: np.ndarray, half: np.ndarray, mask: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """:meth:`IndexPermutation._feistel` with per-element parameters (the same uint64 arithmetic)."""
    left = x >> half
    right = x & mask
    for r in range(keys.shape[1]):
        f = _mix64(right ^ keys[:, r]) & mask
        left, right = right, left ^ f
    return (left << half) | right


class IndexPermutation:
    """A seeded permutation of ``range(n)``: ``perm[i]`` and ``perm.take(array)``.

    Why not ``rng.permutation(n)``: that stores ``n`` integers; this stores six round keys, so
    a new order per epoch of a billion records costs nothing and any position is O(1).

    >>> p = IndexPermutation(10, key=7)
    >>> sorted(p.take(np.arange(10)).tolist()) == list(range(10))
    True
    >>> [p[i] for i in range(3)] == p.take(np.arange(3)).tolist()
    True
    """

    ROUNDS = 6

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"permutation size must be >= 0, got {n}")
        self.n = int(n)
        self.key = int(key) & 0xFFFFFFFFFFFFFFFF
        bits = max(2, int(max(self.n - 1, 1)).bit_length())
        if bits % 2:
            bits += 1
        self._half = bits // 2
        self._mask = np.uint64((1 << self._half) - 1)
        keys = _mix64(
            np.arange(1, self.ROUNDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(self.key)
        )
        self._round_keys = [np.uint64(k) for k in keys]
        self._int_keys = [int(k) for k in keys]

    def __len__(self) -> int:
        return self.n

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half)
        left = x >> h
        right = x & self._mask
        for k in self._round_keys:
            f = _mix64(right ^ k) & self._mask
            left, right = right, left ^ f
        return (left << h) | right

    def take(self, idx: np.ndarray) -> np.ndarray:
        """Permuted positions for an array of indices in ``[0, n)`` (vectorised).

        >>> IndexPermutation(5, key=1).take(np.arange(5)).shape
        (5,)
        """
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"index out of range for a permutation of size {self.n}")
        x = idx.astype(np.uint64)
        n = np.uint64(self.n)
        out = self._feistel(x)
        bad = out >= n
        while bad.any():  # cycle-walk: expected < 4 rounds since the domain is < 4n
            out[bad] = self._feistel(out[bad])
            bad = out >= n
        return out.astype(np.int64)

    @staticmethod
    def take_each(perms: Sequence[IndexPermutation], which: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """``perms[which[k]].take(idx[k])`` for every ``k``, in one vectorised pass whatever the
        number of distinct permutations (each element carries its permutation's round keys,
        half width and size). Why: with many lanes a work source's lookahead spans every
        shard of a dataset, and a loop over shards cost twice its whole per-record budget.

        >>> a, b = IndexPermutation(10, key=1), IndexPermutation(1000, key=2)
        >>> got = IndexPermutation.take_each([a, b], np.array([0, 1, 0]), np.array([3, 500, 9]))
        >>> got.tolist() == [a[3], b[500], a[9]]
        True
        """
        which = np.asarray(which, dtype=np.int64)
        idx = np.asarray(idx, dtype=np.int64)
        if len(perms) == 1:
            return perms[0].take(idx)
        n = np.array([q.n for q in perms], dtype=np.int64)[which]
        if idx.size and (idx.min() < 0 or bool((idx >= n).any())):
            raise IndexError("index out of range for its permutation")
        half = np.array([q._half for q in perms], dtype=np.uint64)[which]
        mask = np.array([int(q._mask) for q in perms], dtype=np.uint64)[which]
        keys = np.array([q._int_keys for q in perms], dtype=np.uint64).reshape(len(perms), -1)[which]
        nu = n.astype(np.uint64)
        out = _feistel_each(idx.astype(np.uint64), half, mask, keys)
        bad = out >= nu
        while bad.any():  # cycle-walk per element, exactly as take()
            out[bad] = _feistel_each(out[bad], half[bad], mask[bad], keys[bad])
            bad = out >= nu
        return out.astype(np.int64)

    def __getitem__(self, i: int) -> int:
        """One position, in plain Python integers (no numpy overhead: the per-record hot path)."""
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for a permutation of size {self.n}")
        x = self._feistel_int(int(i))
        while x >= self.n:
            x = self._feistel_int(x)
        return x

    def _feistel_int(self, x: int) -> int:
        h, mask, m64 = self._half, int(self._mask), 0xFFFFFFFFFFFFFFFF
        left, right = x >> h, x & mask
        for k in self._int_keys:
            z = right ^ k
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
            z ^= z >> 31
            left, right = right, left ^ (z & mask)
        return (left << h) | right

    def __repr__(self) -> str:
        return f"IndexPermutation(n={self.n}, key={self.key})"
