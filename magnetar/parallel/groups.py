"""Tensor-parallel (TP), context-parallel (CP) and data-parallel (DP) process groups: pure rank math plus
group creation.

Layout (Megatron-style, TP innermost, then CP, then DP): ``world_size = tp_size x cp_size x dp_size`` and
global rank ``r = (dp_index * cp_size + cp_index) * tp_size + tp_index``. A TP group is ``tp_size``
*consecutive* ranks (one node: its per-layer all-reduces ride NVLink); a CP group takes one rank of each of
``cp_size`` consecutive TP groups (stride ``tp_size``), so with ``tp_size x cp_size`` dividing the GPUs per node
its KV exchanges stay inside the node too; a DP group (one replica per member) has stride ``tp_size x cp_size``.

Worked example, world_size = 8, tp_size = 2, cp_size = 2 (so dp_size = 2); mesh[dp][cp][tp] =
``[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]``::

    tp groups : [0, 1]  [2, 3]  [4, 5]  [6, 7]      rank 5 -> tp_rank 1 in tp group [4, 5]
    cp groups : [0, 2]  [1, 3]  [4, 6]  [5, 7]      rank 5 -> cp_rank 0 in cp group [5, 7]
    dp groups : [0, 4]  [1, 5]  [2, 6]  [3, 7]      rank 5 -> dp_rank 1 in dp group [1, 5]
    replicas  : [0, 1, 2, 3]  [4, 5, 6, 7]          rank 5 -> in replica [4, 5, 6, 7]

A *replica* is the TP x CP unit that serves one request together (``mesh[dp]``): its ranks agree on the
request and receive the chosen token from its first rank.

With ``tp_size`` 1 every TP group is one rank and the layout is CP innermost (``tp_size`` > 1 puts TP innermost:
consecutive ranks share one model's weights, see ``rank_grid``); world_size = 8,
cp_size = 4::

    cp groups : [0, 1, 2, 3]  [4, 5, 6, 7]          rank 6 -> cp_rank 2 in cp group 1
    dp groups : [0, 4]  [1, 5]  [2, 6]  [3, 7]      rank 6 -> dp_rank 1 in dp group 2

Groups are created once by :func:`init_groups` and carried in the frozen :class:`ParallelGroups`; every
collective in Magnetar takes one of these groups explicitly (never the implicit WORLD group) and a timeout.
:mod:`magnetar.parallel.mpu` exposes them as the Megatron/DeepSpeed ``mpu`` interface and a ``DeviceMesh``.
This module knows nothing about attention or models.
"""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(seconds=float(os.environ.get("MAGNETAR_COLLECTIVE_TIMEOUT_S", "600")))


def _check_count(value, name: str, what: str) -> None:
    """``value`` is an int >= 1 (not a bool, not a float such as 2.0); else a ValueError naming ``name``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int >= 1 ({what}), got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}; set {name} to {what}")


def _check_timeout(timeout) -> None:
    if not isinstance(timeout, timedelta):
        raise ValueError(f"timeout must be a datetime.timedelta (e.g. timedelta(seconds=600)), got "
                         f"{type(timeout).__name__} {timeout!r}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class RankGrid:
    """The TP x CP x DP layout of ``world_size`` global ranks (pure data; see the module docstring).

    ``mesh[d][c][t]`` is the global rank at dp index ``d``, cp index ``c``, tp index ``t`` (shape
    ``dp_size x cp_size x tp_size``, row-major: ``torch.tensor(mesh)`` is a DeviceMesh's mesh for dims
    ``("dp", "cp", "tp")``). Each ``*_groups`` list holds every group of that kind, in group order, ranks
    ascending; every rank is in exactly one group of each kind. ``replica_groups[d]`` is ``mesh[d]`` flattened:
    the ``tp_size x cp_size`` ranks of one model replica.
    """

    world_size: int
    tp_size: int
    cp_size: int
    dp_size: int
    mesh: list[list[list[int]]]
    tp_groups: list[list[int]]
    cp_groups: list[list[int]]
    dp_groups: list[list[int]]
    replica_groups: list[list[int]]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_index, cp_index, tp_index)`` of global ``rank``; these are also its dp/cp/tp rank."""
        if not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}) (a global rank of this world), got "
                             f"{type(rank).__name__} {rank!r}")
        rest, t = divmod(rank, self.tp_size)
        d, c = divmod(rest, self.cp_size)
        return d, c, t


def rank_grid(world_size: int, cp_size: int, tp_size: int = 1) -> RankGrid:
    """The :class:`RankGrid` of ``world_size`` ranks: TP innermost (consecutive ranks), then CP, then DP.

    Raises ValueError when a size is not an int >= 1 or ``tp_size x cp_size`` does not divide ``world_size``
    (the message lists every degree and the world size, and which sizes would fit).
    """
    _check_count(world_size, "world_size", "the number of ranks launched")
    _check_count(cp_size, "cp_size", "the number of ranks sharing one context")
    _check_count(tp_size, "tp_size", "the number of ranks sharing one model's weights")
    rule = "world size = tp_size x cp_size x dp_size, dp_size a whole number"
    if world_size % tp_size:
        raise ValueError(
            f"world size {world_size} is not divisible by tp_size {tp_size} (with cp_size {cp_size}; {rule}): "
            f"choose tp_size from {_divisors(world_size)} or launch a multiple of {tp_size * cp_size} ranks"
        )
    if world_size % (tp_size * cp_size):
        raise ValueError(
            f"world size {world_size} is not divisible by cp_size {cp_size} x tp_size {tp_size} = "
            f"{cp_size * tp_size} ({rule}): with tp_size {tp_size} choose cp_size from "
            f"{_divisors(world_size // tp_size)}, or launch a multiple of {tp_size * cp_size} ranks"
        )
    dp_size = world_size // (tp_size * cp_size)
    mesh = [[[(d * cp_size + c) * tp_size + t for t in range(tp_size)] for c in range(cp_size)]
            for d in range(dp_size)]
    tp_groups = [mesh[d][c] for d in range(dp_size) for c in range(cp_size)]
    cp_groups = [[mesh[d][c][t] for c in range(cp_size)] for d in range(dp_size) for t in range(tp_size)]
    dp_groups = [[mesh[d][c][t] for d in range(dp_size)] for c in range(cp_size) for t in range(tp_size)]
    replica_groups = [[r for tp_group in mesh[d] for r in tp_group] for d in range(dp_size)]
    return RankGrid(world_size=world_size, tp_size=tp_size, cp_size=cp_size, dp_size=dp_size, mesh=mesh,
                    tp_groups=tp_groups, cp_groups=cp_groups, dp_groups=dp_groups, replica_groups=replica_groups)


def rank_layout(world_size: int, cp_size: int, tp_size: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """``(cp_groups, dp_groups)`` as lists of global ranks (:func:`rank_grid` has the TP groups too).

    Raises ValueError when a size is not an int >= 1 or ``tp_size x cp_size`` does not divide ``world_size``.
    """
    grid = rank_grid(world_size, cp_size, tp_size)
    return grid.cp_groups, grid.dp_groups


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the TP x CP x DP layout. Groups are None only on the world-size-1 path
    (:func:`local_groups`); under :func:`init_groups` every group is a real one, also of size 1."""

    rank: int
    world_size: int
    cp_size: int
    cp_rank: int
    cp_group: Optional[dist.ProcessGroup]
    cp_ranks: tuple[int, ...]
    dp_size: int
    dp_rank: int
    dp_group: Optional[dist.ProcessGroup]
    dp_ranks: tuple[int, ...] = ()
    timeout: timedelta = field(default=DEFAULT_TIMEOUT)
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Optional[dist.ProcessGroup] = None
    tp_ranks: tuple[int, ...] = ()
    # the TP x CP ranks of this rank's model replica (the CP group at tp_size 1, the TP group at cp_size 1)
    replica_group: Optional[dist.ProcessGroup] = None
    replica_ranks: tuple[int, ...] = ()

    @property
    def is_cp_leader(self) -> bool:
        """cp_rank 0: the rank that owns the query's and generated tokens' KV (no other rank appends them)."""
        return self.cp_rank == 0

    @property
    def is_replica_leader(self) -> bool:
        """cp_rank 0 and tp_rank 0: the replica's first rank, which chooses every token (then broadcast) and, in a
        server, reads the requests and decides the ticks."""
        return self.cp_rank == 0 and self.tp_rank == 0

    @property
    def replica_size(self) -> int:
        """``tp_size x cp_size``: the ranks that serve one request together."""
        return self.tp_size * self.cp_size


def local_groups(*, timeout: timedelta = DEFAULT_TIMEOUT) -> ParallelGroups:
    """A group of this process alone (no collectives, nothing created): the world-size-1 layout, also used
    under a launcher by work that never talks to other ranks (e.g. simulated CP ranks)."""
    _check_timeout(timeout)
    return ParallelGroups(rank=0, world_size=1, cp_size=1, cp_rank=0, cp_group=None, cp_ranks=(0,),
                          dp_size=1, dp_rank=0, dp_group=None, dp_ranks=(0,), timeout=timeout,
                          tp_size=1, tp_rank=0, tp_group=None, tp_ranks=(0,), replica_group=None,
                          replica_ranks=(0,))


def init_groups(cp_size: int, *, tp_size: int = 1, timeout: timedelta = DEFAULT_TIMEOUT) -> ParallelGroups:
    """Create the TP, CP and DP groups on an already initialised ``torch.distributed`` (every rank must call).

    Without an initialised process group only ``cp_size == tp_size == 1`` is possible: the world-size-1 path,
    with no groups (collectives short-circuit). ``timeout`` applies to every collective on these groups.
    """
    _check_count(cp_size, "cp_size", "the number of ranks sharing one context")
    _check_count(tp_size, "tp_size", "the number of ranks sharing one model's weights")
    _check_timeout(timeout)
    if not dist.is_available() or not dist.is_initialized():
        if cp_size != 1 or tp_size != 1:
            name, value = ("cp_size", cp_size) if cp_size != 1 else ("tp_size", tp_size)
            raise ValueError(
                f"{name}={value} needs torch.distributed: launch with `deepspeed` or `torchrun` (or call "
                f"magnetar.launch.init_distributed() first); without it only cp_size=1 and tp_size=1 run"
            )
        return local_groups(timeout=timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = rank_grid(world, cp_size, tp_size)
    mine = {}
    # new_group is collective over the world: every rank creates every group, in the same order. CP and DP
    # groups come first, as before TP existed; TP groups (one rank each at tp_size 1) are created too, so that
    # the mpu interface never hands out None (which torch.distributed reads as WORLD). A replica is the CP group
    # when tp_size is 1 and the TP group when cp_size is 1: those reuse the group already made.
    for kind, groups in (("cp", grid.cp_groups), ("dp", grid.dp_groups), ("tp", grid.tp_groups)):
        for ranks in groups:
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[kind] = (g, tuple(ranks))
    if tp_size == 1 or cp_size == 1:
        mine["replica"] = mine["cp" if tp_size == 1 else "tp"]
    else:
        for ranks in grid.replica_groups:
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine["replica"] = (g, tuple(ranks))
    dp_index, cp_index, tp_index = grid.coords(rank)
    return ParallelGroups(
        rank=rank, world_size=world, cp_size=cp_size, cp_rank=cp_index, cp_group=mine["cp"][0],
        cp_ranks=mine["cp"][1], dp_size=grid.dp_size, dp_rank=dp_index, dp_group=mine["dp"][0],
        dp_ranks=mine["dp"][1], timeout=timeout, tp_size=tp_size, tp_rank=tp_index, tp_group=mine["tp"][0],
        tp_ranks=mine["tp"][1], replica_group=mine["replica"][0], replica_ranks=mine["replica"][1],
    )


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Size of ``group``; None (world-size-1 path) counts as 1."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank inside ``group``; None counts as rank 0."""
    return 0 if group is None else dist.get_rank(group)


def group_ranks(group: Optional[dist.ProcessGroup]) -> list[int]:
    """Global ranks of ``group`` in group order (P2P peers are addressed by global rank)."""
    return [0] if group is None else dist.get_process_group_ranks(group)
