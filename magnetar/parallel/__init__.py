"""Process groups, collectives on attention states, and ring attention. Depends on ``magnetar.ops`` only."""
from magnetar.parallel.collectives import all_gather_states
from magnetar.parallel.groups import DEFAULT_TIMEOUT, ParallelGroups, init_groups, local_groups, rank_layout
from magnetar.parallel.ring import contiguous_indices, ring_attention, shard, unshard, zigzag_indices

__all__ = [
    "ParallelGroups", "init_groups", "local_groups", "rank_layout", "DEFAULT_TIMEOUT", "all_gather_states", "ring_attention",
    "zigzag_indices", "contiguous_indices", "shard", "unshard",
]
