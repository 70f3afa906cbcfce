"""Stable random streams: every draw derives from (seed, lane, operator, epoch, counter).

Never from ``hash()``, time, rank, worker id or thread scheduling, so a lane's randomness is
the same whatever the world size or worker count.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["lane_rng", "op_key", "seed_sequence", "stable_u64"]

_MASK64 = (1 << 64) - 1


def op_key(name: str) -> int:
    """A stable 64-bit key for an operator name (sha256, not Python's salted ``hash``).

    >>> op_key("shuffle") == op_key("shuffle") != op_key("pack")
    True
    """
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")


def seed_sequence(seed: int, lane: int, op: str, epoch: int = 0, counter: int = 0) -> np.random.SeedSequence:
    """The seed sequence for one (seed, lane, operator, epoch, counter) stream.

    >>> seed_sequence(1234, 3, "shuffle").spawn_key[0]
    3
    """
    for what, v in (("seed", seed), ("lane", lane), ("epoch", epoch), ("counter", counter)):
        if int(v) < 0:
            raise ValueError(f"{what} must be a non-negative integer, got {v}")
    return np.random.SeedSequence(entropy=int(seed), spawn_key=(int(lane), op_key(op), int(epoch), int(counter)))


def lane_rng(seed: int, lane: int, op: str, epoch: int = 0, counter: int = 0) -> np.random.Generator:
    """A Philox generator for one stream; cheap to rebuild at any (epoch, counter).

    >>> a = lane_rng(1234, 3, "shuffle", epoch=0, counter=5).integers(1000, size=3)
    >>> b = lane_rng(1234, 3, "shuffle", epoch=0, counter=5).integers(1000, size=3)
    >>> bool((a == b).all()), bool((a == lane_rng(1234, 4, "shuffle", 0, 5).integers(1000, size=3)).all())
    (True, False)
    """
    return np.random.Generator(np.random.Philox(seed_sequence(seed, lane, op, epoch, counter)))


def stable_u64(*parts: int | str) -> int:
    """A stable 64-bit integer from ints and strings (used for keys of permutations).

    Same value in every process and run (unlike ``hash()``, which Python salts per process).

    >>> stable_u64("web", 0, 2) == stable_u64("web", 0, 2) != stable_u64("web", 0, 3)
    True
    """
    h = hashlib.sha256()
    for p in parts:
        h.update(str(p).encode("utf-8"))
        h.update(b"\x00")
    return int.from_bytes(h.digest()[:8], "little")
