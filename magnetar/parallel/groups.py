"""Context-parallel (CP) and data-parallel (DP) process groups: pure rank math plus group creation.

Layout (Megatron-style, CP innermost): the world is split into ``dp_size = world_size / cp_size`` replicas,
each a CP group of ``cp_size`` *consecutive* global ranks, so a CP group stays inside one node whenever
``cp_size`` divides the GPUs per node (its KV exchanges then ride NVLink, not the network).

Worked example, world_size = 8, cp_size = 4::

    cp groups : [0, 1, 2, 3]  [4, 5, 6, 7]          rank 6 -> cp_rank 2 in cp group 1
    dp groups : [0, 4]  [1, 5]  [2, 6]  [3, 7]      rank 6 -> dp_rank 1 in dp group 2

Groups are created once by :func:`init_groups` and carried in the frozen :class:`ParallelGroups`; every
collective in Magnetar takes one of these groups explicitly (never the implicit WORLD group) and a timeout.
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


def rank_layout(world_size: int, cp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(cp_groups, dp_groups)`` as lists of global ranks; see the module docstring for the layout.

    Raises ValueError when a size is not an int >= 1 or ``cp_size`` does not divide ``world_size``.
    """
    _check_count(world_size, "world_size", "the number of ranks launched")
    _check_count(cp_size, "cp_size", "the number of ranks sharing one context")
    if world_size % cp_size:
        raise ValueError(
            f"world size {world_size} is not divisible by cp_size {cp_size}: cp_size x dp_size must equal the "
            f"world size; choose cp_size from {[d for d in range(1, world_size + 1) if world_size % d == 0]} or "
            f"launch a multiple of {cp_size} ranks"
        )
    dp_size = world_size // cp_size
    cp_groups = [list(range(d * cp_size, (d + 1) * cp_size)) for d in range(dp_size)]
    dp_groups = [list(range(c, world_size, cp_size)) for c in range(cp_size)]
    return cp_groups, dp_groups


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the CP x DP layout. Groups are None only on the world-size-1 path."""

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

    @property
    def is_cp_leader(self) -> bool:
        """cp_rank 0: the rank that owns the query's and generated tokens' KV (no other rank appends them)."""
        return self.cp_rank == 0


def local_groups(*, timeout: timedelta = DEFAULT_TIMEOUT) -> ParallelGroups:
    """A group of this process alone (no collectives, nothing created): the world-size-1 layout, also used
    under a launcher by work that never talks to other ranks (e.g. simulated CP ranks)."""
    _check_timeout(timeout)
    return ParallelGroups(rank=0, world_size=1, cp_size=1, cp_rank=0, cp_group=None, cp_ranks=(0,),
                          dp_size=1, dp_rank=0, dp_group=None, dp_ranks=(0,), timeout=timeout)


def init_groups(cp_size: int, *, timeout: timedelta = DEFAULT_TIMEOUT) -> ParallelGroups:
    """Create the CP and DP groups on an already initialised ``torch.distributed`` (every rank must call).

    Without an initialised process group only ``cp_size == 1`` is possible: the world-size-1 path, with
    no groups (collectives short-circuit). ``timeout`` applies to every collective on these groups.
    """
    _check_count(cp_size, "cp_size", "the number of ranks sharing one context")
    _check_timeout(timeout)
    if not dist.is_available() or not dist.is_initialized():
        if cp_size != 1:
            raise ValueError(
                f"cp_size={cp_size} needs torch.distributed: launch with `deepspeed` or `torchrun` (or call "
                f"magnetar.launch.init_distributed() first); without it only cp_size=1 runs"
            )
        return local_groups(timeout=timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    cp_groups, dp_groups = rank_layout(world, cp_size)
    my_cp = my_dp = None
    # new_group is collective over the world: every rank creates every group, in the same order.
    for ranks in cp_groups:
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            my_cp = (g, ranks)
    for ranks in dp_groups:
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            my_dp = (g, ranks)
    return ParallelGroups(
        rank=rank, world_size=world, cp_size=cp_size, cp_rank=my_cp[1].index(rank), cp_group=my_cp[0],
        cp_ranks=tuple(my_cp[1]), dp_size=world // cp_size, dp_rank=my_dp[1].index(rank), dp_group=my_dp[0],
        dp_ranks=tuple(my_dp[1]), timeout=timeout,
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
