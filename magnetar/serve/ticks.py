"""The tick: what the serving rank tells the other ranks of its replica before each decode step.

A :class:`Tick` lists the requests to add (token ids and sampling parameters), the requests to cancel, contexts to
encode (``POST /v1/contexts``) or release, chunks of a long context's Phase 1, and whether to stop. The replica's
first rank (cp_rank 0, tp_rank 0) builds it; :func:`broadcast_tick` sends it to every rank of the replica group as
JSON bytes (no pickled objects: a rank never unpickles what arrives over the wire) in two broadcasts (size, then
bytes), each waited on with the groups' timeout -- a rank that died, or a leader that stopped sending, raises
``TimeoutError`` naming the tick instead of hanging. This module knows nothing about HTTP or the engine.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from magnetar.parallel import ParallelGroups
from magnetar.parallel.collectives import wait_all


@dataclass
class Add:
    """One request to add: ``sid`` the server's id; ``request`` the leader's checked request
    (``CheckedRequest.to_dict``: ids, sampling parameters, encoding options, the context's cache key -- checked and
    hashed once, by the leader: every rank applies the same tick, so it holds for each); ``context_id`` a pinned
    context whose KV every rank holds (its ids then stay out of ``request``)."""

    sid: int
    request: dict
    context_id: Optional[str] = None


@dataclass
class Encode:
    """A context to encode and pin under ``cid`` (``POST /v1/contexts``); ``sid`` routes the answer."""

    sid: int
    cid: str
    context_ids: list[int]


@dataclass
class Chunk:
    """A chunk of request ``sid``'s Phase 1 (``--prefill-chunk``): encode ``context_ids`` -- its context's first
    tokens, extending the chunks before it, which every rank holds for the request (not the cache) -- between two
    decode steps."""

    sid: int
    context_ids: list[int]


@dataclass
class Tick:
    adds: list[Add] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)  # sids
    encodes: list[Encode] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # cids
    chunks: list[Chunk] = field(default_factory=list)
    stop: bool = False
    error: Optional[str] = None  # with stop: why the server stops (every rank exits non-zero)

    @property
    def empty(self) -> bool:
        return not (self.adds or self.cancels or self.encodes or self.releases or self.chunks or self.stop)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Tick":
        d = json.loads(data.decode())
        return cls(adds=[Add(**a) for a in d["adds"]], cancels=list(d["cancels"]),
                   encodes=[Encode(**e) for e in d["encodes"]], releases=list(d["releases"]),
                   chunks=[Chunk(**c) for c in d["chunks"]], stop=bool(d["stop"]), error=d["error"])


def broadcast_tick(tick: Optional[Tick], groups: ParallelGroups, device: torch.device) -> Tick:
    """``tick`` (given on the leader, None elsewhere) on every rank of the replica group; a no-op for a replica of
    one rank. Raises TimeoutError after ``groups.timeout`` when a rank of the replica is missing."""
    if groups.replica_group is None or groups.replica_size == 1:
        if tick is None:
            raise ValueError("tick must be given on a replica of one rank (this rank is its leader)")
        return tick
    leader = groups.is_replica_leader
    if leader != (tick is not None):
        raise ValueError("the replica's first rank gives the tick (tick=...), every other rank passes None")
    group, src, timeout = groups.replica_group, groups.replica_ranks[0], groups.timeout
    payload = tick.to_bytes() if leader else b""
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    what = f"the server's tick broadcast from rank {src} over the replica {list(groups.replica_ranks)}"
    wait_all(dist.broadcast(size, src, group=group, async_op=True), timeout, what + " (size)")
    if leader:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    wait_all(dist.broadcast(buf, src, group=group, async_op=True), timeout, what)
    return tick if leader else Tick.from_bytes(buf.cpu().numpy().tobytes())
