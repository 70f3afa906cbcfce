"""The model-parallel peers of a DP rank over ``torch.distributed``: one reads, the others receive.

TorchTitan builds its data-loading mesh as ``("pp", "batch", "cp", "tp")`` and hands the loader
only the ``batch`` coordinate (``dp_rank``); the ranks that share a ``dp_rank`` are the pipeline,
context and tensor-parallel peers of that DP rank, and they train on the same rows.
:meth:`DistPeerLink.for_dp_rank` finds them by gathering every rank's ``dp_rank`` once (so it
needs no knowledge of the mesh's layout and works for any trainer that passes ``dp_rank``),
makes one gloo group per DP rank (a CPU group also under NCCL: the batch is numpy on the host),
and names the lowest global rank of each group its leader (:class:`zephon.recipe.peers.LeaderBatches`).

Per recipe step the leader makes two broadcasts: the sizes, then one buffer holding a small pickled
header (step, lane digests, the fields that are not plain arrays, such as ``provenance``) and every
numpy array as raw aligned bytes, so followers get byte-identical arrays without pickling the bulk.
(Pickle is only the transport between the peers of one job, as in ``broadcast_object_list``;
nothing pickled is stored.) Startup: one ``all_gather_object`` of an int and one
``new_subgroups_by_enumeration`` (O(world size) on every rank, once).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["DistPeerLink"]


class DistPeerLink:
    """A :class:`zephon.recipe.peers.PeerLink` over a ``torch.distributed`` group of peers.

    ``ranks``: the global ranks of the group, leader first (the lowest)."""

    def __init__(self, group: Any, ranks: list[int]) -> None:
        self.group, self.ranks = group, sorted(ranks)
        self.src = self.ranks[0]
        self._leader = dist.get_rank() == self.src
        self.bytes_sent = 0  # array bytes broadcast by this peer (leader) or received (follower)

    @property
    def leader(self) -> bool:
        """True on the group's lowest rank: it runs the pipeline and sends."""
        return self._leader

    @classmethod
    def for_dp_rank(cls, dp_rank: int, dp_world_size: int) -> DistPeerLink | None:
        """The peers of ``dp_rank`` in the default process group, or None when there are none
        (no process group, or one rank per DP rank). Every rank must call it (a collective)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        if world == dp_world_size:
            return None
        got: list[Any] = [None] * world
        dist.all_gather_object(got, int(dp_rank))
        groups = [[r for r in range(world) if got[r] == b] for b in range(dp_world_size)]
        sizes = {len(g) for g in groups}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(
                f"zephon read-once: the {world} ranks report DP ranks {sorted(set(got))[:8]} for a DP degree of "
                f"{dp_world_size}; every DP rank needs the same number of model-parallel peers (ranks per DP rank: "
                f"{[len(g) for g in groups][:8]}). Pass each rank's dp_rank as the trainer's batch mesh gives it, or "
                "set read_once = False."
            )
        mine, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
        return cls(mine, groups[int(dp_rank)])

    def send(self, message: dict[str, Any]) -> None:
        """Leader: broadcast one step's message (sizes, then one buffer) to the group."""
        header = dict(message)
        arrays: list[np.ndarray] = []
        batch = message.get("batch")
        if isinstance(batch, dict):
            rest, specs = {}, []
            for k, v in batch.items():
                if isinstance(v, np.ndarray) and v.dtype.kind in "biuf":
                    arrays.append(np.ascontiguousarray(v))
                    specs.append((k, v.dtype.str, v.shape))
                else:
                    rest[k] = v
            header.update(batch=rest, arrays=specs, order=list(batch))
        head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        offsets, total = _layout(len(head), [a.nbytes for a in arrays])
        buf = np.empty(total, np.uint8)
        buf[: len(head)] = np.frombuffer(head, np.uint8)
        for a, off in zip(arrays, offsets):
            buf[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
        dist.broadcast(torch.tensor([len(head), total], dtype=torch.int64), src=self.src, group=self.group)
        dist.broadcast(torch.from_numpy(buf), src=self.src, group=self.group)
        self.bytes_sent += total

    def recv(self) -> dict[str, Any]:
        """Follower: the leader's next message; its arrays are views of the received buffer."""
        sizes = torch.empty(2, dtype=torch.int64)
        dist.broadcast(sizes, src=self.src, group=self.group)
        n_head, total = (int(x) for x in sizes)
        buf = torch.empty(total, dtype=torch.uint8)
        dist.broadcast(buf, src=self.src, group=self.group)
        self.bytes_sent += total
        raw = buf.numpy()
        header: dict[str, Any] = pickle.loads(raw[:n_head].tobytes())
        specs = header.pop("arrays", [])
        if specs:
            shapes = [(np.dtype(dt), shape) for _, dt, shape in specs]
            offsets, _ = _layout(n_head, [dt.itemsize * int(np.prod(shape, dtype=np.int64)) for dt, shape in shapes])
            batch = header["batch"]
            for (key, _, _), (dt, shape), off in zip(specs, shapes, offsets):
                n = dt.itemsize * int(np.prod(shape, dtype=np.int64))
                batch[key] = raw[off : off + n].view(dt).reshape(shape)
        if "order" in header:  # the sender's key order
            batch = header["batch"]
            header["batch"] = {k: batch[k] for k in header.pop("order")}
        return header

    def __repr__(self) -> str:
        role = "leader" if self.leader else "follower"
        return f"DistPeerLink({role}, ranks={self.ranks})"


#: byte alignment of each array in a step's buffer (so every view is aligned for its dtype)
ALIGN = 64


def _layout(head: int, sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of the arrays after a header of ``head`` bytes, each aligned, and the total size."""
    offsets, pos = [], head
    for n in sizes:
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += n
    return offsets, pos
