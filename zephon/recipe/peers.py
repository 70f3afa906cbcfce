"""Read once per data-parallel rank: the model-parallel peers of a DP rank share one pipeline.

With tensor, pipeline or context parallelism, several ranks (the *peers* of one DP rank) train on
the same rows. Each building its own lanes makes identical batches at N times the CPU: every peer
reads, decodes and tokenizes the same bytes. Here one peer, the *leader*
(:class:`LeaderBatches`), runs the DP rank's pipeline and sends each recipe step through a
:class:`PeerLink`; the others (:class:`FollowerBatches`) open no pipeline, index nothing, start no
workers, and receive the step (TorchTitan: :mod:`zephon.integrations.peers`, a gloo broadcast over
the peers). Slices, the "checkpoint between steps" rule and the end of a finite recipe are
:class:`RankBatches`' on every peer, so peers hand out the same rows in the same calls.

The checkpoint stays one lane-keyed state per DP rank: the leader's. A follower's state is empty,
so a distributed checkpoint stores every lane once and, on load, gives each lane to the leader that
owns it now (elastic in DP as before; a checkpoint written with every peer reading loads here, and
the other way round).

The leader's message of a step carries the batch, the step number, the lane digests (for the
ledger) and a digest of the data definition, which a follower checks against its own recipe: a
peer configured with another recipe is refused, not silently fed the leader's rows. A leader that
fails sends the error before raising, so its followers fail with it instead of waiting.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Protocol

from zephon.engine import PipelineError, WorkerConfig
from zephon.engine.end import LaneEnd

from .recipe import Recipe
from .runtime import RankBatches

__all__ = ["FollowerBatches", "LeaderBatches", "PeerLink", "definition_digest"]


class PeerLink(Protocol):
    """How the leader of a DP rank's peers reaches the others: ``send`` on the leader, ``recv`` on
    each follower, one message per recipe step (a dict; ``"batch"`` holds numpy arrays)."""

    @property
    def leader(self) -> bool:
        """True on the peer that runs the pipeline."""
        ...

    def send(self, message: dict[str, Any]) -> None:
        """Leader: deliver ``message`` to every follower."""
        ...

    def recv(self) -> dict[str, Any]:
        """Follower: the leader's next message."""
        ...


def definition_digest(recipe: Recipe) -> str:
    """SHA-256 of the recipe's data definition (no I/O: the TOML's values, not the files')."""
    text = json.dumps(recipe.data_definition(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class LeaderBatches(RankBatches):
    """:class:`RankBatches` that sends every recipe step (and the end, or an error) to its peers."""

    def __init__(self, recipe: Recipe, world_size: int, rank: int, *, link: PeerLink, **kw: Any) -> None:
        self._link = link
        self._definition = definition_digest(recipe)
        super().__init__(recipe, world_size, rank, **kw)

    def _next_step(self) -> dict[str, Any]:
        # the hook under RankBatches' lock that both next_step and next_slice call, so every step
        # fetched is sent, whichever way it was asked for, and in the order it was fetched
        if self.ended:
            raise StopIteration  # the followers saw the end already
        try:
            batch = super()._next_step()
        except StopIteration:
            self._link.send({"end": True, "step": self.step, "lane_end": self.end, "definition": self._definition})
            raise
        except Exception as e:
            self._link.send({"error": f"{type(e).__name__}: {e}", "step": self.step, "definition": self._definition})
            raise
        digests = self.lane_digests() if self._digests else None
        self._link.send({"batch": batch, "step": self.step, "digests": digests, "definition": self._definition})
        return batch


class _Received:
    """A follower's stand-in for the router: each step is the leader's message."""

    node_type = "peer"

    def __init__(self, link: PeerLink, definition: str, rank: int) -> None:
        self._link, self._definition, self._rank = link, definition, rank
        self.step = 0
        self.end: LaneEnd | None = None
        self.last_lane_digests: list[str] | None = None
        self.received = 0  # steps received (the follower's whole work)

    def __next__(self) -> dict[str, Any]:
        m = self._link.recv()
        if m.get("definition") != self._definition:
            raise PipelineError(
                f"read-once peers of DP rank {self._rank}: this peer's recipe has data definition "
                f"{self._definition}, the leader's {m.get('definition')}; every peer of a DP rank must load the "
                "same recipe with the same overrides (or set read_once = False to let each peer read alone)"
            )
        if "error" in m:
            raise PipelineError(
                f"read-once leader of DP rank {self._rank} failed at step {m['step'] + 1}: {m['error']}"
            )
        self.step = int(m["step"])
        if m.get("end"):
            self.end = m.get("lane_end")
            raise StopIteration
        self.last_lane_digests = m.get("digests")
        self.received += 1
        batch: dict[str, Any] = m["batch"]
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {}  # the leader's state is the DP rank's

    def reset(self, initial_state: Mapping[str, Any] | None = None) -> None:
        """Nothing to restore: the leader restores the lanes; the next message says the step."""

    def summary_metrics(self) -> dict[str, dict[str, Any]]:
        return {"peer": {"node_type": "peer", "items": self.received}}

    def close(self) -> None:
        """Nothing to stop."""


class FollowerBatches(RankBatches):
    """:class:`RankBatches` of a peer that receives each recipe step from its leader (no pipeline).

    Built with the same arguments as the leader's; ``workers`` is ignored (nothing runs here).
    :meth:`state_dict` is empty: the leader's holds the DP rank's lanes."""

    def __init__(
        self,
        recipe: Recipe,
        world_size: int,
        rank: int,
        *,
        link: PeerLink,
        workers: WorkerConfig | None = None,
        **kw: Any,
    ) -> None:
        self._received = _Received(link, definition_digest(recipe), rank)
        super().__init__(recipe, world_size, rank, **kw)

    def _open(self) -> Any:
        return self._received

    @property
    def router(self) -> Any:
        """The follower's stand-in (``summary_metrics``: the steps received)."""
        return self._received

    @property
    def received(self) -> int:
        """Recipe steps received from the leader."""
        return self._received.received
